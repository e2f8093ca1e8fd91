"""The logit soft cap (issue "Score transforms", its first case): each scaled score s becomes
c * tanh(s / c) in the kernels, before masks and sinks, forward and backward, in attention,
varlen, the KV-cache call (split-KV included), block-sparse and sparse-indexed attention,
int8 attention (forward), flash-attn's drop-ins and mlx-lm's Gemma 2 under
`mfa_native.mlx.patch()`, against float64 references (reference.softcapped: the cap and its
derivative, written from flash-attn's definition). The scores are made large (|s| up to
~10 c) so that the cap matters."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import relative_l2
from test_kvcache_split import CAPACITY, cache_of, split_call

import mfa_native
from mfa_native import codegen
from mfa_native.codegen import AttentionProblem
from mfa_native.codegen.attention.scores import Softcap
from mfa_native.int8_reference import int8_attention_emulation
from mfa_native.reference import (attention_backward_reference, attention_reference, attention_varlen_backward_reference,
                                  attention_varlen_reference, attention_with_kvcache_reference,
                                  block_sparse_attention_backward_reference, block_sparse_attention_reference,
                                  sparse_attention_backward_reference, sparse_attention_reference)

DTYPES = {"float32": (np.float32, 2e-5, 2e-4), "float16": (np.float16, 2e-3, 6e-3),
          "bfloat16": (ml_dtypes.bfloat16, 2e-2, 4e-2)}   # dtype, forward and backward relative L2


def inputs(rng, shapes, dtype, spread: float = 4.0):
    """Random arrays of `shapes` in `dtype`; q and k scaled by `spread` (large scores)."""
    t = DTYPES[dtype][0]
    return [(rng.standard_normal(s) * (spread if i < 2 else 1.0)).astype(t) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("dtype, options", [
    ("float32", dict(causal=True)),
    ("float32", dict(window=(5, 3), sinks=True, layout="bshd")),
    ("float16", dict(mask="additive", causal="upper_left")),
    ("bfloat16", dict(mask="bool", sinks=True)),
], ids=["f32-causal", "f32-window-sinks-bshd", "f16-additive-upper-left", "bf16-bool-sinks"])
def test_attention_forward_and_backward(rng, dtype, options):
    B, Hq, Hkv, R, C, D = 2, 4, 2, 19, 27, 32
    layout = options.pop("layout", "bhsd")
    shape = (lambda h, n, d: (B, h, n, d)) if layout == "bhsd" else (lambda h, n, d: (B, n, h, d))
    q, k, v, do = inputs(rng, [shape(Hq, R, D), shape(Hkv, C, D), shape(Hkv, C, D), shape(Hq, R, D)], dtype)
    extra = {"layout": layout, "softcap": 3.0}
    if options.pop("sinks", False):
        extra["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    kind = options.pop("mask", None)
    if kind == "bool":
        extra["mask"] = rng.random((R, C)) > 0.3
    elif kind == "additive":
        extra["mask"] = rng.standard_normal((1, Hq, R, C)).astype(np.float32)
    want_o = check_attention(q, k, v, do, dtype, **(options | extra))
    uncapped = attention_reference(q, k, v, **(options | extra | {"softcap": None}))
    assert relative_l2(uncapped, want_o) > 0.1   # the cap changed the result: these scores reach it


def layout_inputs(rng, sizes: tuple, layout: str, dtype: str, spread: float = 4.0):
    """q, k, v, do for sizes (B, Hq, Hkv, R, C, D) in `layout` ("bhsd" or "bshd")."""
    B, Hq, Hkv, R, C, D = sizes
    shape = (lambda h, n: (B, h, n, D)) if layout == "bhsd" else (lambda h, n: (B, n, h, D))
    return inputs(rng, [shape(Hq, R), shape(Hkv, C), shape(Hkv, C), shape(Hq, R)], dtype, spread)


def check_attention(q, k, v, do, dtype: str, **options) -> np.ndarray:
    """attention and its backward against the float64 reference, within `dtype`'s tolerances;
    the reference's output."""
    _, forward_tolerance, backward_tolerance = DTYPES[dtype]
    o, lse = mfa_native.attention(q, k, v, return_lse=True, device="cpu", **options)
    want_o, want_lse = attention_reference(q, k, v, return_lse=True, **options)
    assert relative_l2(o, want_o) < forward_tolerance
    seen = np.isfinite(want_lse)
    assert np.allclose(lse[seen], want_lse[seen], atol=10 * forward_tolerance) and (np.isinf(lse) == ~seen).all()
    grads = mfa_native.attention_backward(q, k, v, o, lse, do, device="cpu", **options)
    for got, want in zip(grads, attention_backward_reference(q, k, v, do, out=o, **options)):
        assert relative_l2(got, want) < backward_tolerance
    return want_o


