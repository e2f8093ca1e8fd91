"""torch MPS tensors: bound in place on the metal device (runs on a Mac only; skipped elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest

import mfa_native
from conftest import relative_l2
from mfa_native.runtime import frameworks

torch = pytest.importorskip("torch")
if not torch.backends.mps.is_available() or "metal" not in [d.kind for d in mfa_native.devices()]:
    pytest.skip("needs torch's MPS backend and mfa_native's metal device", allow_module_level=True)
mt = pytest.importorskip("mfa_native.torch")


def _qkv(rng, dtype=torch.float32):
    shapes = ((2, 4, 16, 32), (2, 2, 24, 32), (2, 2, 24, 32))
    return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mps_in_mps_out_in_place(rng, monkeypatch, dtype):
    made = []
    empty = frameworks.FRAMEWORKS[0].empty
    monkeypatch.setattr(frameworks.FRAMEWORKS[0], "empty", lambda *a: made.append(empty(*a)) or made[-1])
    cpu = _qkv(rng, dtype)
    mps = [x.to("mps").transpose(1, 2).contiguous().transpose(1, 2) * 1 for x in cpu]  # torch work queued first
    o, lse = mfa_native.attention(*mps, causal=True, return_lse=True)
    assert o is made[0] and o.device.type == "mps" and o.dtype == dtype
    expected_o, expected_lse = mfa_native.attention(*cpu, causal=True, return_lse=True, device="cpu")
    assert relative_l2((o.float() * 1).cpu().numpy(), expected_o.float().numpy()) < 1e-5
    assert relative_l2(lse.cpu().numpy(), expected_lse.numpy()) < 1e-6


def test_mps_autograd_and_sdpa(rng):
    q, k, v = (x.to("mps").requires_grad_() for x in _qkv(rng))
    out = mt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert relative_l2(out.detach().cpu().numpy(), expected.detach().cpu().numpy()) < 1e-5
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(expected, (q, k, v), do)):
        assert a.device.type == "mps" and relative_l2(a.cpu().numpy(), b.cpu().numpy()) < 1e-4


def test_merge_runs_on_mps(rng):
    """merge_attention is a pass on the device: MPS parts merge in place, as CPU ones do."""
    parts = [torch.randn(1, 2, 3, 4) for _ in range(2)]
    lses = [torch.randn(1, 2, 3) for _ in range(2)]
    o, lse = mfa_native.merge_attention([p.to("mps") for p in parts], [x.to("mps") for x in lses])
    expected_o, expected_lse = mfa_native.merge_attention(parts, lses)
    assert o.device.type == "mps" and relative_l2(o.cpu().numpy(), expected_o.numpy()) < 1e-6
    assert relative_l2(lse.cpu().numpy(), expected_lse.numpy()) < 1e-6


def test_quantize_refuses_mps():
    with pytest.raises(TypeError, match="quantize reads CPU tensors"):
        mfa_native.quantize(torch.zeros(1, 64, device="mps"))


def test_wrong_q_lists_are_refused_on_mps(rng):
    """The device's check of given q lists is read back from MPS memory (a stand-in holds none)."""
    q, k, v = (x.to("mps") for x in _qkv(rng))
    built = mfa_native.BlockMask.from_mask(causal=True, R=16, C=24, block_size=8)
    o, lse = mfa_native.block_sparse_attention(q, k, v, built, return_lse=True)
    arrays = dict(built.arrays)
    arrays["q_num_blocks"] = np.zeros_like(arrays["q_num_blocks"])
    wrong = mfa_native.BlockMask(**arrays, block_size=built.block_size)
    with pytest.raises(ValueError, match="q_indices"):
        mfa_native.block_sparse_attention_backward(q, k, v, o, lse, torch.randn_like(o), wrong)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_appends_into_contiguous_mps_caches_in_place(rng, paged):
    """Contiguous MPS caches are bound in place (DLPack): the device append writes the caller's
    tensors, byte for byte what the CPU call writes into copies; a strided one is a ValueError."""
    shape = (6, 16, 2, 32) if paged else (2, 48, 2, 32)
    k_cache, v_cache = (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) for _ in "kv")
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32) if paged else None
    q = torch.from_numpy(rng.standard_normal((2, 1, 8, 32)).astype(np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((2, 3, 2, 32)).astype(np.float32)) for _ in "kv")
    lengths = torch.tensor([14, 30], dtype=torch.int32)    # paged: batch 0's append crosses a page
    on_mps = [x.to("mps") for x in (q, k_cache, v_cache, k, v)]
    mps_table = None if table is None else table.to("mps")
    out, lse = mfa_native.attention_with_kvcache(on_mps[0], on_mps[1], on_mps[2], cache_seqlens=lengths.to("mps"),
                                                 k=on_mps[3], v=on_mps[4], block_table=mps_table, causal=True,
                                                 return_lse=True)
    expected = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v,
                                                 block_table=table, causal=True, return_lse=True, device="cpu")
    assert out.device.type == "mps" and relative_l2(out.cpu().numpy(), expected[0].numpy()) < 1e-5
    assert relative_l2(lse.cpu().numpy(), expected[1].numpy()) < 1e-6
    for mine, theirs in ((on_mps[1], k_cache), (on_mps[2], v_cache)):
        assert mine.cpu().numpy().tobytes() == theirs.numpy().tobytes()
    strided = torch.zeros(shape[0], shape[1], 2, 64, device="mps")[..., ::2]
    with pytest.raises(ValueError, match="k_cache is a non-contiguous"):
        mfa_native.attention_with_kvcache(on_mps[0], strided, on_mps[2], cache_seqlens=lengths.to("mps"),
                                          k=on_mps[3], v=on_mps[4], block_table=mps_table)
