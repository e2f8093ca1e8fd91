"""Context parallelism on mx.distributed: `ring_attention` (differentiable through mx.grad and
mx.vjp) and `sharded_decode`, the MLX faces of ring.py and decode.py; `mfa_native.mlx` exports them."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import decode, docs, ring
from .mlx_group import MlxGroup
from .schedule import Window


def ring_attention(q: mx.array, k: mx.array, v: mx.array, *, group: Any = None, causal: bool | str = False,
                   window: Window | None = None, sinks: mx.array | None = None, scale: float | None = None,
                   layout: str = "bhsd", return_lse: bool = False):
    plan = ring.plan(MlxGroup(group), "ring_attention", q, k, v, sinks, causal, window, scale, layout)
    saved: dict[str, ring.Saved] = {}

    @mx.custom_function
    def run(q, k, v, *sinks):
        o, lse, saved["forward"] = ring.forward(plan, q, k, v, sinks[0] if sinks else None)
        return o, lse

    @run.vjp
    def vjp(primals, cotangents, outputs):
        q, k, v, *sinks = primals
        dq, dk, dv, dsinks = ring.backward(plan, saved["forward"], q, k, v, sinks[0] if sinks else None,
                                           cotangents[0])
        return (dq, dk, dv, *([dsinks] if sinks else []))

    o, lse = run(q, k, v, *([] if sinks is None else [sinks]))
    return (o, mx.stop_gradient(lse)) if return_lse else o


ring_attention.__doc__ = docs.ring_attention(
    framework="mx.distributed", array="an MLX array",
    group="the mx.distributed group; None: the global group, `mx.distributed.init()`.",
    transport="mx.distributed send / recv between neighbours, each direction on a stream of its own, so the next "
              "shard is in flight while the current one is computed",
    gradient="mx.grad, mx.vjp; every rank must differentiate it",
    lse="through mx.stop_gradient: it takes no gradient", example="""
        import mlx.core as mx
        from mfa_native.mlx import ring_attention

        # Under mlx.launch every rank runs this with its own shard of q, k and v; run alone,
        # mx.distributed.init() is a group of one rank, which holds the whole sequence.
        mx.random.seed(0)
        q, k, v = (mx.random.normal((1, 2, 16, 32)) for _ in range(3))
        out = ring_attention(q, k, v, causal=True)
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=32 ** -0.5, mask="causal")
        assert mx.allclose(out, expected, atol=1e-5).item()
        dq = mx.grad(lambda q: ring_attention(q, k, v, causal=True).sum())(q)   # every rank differentiates
""")


def sharded_decode(q: mx.array, k_cache, v_cache, cache_seqlens: mx.array, *, k: mx.array | None = None,
                   v: mx.array | None = None, block_table: mx.array | None = None, group: Any = None,
                   scale: float | None = None, causal: bool | str = False, window: Window | None = None,
                   sinks: mx.array | None = None, return_lse: bool = False):
    from ..mlx import attention_with_kvcache

    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
                  block_table=block_table)
    options = decode.Options(scale, causal, window, sinks, return_lse)
    return decode.sharded_decode(MlxGroup(group), attention_with_kvcache, arrays, options)


sharded_decode.__doc__ = docs.sharded_decode(
    framework="mx.distributed", array="MLX array", cache="plain or a QuantizedTensor of MLX arrays",
    group="the mx.distributed group; None: the global group, `mx.distributed.init()`.",
    append="MLX's in-place update, as `mfa_native.mlx.attention_with_kvcache`", example="""
        import mlx.core as mx
        from mfa_native.mlx import sharded_decode

        # Under mlx.launch each rank holds its positions of the cache; run alone, one rank holds them all.
        mx.random.seed(0)
        k_cache = mx.concatenate([mx.random.normal((1, 15, 2, 32)), mx.zeros((1, 17, 2, 32))], axis=1)
        v_cache = mx.concatenate([mx.random.normal((1, 15, 2, 32)), mx.zeros((1, 17, 2, 32))], axis=1)
        q, k, v = (mx.random.normal((1, 1, 2, 32)) for _ in range(3))   # one new token
        out = sharded_decode(q, k_cache, v_cache, mx.array([15], dtype=mx.int32), k=k, v=v)
        expected = mx.fast.scaled_dot_product_attention(*(x.transpose(0, 2, 1, 3) for x in
                                                          (q, k_cache[:, :16], v_cache[:, :16])), scale=32 ** -0.5)
        assert mx.allclose(out, expected.transpose(0, 2, 1, 3), atol=1e-5).item()
""")