def check_varlen(q, k, v, do, cu_q, cu_k, **options) -> None:
    """attention_varlen and its backward against the float64 reference."""
    o, lse = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, device="cpu", **options)
    want_o, want_lse = attention_varlen_reference(q, k, v, cu_q, cu_k, return_lse=True, **options)
    seen = np.isfinite(want_lse)
    assert relative_l2(o, want_o) < 2e-5 and np.allclose(lse[seen], want_lse[seen], atol=1e-4)
    grads = mfa_native.attention_varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, device="cpu", **options)
    for got, want in zip(grads, attention_varlen_backward_reference(q, k, v, do, cu_q, cu_k, out=o, **options)):
        assert relative_l2(got, want) < 2e-4


def check_split_decode(rng, page, rows: int, spread: float, **options) -> None:
    """A long cache split across threadgroups (partial kernels and the combine), appended to,
    against the float64 reference."""
    lengths = np.array([CAPACITY - 9, 40], np.int32)
    k_cache, v_cache, table = cache_of(rng, lengths, page, 32)
    q, k, v = inputs(rng, [(2, rows, 8, 32), (2, 2, 2, 32), (2, 2, 2, 32)], "float32", spread)
    want = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, k, v, table, causal=True, return_lse=True,
                                            **options)
    out, lse, kernels, _ = split_call(q, k_cache, v_cache, lengths, k, v, table, causal=True, **options)
    assert codegen.PARTIAL_KERNEL_NAME in kernels and codegen.COMBINE_KERNEL_NAME in kernels
    assert relative_l2(out, want[0]) < 2e-5 and np.allclose(lse, want[1], atol=1e-4)


def test_varlen_forward_and_backward(rng):
    cu = np.array([0, 7, 7, 30], np.int32)
    q, k, v, do = inputs(rng, [(30, 4, 16), (30, 2, 16), (30, 2, 16), (30, 4, 16)], "float32")
    check_varlen(q, k, v, do, cu, cu, causal=True, window=(6, -1), softcap=2.5)


@pytest.mark.parametrize("page", [None, 8])
def test_kvcache_split_decode_with_append(rng, page):
    check_split_decode(rng, page, 1, 4.0, softcap=4.0)


def test_the_cap_reads_nothing_more():
    """No buffer, no size: the cap is a literal of the kernels (no extra device traffic)."""
    p = AttentionProblem(batch=1, q_heads=2, kv_heads=2, q_len=16, kv_len=16, head_dim=32, value_dim=32)
    capped = AttentionProblem(**{**p.__dict__, "scores": (Softcap(30.0),)})
    for make in (codegen.attention_pass, lambda x: codegen.attention_backward_pass(
            codegen.AttentionBackwardProblem(x))):
        plain, with_cap = make(p), make(capped)
        assert [b.name for b in plain.buffers] == [b.name for b in with_cap.buffers]
        assert all("precise::tanh" in k.source for k in with_cap.kernels if "attention" in k.entry)


