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

from .ops.attention import attention as _attention
from .ops.attention_backward import attention_backward as _attention_backward
from .quantized import QuantizedTensor


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float | None = None, causal: bool | str = False,
              mask: mx.array | None = None, window: Sequence[int] | None = None, sinks: mx.array | None = None,
              layout: str = "bhsd", return_lse: bool = False) -> mx.array | tuple[mx.array, mx.array]:
    """`mfa_native.attention` on MLX arrays, differentiable: mx.grad / mx.vjp give q, k, v and
    sinks their gradients through `mfa_native.attention_backward` (the mask gets none; lse, with
    return_lse, is not differentiable: it is returned through mx.stop_gradient).

    Arguments and results are `mfa_native.attention`'s (see its docstring), without `device`.
    """
    options = dict(scale=scale, causal=causal, window=window, layout=layout)
    primals = (q, k, v) if sinks is None else (q, k, v, sinks)

    @mx.custom_function
    def forward(*arrays):
        q, k, v, *rest = arrays
        return _attention(q, k, v, mask=mask, sinks=rest[0] if rest else None, return_lse=True, **options)

    @forward.vjp
    def backward(arrays, cotangents, outputs):
        q, k, v, *rest = arrays
        grads = _attention_backward(q, k, v, *outputs, cotangents[0], mask=mask, sinks=rest[0] if rest else None,
                                    **options)
        return grads if not rest else (*grads[:3], grads[3].astype(rest[0].dtype))

    o, lse = forward(*primals)
    return (o, mx.stop_gradient(lse)) if return_lse else o


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
