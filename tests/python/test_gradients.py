"""Gradients through the plain ops on framework arrays: MLX and torch see every call, so a
gradient is the op's (equal to the float64 reference's) or an error, never a silent zero."""

from __future__ import annotations

import numpy as np
import pytest

import mfa_native
from conftest import relative_l2
from mfa_native import reference

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

B, HQ, HKV, R, C, D = 1, 4, 2, 11, 19, 16


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
                                   q, k, v, do, e, sinks=s),
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


def _int8(q, k, v):
    return mfa_native.int8_attention(q, k, v)


def _topk_scores(q, k, v):
    weights = q[:, :, :, 0] * 0 + 1
    return mfa_native.sparse_topk(q, k[:, :1], weights, 4, return_scores=True)[1]


@pytest.mark.parametrize("op", [_int8, _topk_scores], ids=["int8_attention", "sparse_topk"])
def test_a_gradient_through_an_op_without_one_raises(rng, op):
    q, k, v, _, _ = _inputs(rng)
    with pytest.raises(NotImplementedError, match="has no gradient"):
        mx.grad(lambda q_: op(q_, mx.array(k), mx.array(v)).sum())(mx.array(q))
    with pytest.raises(NotImplementedError, match="has no gradient|has no torch autograd yet"):
        op(torch.tensor(q, requires_grad=True), torch.tensor(k), torch.tensor(v)).sum().backward()


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