def test_nan_propagates_and_bad_caps_are_refused(rng):
    q, k, v = inputs(rng, [(1, 2, 8, 16)] * 3, "float32")
    q[0, 1, 3, 0] = np.nan
    o = mfa_native.attention(q, k, v, softcap=5.0, device="cpu")
    assert np.isnan(o[0, 1, 3]).all() and np.isfinite(np.delete(o.reshape(-1, 16), 11, axis=0)).all()
    for cap, error in ((0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), ("5", TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match="softcap"):
            mfa_native.attention(q, k, v, softcap=cap, device="cpu")


def test_flash_attn_drop_ins_with_flash_attns_tolerance(rng):
    """flash-attn's softcap argument (its tests use 0 and 50 on |s| of a few units; here 2.0, so
    it matters): forward and autograd through flash_attn_func, flash_attn_varlen_func and the
    KV-cache call, within twice the error of PyTorch computing in the same dtype (+ 1e-5)."""
    torch = pytest.importorskip("torch")
    from mfa_native.torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    def in_dtype(q, k, v, cap):   # (B, S, H, D), PyTorch in the low dtype, GQA repeated
        k, v = (x.repeat_interleave(q.shape[2] // x.shape[2], 2) for x in (k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        s = cap * torch.tanh(s / cap)
        row, col = torch.arange(s.shape[2])[:, None] + s.shape[3] - s.shape[2], torch.arange(s.shape[3])
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(col > row, float("-inf")), -1), v)

    q, k, v = (torch.from_numpy(x) for x in inputs(rng, [(2, 9, 4, 32), (2, 13, 2, 32), (2, 13, 2, 32)], "float32"))
    q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    out = flash_attn_func(q, k, v, causal=True, softcap=2.0)
    want = attention_reference(*(x.detach().double().numpy() for x in (q, k, v)), causal=True, softcap=2.0,
                               layout="bshd")
    low = in_dtype(q.detach(), k.detach(), v.detach(), 2.0).double().numpy()
    assert np.abs(out.detach().double().numpy() - want).max() <= 2 * np.abs(low - want).max() + 1e-5
    do = torch.randn_like(out)
    out.backward(do)
    grads = attention_backward_reference(*(x.detach().double().numpy() for x in (q, k, v)), do.double().numpy(),
                                         causal=True, softcap=2.0, layout="bshd")
    for x, g in zip((q, k, v), grads):
        assert relative_l2(x.grad.double().numpy(), g) < 3e-2
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    packed = [x.detach().float().reshape(-1, *x.shape[2:])[:18] for x in (q, k, v)]
    out = flash_attn_varlen_func(*packed, cu, cu, 9, 9, causal=True, softcap=2.0)
    want = attention_varlen_reference(*(x.numpy() for x in packed), cu.numpy(), cu.numpy(), causal=True, softcap=2.0)
    assert relative_l2(out.numpy(), want) < 2e-5
    k_cache, v_cache = (torch.zeros(2, 20, 2, 32) for _ in "kv")
    lengths = torch.tensor([3, 11], dtype=torch.int32)
    new = [x.detach().float()[:, :2] for x in (k, v)]
    want = attention_with_kvcache_reference(q.detach().float().numpy(), k_cache.numpy(), v_cache.numpy(),
                                            lengths.numpy(), *(x.numpy() for x in new), causal=True, softcap=2.0)
    out = flash_attn_with_kvcache(q.detach().float(), k_cache, v_cache, *new, cache_seqlens=lengths, causal=True,
                                  softcap=2.0)
    assert relative_l2(out.numpy(), want) < 2e-5


def test_mlx_gradients(rng):
    mx = pytest.importorskip("mlx.core")
    import mfa_native.mlx as mm

    q, k, v = inputs(rng, [(1, 2, 12, 16)] * 3, "float32")
    loss = lambda q, k, v: (mm.attention(q, k, v, causal=True, softcap=3.0) ** 2).sum()   # noqa: E731
    grads = mx.grad(loss, argnums=(0, 1, 2))(*(mx.array(x) for x in (q, k, v)))
    o = attention_reference(q, k, v, causal=True, softcap=3.0)
    want = attention_backward_reference(q, k, v, 2 * o, causal=True, softcap=3.0)
    for got, expected in zip(grads, want):
        assert relative_l2(np.array(got), expected) < 2e-4


@pytest.mark.parametrize("dtype, layout", [("float32", "bhsd"), ("float16", "bshd")])
def test_block_sparse_forward_and_backward(rng, dtype, layout):
    """A BlockMask from_mask (causal and a window: full, partial and left-out blocks), GQA, sinks."""
    B, Hq, Hkv, R, C, D = 1, 4, 2, 24, 40, 32
    q, k, v, do = layout_inputs(rng, (B, Hq, Hkv, R, C, D), layout, dtype)
    block_mask = mfa_native.BlockMask.from_mask(causal=True, window=(20, -1), R=R, C=C, block_size=8, device="cpu")
    rule = dict(causal=True, window=(20, -1))
    options = dict(softcap=3.0, layout=layout, sinks=rng.standard_normal(Hq).astype(np.float32))
    want_o = check_block_sparse(q, k, v, do, block_mask, rule, dtype, **options)
    uncapped = block_sparse_attention_reference(q, k, v, block_mask, **rule, **(options | {"softcap": None}))
    assert relative_l2(uncapped, want_o) > 0.1


def check_block_sparse(q, k, v, do, block_mask, rule: dict, dtype: str, **options) -> np.ndarray:
    """block_sparse_attention and its backward (the mask's `rule`: its from_mask arguments,
    which the calls take from the mask) against the float64 references; the reference's output."""
    _, forward_tolerance, backward_tolerance = DTYPES[dtype]
    o, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True, device="cpu", **options)
    want_o, want_lse = block_sparse_attention_reference(q, k, v, block_mask, return_lse=True, **rule, **options)
    assert relative_l2(o, want_o) < forward_tolerance and np.allclose(lse, want_lse, atol=10 * forward_tolerance)
    grads = mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, block_mask, device="cpu", **options)
    expected = block_sparse_attention_backward_reference(q, k, v, do, block_mask, out=o, **rule, **options)
    for got, want in zip(grads, expected):
        assert relative_l2(got, want) < backward_tolerance
    return want_o


