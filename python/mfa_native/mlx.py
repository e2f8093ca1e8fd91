"""mfa_native for MLX: `scaled_dot_product_attention` with mx.fast's semantics, and `attention`,
both differentiable (mx.grad, mx.vjp); `quantized_scaled_dot_product_attention`, mlx-lm's
function of that name over a quantized KV cache, read in the kernel.

They run eagerly: their arguments are evaluated (mx.eval, which waits for MLX's
stream) and read in place through the buffer protocol (MLX's memory is unified);
the kernels run on mfa_native's default device (Metal on a Mac, the cpu backend
elsewhere) and have finished when the call returns, writing into arrays MLX
allocated. Inside mx.compile or mx.vmap they raise a RuntimeError (MLX cannot
evaluate arrays while tracing): call them outside the transformation.

Importing this module imports mlx; `import mfa_native` alone does not.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import mlx.core as mx
import numpy as np

from . import reference
from .ops.attention import ATTENTION
from .ops.attention import attention as _attention
from .ops.declaration import Call, Op
from .ops.varlen import ATTENTION_VARLEN
from .ops.given_kind import inside_adapter
from .quantized import QuantizedTensor


def mlx_function(op: Op):
    """`op` on MLX arrays as an mx.custom_function (see `mlx_call`), with the op's arguments
    less `device`."""
    signature = inspect.Signature([p for p in op.parameters() if p.name != "device"])

    def function(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return mlx_call(op, {**bound.arguments, "device": None})

    function.__name__ = function.__qualname__ = op.name
    function.__signature__ = signature
    function.__doc__ = (f"`mfa_native.{op.name}` on MLX arrays, differentiable (mx.grad, mx.vjp) through its "
                        "declared backward; outputs the backward takes no cotangent of come back through "
                        f"mx.stop_gradient. Arguments and results are `mfa_native.{op.name}`'s, without `device`.")
    return function


def mlx_call(op: Op, values: dict):
    """A call of `op` (every argument by name) as an mx.custom_function, so that MLX sees it.

    Its primals are the MLX arrays among the op's differentiable arguments; for an op with no
    backward, every floating MLX array argument, so that a gradient asked through it raises
    NotImplementedError instead of coming back zero; an additive (floating) mask of an op with
    a mask rule below is a primal too, its gradient computed lazily with MLX ops (so it costs
    nothing unless asked for). The vjp runs the backward op, its arguments found by name as
    torch/library.py finds them: forward arguments, outputs, and `d` + an output's name for its
    cotangent. Outputs the backward takes no cotangent of (lse) come back through
    mx.stop_gradient (of an op without a backward, none: their gradient raises)."""
    backward_op = op.backward_op
    backward_names = [] if backward_op is None else [p.name for p in backward_op.parameters()]
    selectors = {o.when: True for o in op.outputs if o.when in op.option_names}
    given = [a.name for a in op.arguments if a.kind == "array" and _is_primal(op, a, values[a.name])]
    everything = Call(op, {**values, **selectors}).results   # what the forward computes
    everything = (everything,) if isinstance(everything, str) else everything

    @mx.custom_function
    def forward(*primals):
        with inside_adapter():
            result = op.function(**{**values, **dict(zip(given, primals)), **selectors})
        return tuple(result) if isinstance(result, tuple) else (result,)

    @forward.vjp
    def vjp(primals, cotangents, outputs):
        if backward_op is None:
            raise NotImplementedError(f"{op.name} has no gradient: {op.no_backward}")
        known = {**values, **dict(zip(given, primals)), **dict(zip(everything, outputs)),
                 **{f"d{name}": c for name, c in zip(everything, cotangents)}}
        grads = backward_op.function(**{n: known[n] for n in backward_names})
        by_name = dict(zip((o.name for o in backward_op.outputs), grads if isinstance(grads, tuple) else (grads,)))
        by_name["dmask"] = _mask_gradient(op, known) if "mask" in given else None
        return tuple(by_name[op.gradients.get(n, "dmask")].astype(p.dtype) for n, p in zip(given, primals))

    outputs = dict(zip(everything, forward(*[values[n] for n in given])))
    outputs = {name: mx.stop_gradient(o) if backward_op is not None and f"d{name}" not in backward_names else o
               for name, o in outputs.items()}
    asked = Call(op, values).results
    return outputs[asked] if isinstance(asked, str) else tuple(outputs[name] for name in asked)


def _is_primal(op: Op, argument, value) -> bool:
    """Whether an argument's value is one of the custom function's primals (see mlx_call)."""
    if not isinstance(value, mx.array):
        return False
    if argument.grad:
        return True
    floating = mx.issubdtype(value.dtype, mx.floating)
    if op.backward is None:
        return floating
    return argument.name == "mask" and floating and op.name in _KEY_RULES


# The rules other than the mask that remove keys, as an additive (B|1, Hq|1, R, C) numpy
# array of 0 and -inf (block visits: log of the visit count), per op with a mask gradient.
_KEY_RULES = {
    "attention": lambda known, B, H, R, C: np.log(reference.allowed_keys(R, C, known["causal"], known["window"])),
    "block_sparse_attention": lambda known, B, H, R, C: reference.block_sparse_bias(
        known["block_mask"], np.zeros((B, H, R, 1)), np.zeros((B, 1, C, 1)), causal=known["causal"],
        window=known["window"]),
}


def _mask_gradient(op: Op, known: dict) -> mx.array:
    """d loss / d mask of softmax(scale q k^T + mask): dS = P * (dP - rowsum(dO * O)), with
    P = exp(S - lse) (the sink's share is in lse), summed over the axes the mask broadcasts;
    MLX ops, evaluated only if the mask's gradient is used."""
    q, k, v, o, do = (known[n] for n in ("q", "k", "v", "o", "do"))
    if known["layout"] == "bshd":
        q, k, v, o, do = (x.transpose(0, 2, 1, 3) for x in (q, k, v, o, do))
    groups = q.shape[1] // k.shape[1]
    k, v = (mx.repeat(x.astype(mx.float32), groups, axis=1) for x in (k, v))
    q, o, do = (x.astype(mx.float32) for x in (q, o, do))
    R, C = q.shape[2], k.shape[2]
    scale = known["scale"] if known["scale"] is not None else q.shape[3] ** -0.5
    mask = known["mask"].astype(mx.float32)
    with np.errstate(divide="ignore"):
        rules = mx.array(_KEY_RULES[op.name](known, q.shape[0], q.shape[1], R, C).astype(np.float32))
    lse = known["lse"][..., None]
    p = mx.where(mx.isinf(lse), 0.0, mx.exp(scale * (q @ k.swapaxes(2, 3)) + mask + rules - lse))
    ds = p * (do @ v.swapaxes(2, 3) - (do * o).sum(-1, keepdims=True))
    extra = ds.ndim - known["mask"].ndim
    ds = ds.sum(axis=tuple(range(extra))) if extra else ds
    axes = tuple(i for i, n in enumerate(known["mask"].shape) if n == 1 and ds.shape[i] != 1)
    return ds.sum(axis=axes, keepdims=True) if axes else ds


attention = mlx_function(ATTENTION)
attention_varlen = mlx_function(ATTENTION_VARLEN)


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                                 mask: str | mx.array | None = None, sinks: mx.array | None = None) -> mx.array:
    """mx.fast.scaled_dot_product_attention, computed by mfa_native, differentiable.

    q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), Hq a multiple of Hkv;
    mask "causal" (lower right: the last query sees every key), a boolean array
    (True = attend) or an additive array, broadcastable to (B, Hq, L, S); sinks (Hq,).

    One difference from MLX: a row with no allowed key (every key masked out, no
    sink) gives 0 here, where MLX gives the mean of v over the masked keys.
    Additive values <= -1e30 remove a key here, so a row masked only with such
    finite values also gives 0.
    """
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be 'causal', an array or None, got {mask!r}")
        return attention(q, k, v, scale=scale, causal="lower_right", sinks=sinks)
    return attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def quantized_scaled_dot_product_attention(queries: mx.array, q_keys: Sequence[mx.array],
                                           q_values: Sequence[mx.array], *, scale: float,
                                           mask: str | mx.array | None = None, group_size: int = 64,
                                           bits: int = 8, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's `quantized_scaled_dot_product_attention`, with K and V read quantized inside
    the kernel (mlx-lm dequantizes them and builds the whole score matrix).

    q_keys and q_values are what mlx-lm's QuantizedKVCache holds: (wq, scales, biases) as
    `mx.quantize(x, group_size, bits)` returns them, (B, Hkv, S, ...) along the head
    dimension; queries (B, Hq, L, D). mask, scale and sinks as in
    `scaled_dot_product_attention`. Not differentiable: a quantized cache has no gradient.
    """
    k, v = (QuantizedTensor.from_mlx(*fields, group_size=group_size, bits=bits) for fields in (q_keys, q_values))
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be 'causal', an array or None, got {mask!r}")
        return _attention(queries, k, v, scale=scale, causal="lower_right", sinks=sinks)
    return _attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)
