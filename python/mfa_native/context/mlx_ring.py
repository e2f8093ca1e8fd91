"""Context parallelism on mx.distributed: `ring_attention` (differentiable through mx.grad and
mx.vjp) and `sharded_decode`, the MLX faces of ring.py and decode.py; `mfa_native.mlx` exports them."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import decode, ring
from .mlx_group import MlxGroup
from .schedule import Window


def ring_attention(q: mx.array, k: mx.array, v: mx.array, *, group: Any = None, causal: bool | str = False,
                   window: Window | None = None, sinks: mx.array | None = None, scale: float | None = None,
                   layout: str = "bhsd", return_lse: bool = False):
    """Attention over sequences sharded across the ranks of an mx.distributed `group` (None: the
    global group, `mx.distributed.init()`); returns this rank's output shard.

    Rank r holds a contiguous block of the global queries (q) and one of the global keys (k, v),
    each in rank order; lengths may differ between ranks (0 too). q, k, v are as
    `mfa_native.attention` takes them, in `layout`; causal (False, True = "lower_right",
    "upper_left"), window=(left, right), sinks (Hq,) and scale mean what they mean for
    `attention` on the concatenated sequences. Every rank must call it (and, for gradients,
    differentiate it).

    The ranks first all-gather a descriptor (shard lengths and their own argument checks):
    an argument one rank rejects, or dimensions, dtypes or options that differ between ranks,
    raise the same ValueError (TypeError for a wrong type) on every rank. K/V shards then travel
    around the ring with mx.distributed.send / recv between neighbours, each direction on a
    stream of its own, so the next shard is in flight while the current one is computed; partial
    results merge in float32 by lse (`merge_attention`). Under causal the queries a rank computes
    are the zig-zag chunks r and 2N-1-r of the global queries cut in 2N, which balances the work
    whatever the shard lengths; they travel to it and their outputs back around the ring.

    Differentiable (mx.grad, mx.vjp): the backward runs the ring again, each K/V shard carrying
    its float32 dk/dv back to its owner; dsinks is that of the queries this rank computed (sum
    it over the group, as for any replicated parameter).

    Returns:
        out: this rank's shard, q's dtype and layout; with return_lse also lse (B, Hq, R) float32
        (through mx.stop_gradient: it takes no gradient).
    """
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


def sharded_decode(q: mx.array, k_cache, v_cache, cache_seqlens: mx.array, *, k: mx.array | None = None,
                   v: mx.array | None = None, block_table: mx.array | None = None, group: Any = None,
                   scale: float | None = None, causal: bool | str = False, window: Window | None = None,
                   sinks: mx.array | None = None, return_lse: bool = False):
    """`mfa_native.torch.sharded_decode` on MLX arrays over an mx.distributed `group`: every rank
    holds positions of each sequence after those of the ranks before it (cache_seqlens: its local
    lengths), q is the same on every rank, the last rank appends k and v to its cache (MLX's
    in-place update, as `mfa_native.mlx.attention_with_kvcache`), and every rank gets the whole
    sequences' result, merged from one all-gather of every rank's float32 (output, lse).
    Inference only."""
    from ..mlx import attention_with_kvcache

    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
                  block_table=block_table)
    options = decode.Options(scale, causal, window, sinks, return_lse)
    return decode.sharded_decode(MlxGroup(group), attention_with_kvcache, arrays, options)