@pytest.mark.parametrize("dtype, layout", [("float32", "bhsd"), ("bfloat16", "bshd")])
def test_sparse_forward_and_backward(rng, dtype, layout):
    """Token lists shared by the kv heads, entries out of range, duplicates, topk_length, sinks."""
    B, Hq, Hkv, R, C, D = 2, 4, 2, 9, 30, 32
    q, k, v, do = layout_inputs(rng, (B, Hq, Hkv, R, C, D), layout, dtype)
    indices = rng.integers(-3, C + 3, size=(B, 1, R, 12) if layout == "bhsd" else (B, R, 1, 12), dtype=np.int32)
    options = dict(softcap=2.5, layout=layout, sinks=rng.standard_normal(Hq).astype(np.float32),
                   topk_length=rng.integers(0, 14, size=(B, R), dtype=np.int32))
    want_o = check_sparse(q, k, v, do, indices, dtype, **options)
    assert relative_l2(sparse_attention_reference(q, k, v, indices, **(options | {"softcap": None})), want_o) > 0.1


def check_sparse(q, k, v, do, indices, dtype: str, **options) -> np.ndarray:
    """sparse_attention and its backward against the float64 references; the reference's output."""
    _, forward_tolerance, backward_tolerance = DTYPES[dtype]
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, device="cpu", **options)
    want_o, want_lse = sparse_attention_reference(q, k, v, indices, return_lse=True, **options)
    assert relative_l2(o, want_o) < forward_tolerance and np.allclose(lse, want_lse, atol=10 * forward_tolerance)
    grads = mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do, device="cpu", **options)
    for got, want in zip(grads, sparse_attention_backward_reference(q, k, v, do, indices, out=o, **options)):
        assert relative_l2(got, want) < backward_tolerance
    return want_o


@pytest.mark.parametrize("smooth_k, pv", [(True, "int8"), (True, "float"), (False, "int8")])
def test_int8_attention(rng, smooth_k, pv):
    """The kernels compute exactly the emulation of their quantized pipeline, the cap taking the
    true scaled score: with smooth_k the row's shift q . mean(k) is inside the cap (k's offset
    makes the shift large, so a cap of the unshifted score would fail). Near float64 attention."""
    q, k, v = inputs(rng, [(1, 4, 19, 32), (1, 2, 37, 32), (1, 2, 37, 32)], "float16")
    k += np.float16(1.5)
    options = dict(causal=True, softcap=3.0, sinks=rng.standard_normal(4).astype(np.float32))
    want_o = check_int8(q, k, v, smooth_k=smooth_k, pv=pv, **options)
    uncapped = int8_attention_emulation(q, k, v, smooth_k=smooth_k, pv=pv, **(options | {"softcap": None}))
    assert relative_l2(uncapped, want_o) > 0.1


def check_int8(q, k, v, *, smooth_k: bool, pv: str, **options) -> np.ndarray:
    """int8_attention against the emulation of its quantized pipeline (nearly exact) and near
    float64 attention with the same `options`; the emulation's output."""
    o, lse = mfa_native.int8_attention(q, k, v, return_lse=True, smooth_k=smooth_k, pv=pv, device="cpu", **options)
    want_o, want_lse = int8_attention_emulation(q, k, v, return_lse=True, smooth_k=smooth_k, pv=pv, **options)
    assert relative_l2(o, want_o) < 2e-3 and np.allclose(lse, want_lse, atol=1e-3)
    assert relative_l2(o, attention_reference(q, k, v, **options)) < 0.05
    return want_o


def sparse_and_int8_calls(rng, batch: int, argument: str) -> list:
    """block_sparse_attention, sparse_attention and int8_attention on random inputs, each a
    function of `argument`'s value."""
    q, k, v = inputs(rng, [(batch, 2, 16, 16)] * 3, "float32")
    indices = rng.integers(0, 16, size=(batch, 1, 16, 4), dtype=np.int32)
    block_mask = mfa_native.BlockMask.from_mask(causal=True, R=16, C=16, block_size=8, device="cpu")
    return [lambda x: mfa_native.block_sparse_attention(q, k, v, block_mask, device="cpu", **{argument: x}),
            lambda x: mfa_native.sparse_attention(q, k, v, indices, device="cpu", **{argument: x}),
            lambda x: mfa_native.int8_attention(q, k, v, device="cpu", **{argument: x})]


