"""Gradients through the plain ops on framework arrays: MLX and torch see every call, so a
gradient is the op's (equal to the float64 reference's) or an error, never a silent zero."""

from __future__ import annotations

import re

import numpy as np
import pytest

import mfa_native
from conftest import relative_l2
from mfa_native import reference
from mfa_native.ops.declaration import OPS

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

B, HQ, HKV, R, C, D = 1, 4, 2, 11, 19, 32


def _inputs(rng):
    q, k, v = (rng.standard_normal((B, h, n, D)).astype(np.float32) for h, n in ((HQ, R), (HKV, C), (HKV, C)))
    return q, k, v, rng.standard_normal((B, HQ, R, D)).astype(np.float32), rng.standard_normal(HQ).astype(np.float32)


def _block_mask():
    return mfa_native.BlockMask.from_mask(causal=True, R=R, C=C, block_size=8)


def _indices(rng):
    return rng.integers(-1, C, (B, HKV, R, 12)).astype(np.int32)


# op name -> (forward(q, k, v, sinks, extra), its float64 gradient reference(q, k, v, dout, sinks, extra), extra)
CASES = {
    "attention": (lambda q, k, v, s, e: mfa_native.attention(q, k, v, causal=True, sinks=s),
                  lambda q, k, v, do, s, e: reference.attention_backward_reference(q, k, v, do, causal=True, sinks=s),
                  lambda rng: None),
    "sparse_attention": (lambda q, k, v, s, e: mfa_native.sparse_attention(q, k, v, e, sinks=s),
                         lambda q, k, v, do, s, e: reference.sparse_attention_backward_reference(q, k, v, do, e,
                                                                                                 sinks=s),
                         _indices),
    "block_sparse_attention": (lambda q, k, v, s, e: mfa_native.block_sparse_attention(q, k, v, e, sinks=s),
                               lambda q, k, v, do, s, e: reference.block_sparse_attention_backward_reference(
                                   q, k, v, do, e, sinks=s, causal=True),   # the mask's rule (from_mask)
                               lambda rng: _block_mask()),
}


def _check(grads, expected):
    for name, grad, reference_grad in zip("q k v sinks".split(), grads, expected):
        grad = np.asarray(grad, dtype=np.float64)
        assert np.abs(grad).max() > 0, f"d{name} is all zero"
        assert relative_l2(grad, reference_grad) < 1e-4, f"d{name}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_mx_grad_through_the_plain_op_is_the_reference(rng, name):
    forward, backward, extra = CASES[name]
    q, k, v, do, sinks = _inputs(rng)
    e = extra(rng)
    arrays = [mx.array(x) for x in (q, k, v, sinks)]
    loss = lambda q_, k_, v_, s_: (forward(q_, k_, v_, s_, e) * mx.array(do)).sum()  # noqa: E731
    grads = mx.grad(loss, argnums=(0, 1, 2, 3))(*arrays)
    _check(grads, backward(q, k, v, do, sinks, e))


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_autograd_through_the_plain_op_is_the_reference(rng, name):
    """Block-sparse too: its custom op's schema expands the BlockMask into its tensors."""
    forward, backward, extra = CASES[name]
    q, k, v, do, sinks = _inputs(rng)
    e = extra(rng)
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks)]
    (forward(*tensors, e) * torch.tensor(do)).sum().backward()
    _check([t.grad for t in tensors], backward(q, k, v, do, sinks, e))


# Ops without a backward: a function of (q, k, v) through the op, returning a float array a
# loss can be taken of. Gradients asked through them raise, in MLX and in torch.
def _int8(q, k, v):
    return mfa_native.int8_attention(q, k, v)


def _topk_scores(q, k, v):
    weights = q[:, :, :, 0] * 0 + 1
    return mfa_native.sparse_topk(q, k[:, :1], weights, 4, return_scores=True)[1]


def _merge(q, k, v):
    return mfa_native.merge_attention([q, q * 2], [q[..., 0], q[..., 1]])[0]


def _quantize(q, k, v):
    return mfa_native.quantize(q, "affine", bits=4, group_size=32).scales


