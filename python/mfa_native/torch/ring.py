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
    the same positions of q and k/v). Every rank must call it.

    Each step computes attention of a rank's queries over one K/V shard while the shards move
    one rank on around the ring (torch.distributed point-to-point ops, overlapped with the
    compute); the partial results merge in float32 on q's device by their lse
    (`mfa_native.merge_attention`). Under causal the queries a rank computes are not its own
    shard but chunks r and 2N-1-r of the global queries cut in 2N (zig-zag: every rank's
    work within a chunk's rounding of the mean, whatever the shard lengths); they travel to
    it and their outputs back to their owners around the ring. Differentiable: the backward
    ring carries each K/V shard's float32 dk/dv along with it (on q's device between
    messages) and returns them to their owner; every rank must call backward. Any
    process-group backend with point-to-point ops works; with gloo the messages go through
    host memory.

    Args:
        q: this rank's queries, as `mfa_native.attention` takes them in `layout` ((B, Hq, R, D)
            for "bhsd"): a torch tensor, float32, float16 or bfloat16. Every dimension but the
            sequence length, the dtype and the options must agree between ranks.
        k: this rank's keys, (B, Hkv, C, D) for "bhsd"; Hq a multiple of Hkv.
        v: this rank's values, (B, Hkv, C, Dv).
        group: the torch.distributed process group; None: the default group.
        causal: False, True (= "lower_right") or "upper_left", as `attention` means it on the
            concatenated q and k/v (the global lengths set the lower-right alignment).
        window: (left, right) as in `attention`, by global position; None: no window.
        sinks: (Hq,) one more logit per head in the softmax denominator of this rank's
            queries; its gradient is that through this rank's rows (sum it over the group, as
            for any replicated parameter).
        scale: the logit scale; None: 1 / sqrt(D).
        layout: "bhsd" or "bshd".
        return_lse: also return this rank's lse.

    Returns:
        This rank's output shard (q's dtype and layout); with return_lse=True the tuple
            (output, lse), lse (B, Hq, R) float32, which takes no gradient.

    Raises:
        ValueError: an argument one rank rejects as `attention` would, or dimensions,
            dtypes, layouts or options that differ between ranks: the same error on every
            rank (the ranks exchange their shard lengths and arguments first, in one
            all-gather).
        TypeError: an argument of the wrong type, likewise on every rank.

    Example:
        ```python
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from mfa_native.torch import ring_attention

        # Under torchrun every rank runs this with its own shard of q, k and v; here one rank
        # (a gloo group of one) holds the whole sequence.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, 2, 16, 32, requires_grad=True) for _ in range(3))
            out = ring_attention(q, k, v, causal=True)
            out.sum().backward()   # every rank calls backward
            assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
        finally:
            dist.destroy_process_group()
        ```
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
    sequences' `mfa_native.attention_with_kvcache`, returned on every rank.

    Rank r's k_cache / v_cache hold every sequence's positions after those of ranks 0..r-1.
    Every rank must call it. The ranks first all-gather their local lengths and the checks of
    their own arguments (the last rank's include the append: a full cache raises here), so a
    bad or mismatched call raises the same error on every rank before anything is written.
    Then each rank attends its part, and one all-gather of every rank's float32 (output,
    lse), `B * R * Hq * (Dv + 1) * 4` bytes per rank whatever the context length, is merged by
    lse (`mfa_native.merge_attention`) on every rank. Inference only.

    Args:
        q: (B, R, Hq, D) torch tensor, float32, float16 or bfloat16: the same on every rank.
        k_cache: this rank's cache, (B, Cmax, Hkv, D), or with block_table its pages
            (num_blocks, page_size, Hkv, D); plain (q's dtype) or a QuantizedTensor, as
            `mfa_native.attention_with_kvcache` takes it.
        v_cache: like k_cache, Dv wide.
        cache_seqlens: int32 (B,), required: this rank's local length of each sequence.
        k: (B, Rn, Hkv, D), optional, the same on every rank: the new rows, which the last rank
            appends to its cache in place (it holds the sequences' tails; the other ranks'
            caches are not written).
        v: (B, Rn, Hkv, Dv), given with k.
        block_table: int32 (B, max_blocks), this rank's pages of a paged cache.
        group: the torch.distributed process group; None: the default group.
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
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from mfa_native.torch import sharded_decode

        # Under torchrun each rank holds its positions of the cache; here one rank holds them all.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            k_cache, v_cache = torch.zeros(1, 32, 2, 32), torch.zeros(1, 32, 2, 32)   # (B, Cmax, Hkv, D)
            k_cache[:, :15], v_cache[:, :15] = torch.randn(2, 1, 15, 2, 32)
            q, k, v = (torch.randn(1, 1, 2, 32) for _ in range(3))                   # one new token
            out = sharded_decode(q, k_cache, v_cache, torch.tensor([15], dtype=torch.int32), k=k, v=v)
            expected = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :16].transpose(1, 2),
                                                      v_cache[:, :16].transpose(1, 2))
            assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5)
        finally:
            dist.destroy_process_group()
        ```
    """
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
                  block_table=block_table)
    options = decode.Options(scale, causal, window, sinks, return_lse)
    return decode.sharded_decode(TorchGroup(group), ATTENTION_WITH_KVCACHE.function, arrays, options)
