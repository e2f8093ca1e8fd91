"""ALiBi (issue "Score transforms", its second case): query i's score of key j gets
-slope[h] * |i + C - R - j| in the kernels, after softcap, before masks and sinks, forward and
backward, in attention, varlen (per-sequence slopes and positions), the KV-cache call
(split-KV included), block-sparse and sparse-indexed attention (j: the listed key's index in
k), int8 attention (forward) and flash-attn's drop-ins, against float64 references
(reference.alibi_bias, written from flash-attn's definition)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_l2
from test_softcap import (check_attention, check_block_sparse, check_int8, check_sparse, check_sparse_adapters,
                          check_split_decode, check_varlen, inputs, layout_inputs, sparse_and_int8_calls)

import mfa_native
from mfa_native.int8_reference import int8_attention_emulation
from mfa_native.reference import (attention_backward_reference, attention_reference, attention_varlen_reference,
                                  attention_with_kvcache_reference, block_sparse_attention_reference,
                                  sparse_attention_reference)


def slopes(rng, *shape) -> np.ndarray:
    """ALiBi slopes of the given shape, in BLOOM's range (2^-8 .. 1)."""
    return (2.0 ** -rng.uniform(0, 8, shape)).astype(np.float32)


@pytest.mark.parametrize("dtype, options", [
    ("float32", dict(causal=True, per_batch=True)),
    ("float32", dict(window=(5, 3), sinks=True, softcap=3.0)),
    ("float16", dict(mask="bool", causal="upper_left", per_batch=True)),
    ("bfloat16", dict(sinks=True)),
], ids=["f32-causal-per-batch", "f32-window-sinks-softcap", "f16-bool-upper-left", "bf16-sinks"])
def test_attention_forward_and_backward(rng, dtype, options):
    B, Hq, Hkv, R, C, D = 2, 4, 2, 19, 27, 32
    q, k, v, do = inputs(rng, [(B, Hq, R, D), (B, Hkv, C, D), (B, Hkv, C, D), (B, Hq, R, D)], dtype, spread=1.5)
    options["alibi_slopes"] = slopes(rng, B, Hq) if options.pop("per_batch", False) else slopes(rng, Hq)
    if options.pop("sinks", False):
        options["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    if options.pop("mask", None):
        options["mask"] = rng.random((R, C)) > 0.3
    want_o = check_attention(q, k, v, do, dtype, **options)
    assert relative_l2(attention_reference(q, k, v, **(options | {"alibi_slopes": None})), want_o) > 0.05


@pytest.mark.parametrize("per_sequence", [False, True])
def test_varlen_distances_are_per_sequence(rng, per_sequence):
    """Each sequence's i + C - R - j counts in its own rows and keys (chunked prefill: fewer
    queries than keys), and a per-sequence table gives each its slopes."""
    cu_q, cu_k = np.array([0, 5, 5, 17], np.int32), np.array([0, 9, 12, 30], np.int32)
    q, k, v, do = inputs(rng, [(17, 4, 16), (30, 2, 16), (30, 2, 16), (17, 4, 16)], "float32", spread=1.0)
    check_varlen(q, k, v, do, cu_q, cu_k, causal=True,
                 alibi_slopes=slopes(rng, 3, 4) if per_sequence else slopes(rng, 4))


@pytest.mark.parametrize("page", [None, 8])
def test_kvcache_split_decode_with_append(rng, page):
    check_split_decode(rng, page, 3, 1.0, alibi_slopes=slopes(rng, 2, 8), softcap=6.0)


def test_bad_slopes_are_refused(rng):
    q = rng.standard_normal((2, 4, 8, 16)).astype(np.float32)
    for bad, error, match in ((np.ones(3, np.float32), ValueError, r"alibi_slopes must have shape \(Hq,\) = \(4,\)"),
                              (np.ones((3, 4), np.float32), ValueError, r"or \(B, Hq\) = \(2, 4\)"),
                              (np.ones(4, np.int32), TypeError, "alibi_slopes must be a float array")):
        with pytest.raises(error, match=match):
            mfa_native.attention(q, q, q, alibi_slopes=bad, device="cpu")


@pytest.mark.parametrize("dtype, layout, per_batch", [("float32", "bhsd", True), ("float16", "bshd", False)])
def test_block_sparse_forward_and_backward(rng, dtype, layout, per_batch):
    """A BlockMask from_mask (causal and a window: full, partial and left-out blocks; fewer
    queries than keys, so the distance counts from the diagonal C - R), GQA, sinks, softcap."""
    B, Hq, Hkv, R, C, D = 2, 4, 2, 24, 40, 32
    q, k, v, do = layout_inputs(rng, (B, Hq, Hkv, R, C, D), layout, dtype, spread=1.5)
    block_mask = mfa_native.BlockMask.from_mask(causal=True, window=(20, -1), R=R, C=C, block_size=8, device="cpu")
    rule = dict(causal=True, window=(20, -1))
    options = dict(alibi_slopes=slopes(rng, B, Hq) if per_batch else slopes(rng, Hq), softcap=4.0, layout=layout,
                   sinks=rng.standard_normal(Hq).astype(np.float32))
    want_o = check_block_sparse(q, k, v, do, block_mask, rule, dtype, **options)
    without = block_sparse_attention_reference(q, k, v, block_mask, **rule, **(options | {"alibi_slopes": None}))
    assert relative_l2(without, want_o) > 0.05


@pytest.mark.parametrize("dtype, layout, per_batch", [("float32", "bhsd", True), ("bfloat16", "bshd", False)])
def test_sparse_forward_and_backward(rng, dtype, layout, per_batch):
    """Token lists shared by the kv heads, entries out of range, duplicates, topk_length, sinks:
    query row r's distance to a listed key is |r + C - R - j|, j the key's index in k (not its
    slot in the list)."""
    B, Hq, Hkv, R, C, D = 2, 4, 2, 9, 30, 32
    q, k, v, do = layout_inputs(rng, (B, Hq, Hkv, R, C, D), layout, dtype, spread=1.5)
    indices = rng.integers(-3, C + 3, size=(B, 1, R, 12) if layout == "bhsd" else (B, R, 1, 12), dtype=np.int32)
    indices[..., 1] = indices[..., 0]   # every row lists a key twice (or skips an entry twice)
    options = dict(alibi_slopes=slopes(rng, B, Hq) if per_batch else slopes(rng, Hq), layout=layout,
                   sinks=rng.standard_normal(Hq).astype(np.float32),
                   topk_length=rng.integers(0, 14, size=(B, R), dtype=np.int32))
    want_o = check_sparse(q, k, v, do, indices, dtype, **options)
    without = sparse_attention_reference(q, k, v, indices, **(options | {"alibi_slopes": None}))
    assert relative_l2(without, want_o) > 0.05


@pytest.mark.parametrize("smooth_k, pv, per_batch", [(True, "int8", True), (True, "float", False),
                                                     (False, "int8", False)])
def test_int8_attention(rng, smooth_k, pv, per_batch):
    """The kernels compute the emulation of their quantized pipeline with ALiBi after the cap;
    with smooth_k (k's offset makes the row's shift q . mean(k) large) the shift joins the
    scores, which ALiBi, a bias per element, leaves exact. Near float64 attention."""
    q, k, v = inputs(rng, [(2, 4, 19, 32), (2, 2, 37, 32), (2, 2, 37, 32)], "float16", spread=1.5)
    k += np.float16(1.5)
    options = dict(causal=True, alibi_slopes=slopes(rng, 2, 4) if per_batch else slopes(rng, 4), softcap=8.0,
                   sinks=rng.standard_normal(4).astype(np.float32))
    want_o = check_int8(q, k, v, smooth_k=smooth_k, pv=pv, **options)
    without = int8_attention_emulation(q, k, v, smooth_k=smooth_k, pv=pv, **(options | {"alibi_slopes": None}))
    assert relative_l2(without, want_o) > 0.05


def test_the_sparse_and_int8_ops_refuse_bad_slopes(rng):
    """attention's checks (validate), before anything runs: per-batch tables count the batch."""
    for call in sparse_and_int8_calls(rng, 2, "alibi_slopes"):
        for bad, error in ((np.ones(3, np.float32), ValueError), (np.ones((3, 2), np.float32), ValueError),
                           (np.ones(2, np.int32), TypeError)):
            with pytest.raises(error, match="alibi_slopes must"):
                call(bad)


def test_adapters_differentiate_the_sparse_ops(rng):
    """torch autograd through block-sparse attention, mx.grad through sparse-indexed attention."""
    check_sparse_adapters(rng, alibi_slopes=slopes(rng, 2) * 4)


def test_flash_attn_drop_ins(rng):
    """flash-attn's alibi_slopes (its tests draw them from rand * 0.3): forward and autograd
    through flash_attn_func, and flash_attn_varlen_func and the KV-cache call forward."""
    torch = pytest.importorskip("torch")
    from mfa_native.torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    q, k, v = (torch.from_numpy(x).requires_grad_() for x in inputs(rng, [(2, 9, 4, 32), (2, 13, 2, 32),
                                                                          (2, 13, 2, 32)], "float32", spread=1.0))
    table = torch.rand(2, 4) * 0.3
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=table)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    want = attention_reference(*arrays, causal=True, alibi_slopes=table.numpy(), layout="bshd")
    assert relative_l2(out.detach().numpy(), want) < 2e-5
    do = torch.randn_like(out)
    out.backward(do)
    grads = attention_backward_reference(*arrays, do.numpy(), causal=True, alibi_slopes=table.numpy(), layout="bshd")
    for x, g in zip((q, k, v), grads):
        assert relative_l2(x.grad.numpy(), g) < 2e-4
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    packed = [x.detach().reshape(-1, *x.shape[2:])[:18] for x in (q, k, v)]
    out = flash_attn_varlen_func(*packed, cu, cu, 9, 9, causal=True, alibi_slopes=table)
    want = attention_varlen_reference(*(x.numpy() for x in packed), cu.numpy(), cu.numpy(), causal=True,
                                      alibi_slopes=table.numpy())
    assert relative_l2(out.numpy(), want) < 2e-5
    k_cache, v_cache = (torch.zeros(2, 20, 2, 32) for _ in "kv")
    lengths = torch.tensor([3, 11], dtype=torch.int32)
    new = [x.detach()[:, :2] for x in (k, v)]
    want = attention_with_kvcache_reference(q.detach().numpy(), k_cache.numpy(), v_cache.numpy(), lengths.numpy(),
                                            *(x.numpy() for x in new), causal=True, alibi_slopes=table.numpy())
    out = flash_attn_with_kvcache(q.detach(), k_cache, v_cache, *new, cache_seqlens=lengths, causal=True,
                                  alibi_slopes=table)
    assert relative_l2(out.numpy(), want) < 2e-5