def _kvcache(q, k, v):
    return mfa_native.attention_with_kvcache(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2),
                                             cache_seqlens=np.full(B, C, np.int32))


NO_GRADIENT = {"int8_attention": _int8, "sparse_topk": _topk_scores, "merge_attention": _merge,
               "quantize": _quantize, "attention_with_kvcache": _kvcache}
# Ops with a backward whose gradients another file checks against the reference, in both frameworks.
TESTED_ELSEWHERE = {"attention_varlen": "test_varlen.py (torch autograd, mx.grad)"}
# Ops a gradient cannot ask for: no floating input, or backward ops themselves (no second order).
NOT_DIFFERENTIABLE = {"block_mask_from_mask": "takes a bool mask and sizes",
                      "attention_backward": "a backward", "sparse_attention_backward": "a backward",
                      "block_sparse_attention_backward": "a backward", "attention_varlen_backward": "a backward"}
PUBLIC = {name for name in mfa_native.__all__ if hasattr(getattr(mfa_native, name), "declaration")}


def test_every_public_op_has_a_gradient_or_says_why_not():
    assert PUBLIC | {"block_mask_from_mask"} == \
        set(CASES) | set(NO_GRADIENT) | set(NOT_DIFFERENTIABLE) | set(TESTED_ELSEWHERE)
    for name in NO_GRADIENT:
        assert OPS[name].backward is None
    for name in [*CASES, *TESTED_ELSEWHERE]:
        assert OPS[name].backward is not None


@pytest.mark.parametrize("name", sorted(NO_GRADIENT))
def test_a_gradient_through_an_op_without_one_raises(rng, name):
    q, k, v, _, _ = _inputs(rng)
    op = NO_GRADIENT[name]
    said = f"^{re.escape(OPS[name].no_backward)}$"   # the op's reason, said once
    assert OPS[name].no_backward.startswith(name)
    with pytest.raises(NotImplementedError, match=said):
        mx.grad(lambda q_: op(q_, mx.array(k), mx.array(v)).sum())(mx.array(q))
    with pytest.raises(NotImplementedError, match=said):
        op(torch.tensor(q, requires_grad=True), torch.tensor(k), torch.tensor(v)).sum().backward()
    with torch.no_grad():   # without autograd, and in MLX without a transform, the op just runs
        assert torch.isfinite(op(torch.tensor(q), torch.tensor(k), torch.tensor(v))).all()
    assert bool(mx.all(mx.isfinite(op(mx.array(q), mx.array(k), mx.array(v)))))


@pytest.mark.parametrize("format", ["affine", "q8_0", "q4_0"])
def test_a_gradient_through_a_quantized_tensors_dequantize_raises(rng, format):
    """QuantizedTensor.dequantize of what quantize made of a torch or MLX x: the values, and a
    gradient asked with respect to x is quantize's error, in every format (q8_0 and q4_0 gave
    silent zeros: their fields are integers, off the graph)."""
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    expected = mfa_native.quantize(x, format).dequantize()
    said = f"^{re.escape(OPS['quantize'].no_backward)}$"
    with pytest.raises(NotImplementedError, match=said):
        mx.grad(lambda a: mfa_native.quantize(a, format).dequantize().sum())(mx.array(x))
    assert np.array_equal(np.array(mfa_native.quantize(mx.array(x), format).dequantize()), expected)
    t = torch.tensor(x, requires_grad=True)
    out = mfa_native.quantize(t, format).dequantize()
    assert np.array_equal(out.detach().numpy(), expected)
    with pytest.raises(NotImplementedError, match=said):
        (out * 2).sum().backward()
    with torch.no_grad():
        assert np.array_equal(mfa_native.quantize(t, format).dequantize().numpy(), expected)


