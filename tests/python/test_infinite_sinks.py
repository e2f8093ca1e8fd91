"""FlashMLA's infinite sinks in every op that takes sinks: -inf is no sink; +inf takes every
weight (output 0, lse +inf, no gradient). Head 0 has -inf, head 1 +inf, the others finite."""

from __future__ import annotations

import numpy as np
import pytest

import mfa_native
from conftest import relative_l2
from mfa_native import reference
from mfa_native.runtime.devices import tuned_as

B, HQ, HKV, D = 1, 4, 2, 16


def _problem(rng, R, C):
    q = rng.standard_normal((B, HQ, R, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, C, D)).astype(np.float32) for _ in range(2))
    sinks = np.float32([-np.inf, np.inf, *rng.standard_normal(HQ - 2)])
    return q, k, v, sinks


def _check_forward(out, lse, q, k, v, sinks, expected, expected_lse):
    assert not out[:, 1].any() and np.isposinf(lse[:, 1]).all(), "+inf: every weight to the sink"
    assert relative_l2(out, expected) < 1e-5
    np.testing.assert_allclose(lse[:, [0, 2, 3]], expected_lse[:, [0, 2, 3]], rtol=1e-5, atol=1e-5)
    assert np.isposinf(expected_lse[:, 1]).all()


@pytest.mark.parametrize("R, C", [(9, 37), (1, 1500)], ids=["one pass", "split decode"])
def test_attention_forward_and_backward(rng, R, C):
    q, k, v, sinks = _problem(rng, R, C)
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as profile:
        out, lse = mfa_native.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    assert ("attention_combine" in [r.kernel for r in profile.records]) == (R == 1)
    expected, expected_lse = reference.attention_reference(q, k, v, sinks=sinks, causal=True, return_lse=True)
    _check_forward(out, lse, q, k, v, sinks, expected, expected_lse)
    none, none_lse = mfa_native.attention(q[:, :1], k[:, :1], v[:, :1], causal=True, return_lse=True)
    np.testing.assert_allclose(out[:, :1], none, rtol=1e-6, atol=1e-6)   # -inf is no sink
    do = rng.standard_normal(out.shape).astype(np.float32)
    grads = mfa_native.attention_backward(q, k, v, out, lse, do, sinks=sinks, causal=True)
    expected_grads = reference.attention_backward_reference(q, k, v, do, sinks=sinks, causal=True, out=out)
    for grad, want in zip(grads, expected_grads):
        assert np.isfinite(grad).all() and relative_l2(grad, want) < 1e-4
    assert not grads[0][:, 1].any() and grads[3][0] == 0 and grads[3][1] == 0


def test_sparse_attention(rng):
    q, k, v, sinks = _problem(rng, 7, 40)
    indices = rng.integers(-1, 40, (B, HKV, 7, 12)).astype(np.int32)
    out, lse = mfa_native.sparse_attention(q, k, v, indices, sinks=sinks, return_lse=True)
    expected, expected_lse = reference.sparse_attention_reference(q, k, v, indices, sinks=sinks, return_lse=True)
    _check_forward(out, lse, q, k, v, sinks, expected, expected_lse)
    do = rng.standard_normal(out.shape).astype(np.float32)
    grads = mfa_native.sparse_attention_backward(q, k, v, indices, out, lse, do, sinks=sinks)
    expected_grads = reference.sparse_attention_backward_reference(q, k, v, do, indices, sinks=sinks, out=out)
    for grad, want in zip(grads, expected_grads):
        assert np.isfinite(grad).all() and relative_l2(grad, want) < 1e-4


def test_block_sparse_attention(rng):
    q, k, v, sinks = _problem(rng, 24, 40)
    block_mask = mfa_native.BlockMask.from_mask(causal=True, R=24, C=40, block_size=8)
    out, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, sinks=sinks, return_lse=True)
    expected, expected_lse = reference.block_sparse_attention_reference(q, k, v, block_mask, sinks=sinks, causal=True,
                                                                        return_lse=True)   # the mask's rule
    _check_forward(out, lse, q, k, v, sinks, expected, expected_lse)


def test_int8_attention(rng):
    q, k, v, sinks = _problem(rng, 9, 64)
    out, lse = mfa_native.int8_attention(q, k, v, sinks=sinks, return_lse=True)
    assert not out[:, 1].any() and np.isposinf(lse[:, 1]).all()
    expected = reference.attention_reference(q, k, v, sinks=sinks)
    assert np.isfinite(out).all() and relative_l2(out, expected) < 0.05
