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
    """Attention over sequences sharded across the ranks of an mx.distributed `group`; returns
    this rank's output shard (`mfa_native.torch.ring_attention` on MLX arrays).

    Rank r holds a contiguous block of the global queries (q) and one of the global keys (k, v),
    each in rank order; lengths may differ between ranks (0 too). Every rank must call it
    (and, for gradients, differentiate it). The ranks first all-gather a descriptor (shard
    lengths and their own argument checks), so an argument one rank rejects raises on every
    rank. K/V shards then travel around the ring with mx.distributed.send / recv between
    neighbours, each direction on a stream of its own, so the next shard is in flight while
    the current one is computed; partial results merge in float32 by lse
    (`mfa_native.merge_attention`). Under causal the queries a rank computes are the zig-zag
    chunks r and 2N-1-r of the global queries cut in 2N, which balances the work whatever the
    shard lengths; they travel to it and their outputs back around the ring.

    Differentiable (mx.grad, mx.vjp): the backward runs the ring again, each K/V shard carrying
    its float32 dk/dv back to its owner; dsinks is that of the queries this rank computed (sum
    it over the group, as for any replicated parameter).

    Args:
        q: this rank's queries as `mfa_native.attention` takes them in `layout` ((B, Hq, R, D)
            for "bhsd"), an MLX array, float32, float16 or bfloat16.
        k: this rank's keys, (B, Hkv, C, D) for "bhsd"; Hq a multiple of Hkv.
        v: this rank's values, (B, Hkv, C, Dv).
        group: the mx.distributed group; None: the global group, `mx.distributed.init()`.
        causal: False, True (= "lower_right") or "upper_left", as `attention` means it on the
            concatenated sequences.
        window: (left, right) as in `attention`, by global position; None: no window.
        sinks: (Hq,) one more logit per head in the softmax denominator, or None.
        scale: the logit scale; None: 1 / sqrt(D).
        layout: "bhsd" or "bshd".
        return_lse: also return the lse.

    Returns:
        This rank's output shard, q's dtype and layout; with return_lse=True the tuple
            (output, lse), lse (B, Hq, R) float32 (through mx.stop_gradient: it takes no
            gradient).

    Raises:
        ValueError: an argument one rank rejects, or dimensions, dtypes or options that
            differ between ranks: the same error on every rank.
        TypeError: an argument of the wrong type, likewise on every rank.

    Example:
        ```python
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
        ```
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
    """Decode over a KV cache sharded by position across the ranks of an mx.distributed `group`
    (`mfa_native.torch.sharded_decode` on MLX arrays): the whole sequences'
    `attention_with_kvcache`, returned on every rank.

    Every rank holds positions of each sequence after those of the ranks before it
    (cache_seqlens: its local lengths), q is the same on every rank, the last rank appends k
    and v to its cache (MLX's in-place update, as `mfa_native.mlx.attention_with_kvcache`),
    and every rank gets the whole sequences' result, merged from one all-gather of every
    rank's float32 (output, lse). Every rank must call it. Inference only.

    Args:
        q: (B, R, Hq, D) MLX array, float32, float16 or bfloat16: the same on every rank.
        k_cache: this rank's cache, (B, Cmax, Hkv, D) or with block_table its pages
            (num_blocks, page_size, Hkv, D); plain or a QuantizedTensor of MLX arrays.
        v_cache: like k_cache, Dv wide.
        cache_seqlens: int32 (B,), required: this rank's local length of each sequence.
        k: (B, Rn, Hkv, D), optional, the same on every rank: the new rows, appended by the
            last rank to its cache in place.
        v: (B, Rn, Hkv, Dv), given with k.
        block_table: int32 (B, max_blocks), this rank's pages of a paged cache.
        group: the mx.distributed group; None: the global group, `mx.distributed.init()`.
        scale: the logit scale; None: 1 / sqrt(D).
        causal: as `attention_with_kvcache` means it on the whole sequences.
        window: likewise.
        sinks: (Hq,), likewise.
        return_lse: also return the lse.

    Returns:
        out (B, R, Hq, Dv) of q's dtype, the same on every rank; with return_lse=True the tuple
            (out, lse), lse (B, Hq, R) float32.

    Raises:
        ValueError: an argument a rank's `attention_with_kvcache` would reject (the last
            rank's append beyond its cache included) or arguments that differ between ranks:
            the same error on every rank, before anything is written.
        TypeError: an argument of the wrong type, likewise on every rank.

    Example:
        ```python
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
        ```
    """
    from ..mlx import attention_with_kvcache

    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
                  block_table=block_table)
    options = decode.Options(scale, causal, window, sinks, return_lse)
    return decode.sharded_decode(MlxGroup(group), attention_with_kvcache, arrays, options)