def test_the_sparse_and_int8_ops_refuse_bad_caps(rng):
    """The same checks as attention's (validate), before anything runs."""
    for call in sparse_and_int8_calls(rng, 1, "softcap"):
        for cap, error in ((0.0, ValueError), (float("nan"), ValueError), ("5", TypeError)):
            with pytest.raises(error, match="softcap"):
                call(cap)


def test_adapters_differentiate_the_sparse_ops(rng):
    check_sparse_adapters(rng, softcap=2.0)


def check_sparse_adapters(rng, **options) -> None:
    """torch autograd through block-sparse attention (causal blocks of a 16 x 16 problem), mx.grad
    through sparse-indexed attention (5 keys per row), with `options`, against the references."""
    q, k, v, do = inputs(rng, [(1, 2, 16, 16)] * 4, "float32")
    indices = rng.integers(0, 16, size=(1, 1, 16, 5), dtype=np.int32)
    block_mask = mfa_native.BlockMask.from_mask(causal=True, R=16, C=16, block_size=8, device="cpu")
    torch = pytest.importorskip("torch")
    import mfa_native.torch as mt

    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    mt.block_sparse_attention(tq, tk, tv, block_mask, **arrays_as(options, torch.from_numpy)).backward(
        torch.from_numpy(do))
    want = block_sparse_attention_backward_reference(q, k, v, do, block_mask, causal=True, **options)
    for x, g in zip((tq, tk, tv), want):
        assert relative_l2(x.grad.numpy(), g) < 2e-4
    mx = pytest.importorskip("mlx.core")
    import mfa_native.mlx as mm

    given = arrays_as(options, mx.array)
    loss = lambda q, k, v: (mm.sparse_attention(q, k, v, mx.array(indices), **given) * mx.array(do)).sum()  # noqa: E731
    grads = mx.grad(loss, argnums=(0, 1, 2))(*(mx.array(x) for x in (q, k, v)))
    for got, want in zip(grads, sparse_attention_backward_reference(q, k, v, do, indices, **options)):
        assert relative_l2(np.array(got), want) < 2e-4


def arrays_as(options: dict, convert) -> dict:
    """`options` with its numpy arrays converted (to a framework's arrays)."""
    return {name: convert(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}


def test_mlx_patch_routes_gemma2(rng, monkeypatch):
    """mlx-lm writes Gemma 2's attention with plain MLX ops around the cap; under patch() a tiny
    random Gemma 2 (GQA, cap 1: the cap changes its tokens) generates the same greedy tokens and
    log-probabilities through `mfa_native.mlx.attention(..., softcap=)`, in every layer at every
    step; a mask row with no key runs mlx-lm's own code; the class is restored on exit."""
    mx = pytest.importorskip("mlx.core")
    gemma2 = pytest.importorskip("mlx_lm.models.gemma2")
    import mfa_native.mlx as mm
    from test_mlx_adapter import _counted

    from mlx_lm.generate import generate_step

    def generated(model, prompt):
        steps = list(generate_step(mx.array(prompt), model, max_tokens=8))
        return [int(token) for token, _ in steps], np.stack([np.array(logprobs) for _, logprobs in steps])

    mx.random.seed(int(rng.integers(1 << 31)))
    args = gemma2.ModelArgs(model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                            vocab_size=101, attn_logit_softcapping=1.0, query_pre_attn_scalar=32)
    model = gemma2.Model(args)
    mx.eval(model.parameters())
    prompt = rng.integers(0, 101, size=12).tolist()
    original = gemma2.Attention.__call__
    calls = _counted(monkeypatch, "attention")
    tokens, logprobs = generated(model, prompt)
    assert not calls
    with mm.patch():
        patched_tokens, patched_logprobs = generated(model, prompt)
    assert patched_tokens == tokens and relative_l2(patched_logprobs, logprobs) < 1e-5
    routed = len(calls)
    assert routed >= 2 * 8 and gemma2.Attention.__call__ is original   # every layer, every step
    layer = model.model.layers[0].self_attn
    x = mx.array(rng.standard_normal((1, 5, 64)).astype(np.float32))
    empty_row = mx.array(np.tril(np.ones((5, 5), dtype=bool)) & (np.arange(5) != 2)[:, None])
    with mm.patch():
        fallback = layer(x, mask=empty_row)
    assert len(calls) == routed and np.array_equal(np.array(fallback), np.array(layer(x, mask=empty_row)))
    for block in model.model.layers:
        block.self_attn.attn_logit_softcapping = 1e9
    assert relative_l2(generated(model, prompt)[1], logprobs) > 0.05   # the cap matters in this model