def test_a_gradient_of_the_slopes_is_an_error_in_mlx_and_torch(rng):
    """The slopes get no gradient: asking for one raises (MLX would give zeros), while q's
    gradient through the same call is computed."""
    mx = pytest.importorskip("mlx.core")
    import mfa_native.mlx as mm
    q = mx.array(inputs(rng, [(1, 2, 8, 16)], "float32")[0])
    slopes = mx.array([0.25, 0.5])
    with pytest.raises(NotImplementedError, match="attention gives alibi_slopes no gradient"):
        mx.grad(lambda s: mm.attention(q, q, q, alibi_slopes=s).sum())(slopes)
    dq = mx.grad(lambda x: (mm.attention(x, q, q, alibi_slopes=slopes) ** 2).sum())(q)
    want = attention_backward_reference(*(np.array(q),) * 3, 2 * attention_reference(
        *(np.array(q),) * 3, alibi_slopes=np.array(slopes)), alibi_slopes=np.array(slopes))[0]
    assert relative_l2(np.array(dq), want) < 1e-4
    torch = pytest.importorskip("torch")
    import mfa_native.torch as mt
    t = torch.from_numpy(np.array(q))
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        mt.attention(t, t, t, alibi_slopes=torch.tensor([0.25, 0.5], requires_grad=True)).sum().backward()
