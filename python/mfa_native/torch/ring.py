"""Context parallelism on torch.distributed: `ring_attention` (K/V shards passed around a ring,
with autograd) and `sharded_decode` (a KV cache sharded across the ranks). The algorithms are
framework-neutral (mfa_native/context/); this module is their torch face."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..context import decode, docs, ring
from ..context.schedule import Window
from ..context.torch_group import TorchGroup
from ..ops.kvcache import ATTENTION_WITH_KVCACHE


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None,
                   causal: bool | str = False, window: Window | None = None, sinks: Tensor | None = None,
                   scale: float | None = None, layout: str = "bhsd", return_lse: bool = False):
    o, lse = _Ring.apply(q, k, v, sinks, group, causal, window, scale, layout)
    return (o, lse) if return_lse else o


ring_attention.__doc__ = docs.ring_attention(
    framework="torch.distributed", array="a torch tensor",
    group="the torch.distributed process group; None: the default group.",
    transport="torch.distributed point-to-point ops, overlapped with the compute; any backend that has "
              "them works, gloo's messages going through host memory",
    gradient="every rank must call backward", lse="which takes no gradient",
    example="""
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
""")


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
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
                  block_table=block_table)
    options = decode.Options(scale, causal, window, sinks, return_lse)
    return decode.sharded_decode(TorchGroup(group), ATTENTION_WITH_KVCACHE.function, arrays, options)


sharded_decode.__doc__ = docs.sharded_decode(
    framework="torch.distributed", array="torch tensor",
    cache="plain (q's dtype) or a QuantizedTensor, as `mfa_native.attention_with_kvcache` takes it",
    group="the torch.distributed process group; None: the default group.",
    append="it holds the sequences' tails", example="""
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
""")
