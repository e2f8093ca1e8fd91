"""Context parallelism on torch.distributed: `ring_attention` (K/V shards passed around a ring,
with autograd) and `sharded_decode` (a KV cache sharded across the ranks). The algorithms are
framework-neutral (mfa_native/context/); this module is their torch face."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..context import decode, ring
from ..context.schedule import Window
from ..context.torch_group import TorchGroup
from ..ops.kvcache import ATTENTION_WITH_KVCACHE


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None,
                   causal: bool | str = False, window: Window | None = None, sinks: Tensor | None = None,
                   scale: float | None = None, layout: str = "bhsd", return_lse: bool = False):
    """Attention over sequences sharded across the ranks of `group`; returns this rank's output shard.

    Rank r holds a contiguous block of the global queries (q) and one of the global keys (k, v),
    each in rank order: its queries are global positions [sum of the q lengths of ranks < r,
    + its q length), its keys likewise with the k/v lengths. Lengths may differ between
    ranks (0 too), and a rank's q and k/v lengths may differ (self-attention: give each rank
    the same positions of q and k/v). q, k, v are as `mfa_native.attention` takes them, in
    `layout`; every other dimension, the dtype and the options must agree between ranks.

    causal (False, True = "lower_right", "upper_left") and window=(left, right) mean what
    they mean for `attention` on the concatenated q and k/v (the global lengths set the
    lower-right alignment). sinks (Hq,) is one more logit per head in the softmax
    denominator of this rank's queries; its gradient is that through this rank's rows (sum
    it over the group, as for any replicated parameter).

    Each step computes attention of a rank's queries over one K/V shard while the shards move
    one rank on around the ring (torch.distributed point-to-point ops, overlapped with the
    compute); the partial results merge in float32 on q's device by their lse
    (`mfa_native.merge_attention`). Under causal the queries a rank computes are not its own
    shard but chunks r and 2N-1-r of the global queries cut in 2N (zig-zag: every rank's
    work within a chunk's rounding of the mean, whatever the shard lengths); they travel to
    it and their outputs back to their owners around the ring. Differentiable: the backward
    ring carries each K/V shard's float32 dk/dv along with it (on q's device between
    messages) and returns them to their owner; every rank must call backward.

    Returns this rank's output shard (q's dtype and layout); with return_lse also its lse (B,
    Hq, R) float32, which takes no gradient.

    Every rank must call it. The ranks first exchange their shard lengths and arguments
    (one all-gather): an argument one rank rejects, or dimensions, dtypes, layouts or options
    that differ between ranks, raise the same error on every rank. Any process-group backend
    with point-to-point ops works; with gloo the messages go through host memory.
    """
    o, lse = _Ring.apply(q, k, v, sinks, group, causal, window, scale, layout)
    return (o, lse) if return_lse else o


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, causal, window, scale, layout):
        plan = ring.plan(TorchGroup(group), "ring_attention", q, k, v, sinks, causal, window, scale, layout)
        o, lse, saved = ring.forward(plan, q, k, v, sinks)
        ctx.save_for_backward(q, k, v, sinks)
        ctx.ring = (plan, saved)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _):
        q, k, v, sinks = ctx.saved_tensors
        plan, saved = ctx.ring
        dq, dk, dv, dsinks = ring.backward(plan, saved, q, k, v, sinks, do.contiguous())
        return dq, dk, dv, dsinks, None, None, None, None, None


def sharded_decode(q: Tensor, k_cache, v_cache, cache_seqlens: Tensor, *, k: Tensor | None = None,
                   v: Tensor | None = None, block_table: Tensor | None = None,
                   group: dist.ProcessGroup | None = None, scale: float | None = None, causal: bool | str = False,
                   window: Window | None = None, sinks: Tensor | None = None, return_lse: bool = False):
    """Decode over a KV cache sharded by position across the ranks of `group`: the whole
    sequences' `attention_with_kvcache`, returned on every rank.

    Rank r's k_cache / v_cache (contiguous or paged with its own block_table, plain or
    QuantizedTensor) hold every sequence's positions after those of ranks 0..r-1;
    cache_seqlens (int32 (B,), required) is this rank's local length of each sequence. q (B, R,
    Hq, D) is the same on every rank; so are k, v (B, Rn, Hkv, D/Dv), the new rows, which the
    last rank appends to its cache in place (it holds the sequences' tails; the other ranks'
    caches are not written). causal, window, sinks and scale mean what they mean for
    `mfa_native.attention_with_kvcache` on the whole sequences.

    Every rank must call it. The ranks first all-gather their local lengths and the checks of
    their own arguments (the last rank's include the append: a full cache raises here), so a
    bad or mismatched call raises the same ValueError (TypeError for a wrong type) on every
    rank before anything is written. Then each rank attends its part, and one all-gather of
    every rank's float32 (output, lse) — B * R * Hq * (Dv + 1) * 4 bytes per rank, whatever
    the context length — is merged by lse (`merge_attention`) on every rank.

    Returns:
        out (B, R, Hq, Dv) of q's dtype; with return_lse also lse (B, Hq, R) float32.
    """
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
                  block_table=block_table)
    options = decode.Options(scale, causal, window, sinks, return_lse)
    return decode.sharded_decode(TorchGroup(group), ATTENTION_WITH_KVCACHE.function, arrays, options)
