"""merge_attention: attention over disjoint key sets, merged from the parts' outputs and lse."""

from __future__ import annotations

import numpy as np
import pytest

import mfa_native
from conftest import relative_l2


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_merging_key_blocks_is_attention_over_all_keys(rng, layout):
    B, Hq, Hkv, R, C, D = 2, 4, 2, 12, 40, 16
    q = rng.standard_normal((B, Hq, R, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, C, D)).astype(np.float32) for _ in range(2))
    mask = rng.random((B, 1, R, C)) > 0.3
    mask[:, :, 0, :] = False  # a row that sees no key at all
    mask[:, :, 1, 10:] = False  # a row whose keys are all in the first block
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    seq = 1 if layout == "bshd" else 2
    blocks = [slice(0, 10), slice(10, 25), slice(25, C)]
    parts = [mfa_native.attention(q, np.take(k, range(C)[b], axis=seq), np.take(v, range(C)[b], axis=seq),
                                  mask=mask[..., b], layout=layout, return_lse=True) for b in blocks]
    o, lse = mfa_native.merge_attention([p[0] for p in parts], [p[1] for p in parts], layout=layout)
    expected_o, expected_lse = mfa_native.attention(q, k, v, mask=mask, layout=layout, return_lse=True)
    assert relative_l2(o, expected_o) < 1e-6
    finite = np.isfinite(expected_lse)
    assert np.array_equal(np.isfinite(lse), finite) and not finite.all()
    assert relative_l2(lse[finite], expected_lse[finite]) < 1e-6


def test_merge_returns_the_given_kind(rng):
    torch = pytest.importorskip("torch")
    o1, o2 = (torch.randn(1, 2, 3, 4) for _ in range(2))
    l1, l2 = (torch.randn(1, 2, 3) for _ in range(2))
    o, lse = mfa_native.merge_attention([o1, o2], [l1, l2])
    assert type(o) is torch.Tensor and type(lse) is torch.Tensor
    expected = torch.logaddexp(l1, l2)
    assert torch.allclose(lse, expected)
    assert torch.allclose(o, (l1 - expected).exp()[..., None] * o1 + (l2 - expected).exp()[..., None] * o2, atol=1e-6)


def test_merge_errors(rng):
    o = np.zeros((1, 2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="one length"):
        mfa_native.merge_attention([o, o], [np.zeros((1, 2, 3), np.float32)])
    with pytest.raises(ValueError, match=r"lses\[0\] must have shape"):
        mfa_native.merge_attention([o], [np.zeros((1, 3, 2), np.float32)])
    with pytest.raises(ValueError, match="one dtype and shape"):
        mfa_native.merge_attention([o, o[..., :2]], [np.zeros((1, 2, 3), np.float32)] * 2)