def test_the_adapters_functions_are_differentiable(rng):
    """mfa_native.mlx.attention and mfa_native.torch.attention: the reference gradients."""
    import mfa_native.mlx as mm
    import mfa_native.torch as mt

    q, k, v, do, sinks = _inputs(rng)
    expected = reference.attention_backward_reference(q, k, v, do, causal=True, sinks=sinks)
    grads = mx.grad(lambda *a: (mm.attention(*a[:3], causal=True, sinks=a[3]) * mx.array(do)).sum(),
                    argnums=(0, 1, 2, 3))(*(mx.array(x) for x in (q, k, v, sinks)))
    _check(grads, expected)
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks)]
    (mt.attention(*tensors[:3], causal=True, sinks=tensors[3]) * torch.tensor(do)).sum().backward()
    _check([t.grad for t in tensors], expected)


@pytest.mark.parametrize("window", [None, (6, 2)])
def test_mlx_gives_an_additive_mask_its_gradient(rng, window):
    """d loss / d mask, against MLX's own mx.fast where it applies (no window) and a float64
    finite difference of the reference; the mask broadcasts over batch and heads."""
    q, k, v, do, _ = _inputs(rng)
    mask = rng.standard_normal((1, 1, R, C)).astype(np.float32)
    scale = 0.3

    def loss(m):
        return (mfa_native.attention(mx.array(q), mx.array(k), mx.array(v), scale=scale, mask=m, window=window)
                * mx.array(do)).sum()

    dmask = np.asarray(mx.grad(loss)(mx.array(mask)), dtype=np.float64)
    assert dmask.shape == mask.shape and np.abs(dmask).max() > 0
    if window is None:
        fast = mx.grad(lambda m: (mx.fast.scaled_dot_product_attention(
            mx.array(q), mx.array(k), mx.array(v), scale=scale, mask=m) * mx.array(do)).sum())(mx.array(mask))
        assert relative_l2(dmask, np.asarray(fast)) < 1e-4
    step, (i, j) = 1e-6, (R - 1, C - 3)
    bumped = [mask.astype(np.float64).copy() for _ in range(2)]
    bumped[0][0, 0, i, j] += step
    bumped[1][0, 0, i, j] -= step
    values = [(reference.attention_reference(q, k, v, scale=scale, mask=m, window=window) * do).sum() for m in bumped]
    assert dmask[0, 0, i, j] == pytest.approx((values[0] - values[1]) / (2 * step), rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("name", ["sparse_attention", "block_sparse_attention"])
def test_the_torch_adapters_compile_fullgraph_with_gradients(rng, name):
    """The sparse ops' custom ops trace under torch.compile(fullgraph=True), forward and backward."""
    import mfa_native.torch as mt

    q, k, v, do, sinks = _inputs(rng)
    extra = CASES[name][2](rng)
    lists = torch.from_numpy(extra) if isinstance(extra, np.ndarray) else extra
    op, weights = getattr(mt, name), torch.tensor(do)

    def loss(q_, k_, v_, s_):
        return (op(q_, k_, v_, lists, sinks=s_) * weights).sum()

    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks)]
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*tensors).backward()
    _check([t.grad for t in tensors], CASES[name][1](q, k, v, do, sinks, extra))


def test_a_shared_latent_sums_both_gradients_into_k(rng):
    """MLA's form, v = k[..., :Dv]: autograd sums dk and dv (padded) into k's gradient."""
    q, k, _, do, _ = _inputs(rng)
    indices, dv_width = _indices(rng), D // 2
    v = k[..., :dv_width]
    dq, dk, dv = reference.sparse_attention_backward_reference(q, k, v, do[..., :dv_width], indices)
    expected = dk.copy()
    expected[..., :dv_width] += dv
    tk = torch.tensor(k, requires_grad=True)
    (mfa_native.sparse_attention(torch.tensor(q), tk, tk[..., :dv_width], indices)
     * torch.tensor(do[..., :dv_width])).sum().backward()
    assert relative_l2(tk.grad.numpy(), expected) < 1e-4
    mk = mx.array(k)
    grad = mx.grad(lambda k_: (mfa_native.sparse_attention(mx.array(q), k_, k_[..., :dv_width], indices)
                               * mx.array(do[..., :dv_width])).sum())(mk)
    assert relative_l2(np.asarray(grad), expected) < 1e-4
