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

from typing import Sequence

import mlx.core as mx

import inspect

from .ops.attention import ATTENTION
from .ops.attention import attention as _attention
from .ops.declaration import Call, Op
from .quantized import QuantizedTensor


def mlx_function(op: Op):
    """`op` on MLX arrays as an mx.custom_function: its primals are the op's differentiable
    arrays (those given), its vjp runs the backward op (its arguments found by name, as
    torch/library.py finds them: forward arguments, outputs, and `d` + an output's name for its
    cotangent) or, for an op without one, raises NotImplementedError: never a zero gradient.
    Outputs the backward takes no cotangent of (lse) come back through mx.stop_gradient. Same
    arguments as the op, less `device`."""
    signature = inspect.Signature([p for p in op.parameters() if p.name != "device"])
    primal_names = [a.name for a in op.arguments if a.kind == "array" and a.grad]
    selectors = {o.when: True for o in op.outputs if o.when in op.option_names}
    backward_op = op.backward_op
    backward_names = [] if backward_op is None else [p.name for p in backward_op.parameters() if p.name != "device"]

    def function(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        given = [n for n in primal_names if values[n] is not None]
        everything = Call(op, {**values, **selectors}).results   # what the forward computes
        everything = (everything,) if isinstance(everything, str) else everything

        @mx.custom_function
        def forward(*primals):
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
            return tuple(by_name[op.gradients[n]].astype(p.dtype) for n, p in zip(given, primals))

        outputs = dict(zip(everything, forward(*[values[n] for n in given])))
        outputs = {name: o if f"d{name}" in backward_names else mx.stop_gradient(o) for name, o in outputs.items()}
        asked = Call(op, values).results
        return outputs[asked] if isinstance(asked, str) else tuple(outputs[name] for name in asked)

    function.__name__ = function.__qualname__ = op.name
    function.__signature__ = signature
    function.__doc__ = (f"`mfa_native.{op.name}` on MLX arrays, differentiable (mx.grad, mx.vjp) through its "
                        "declared backward; outputs the backward takes no cotangent of come back through "
                        f"mx.stop_gradient. Arguments and results are `mfa_native.{op.name}`'s, without `device`.")
    return function


attention = mlx_function(ATTENTION)


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
