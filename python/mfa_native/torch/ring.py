"""`ring_attention`: context-parallel attention over torch.distributed, K/V shards passed around a ring."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.attention import attention
from ..ops.attention_backward import attention_backward
from ..ops.merge import merge_attention


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None,
                   causal: bool = False, scale: float | None = None, layout: str = "bhsd") -> Tensor:
    """Attention over a sequence sharded across the ranks of `group`; returns this rank's output shard.

    Rank r of P holds positions [r*S/P, (r+1)*S/P) of q, k and v (equal shards; q, k, v as
    `mfa_native.attention` takes them, in `layout`). Each step computes attention of the
    local queries over one K/V shard while the shards move one rank on around the ring
    (torch.distributed point-to-point ops, overlapped with the compute); the partial results
    merge by their lse (`mfa_native.merge_attention`). causal=True masks by global position:
    shards after the local one contribute nothing, the local one is causal, earlier ones
    are full. Differentiable: the backward ring carries each K/V shard's dk/dv along with it
    and returns them to their owner; every rank must call backward.

    Every rank must call it with the same shapes and arguments; any process-group backend
    with point-to-point ops (gloo on CPU) works.
    """
    return _Ring.apply(q, k, v, group, bool(causal), scale, layout)


class _Peers:
    """This rank's place in the ring: it sends to the next rank and receives from the previous one."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

        def global_rank(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        self.next, self.previous = global_rank((self.rank + 1) % self.size), global_rank((self.rank - 1) % self.size)

    def shift(self, tensor: Tensor, tag: int) -> Callable[[], Tensor]:
        """Starts sending `tensor` to the next rank and receiving the previous rank's (messages
        of one kind share a tag); returns a wait that gives the received tensor."""
        received = torch.empty_like(tensor)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                           dist.P2POp(dist.irecv, received, self.previous, self.group, tag)])

        def wait() -> Tensor:
            for request in requests:
                request.wait()
            return received

        return wait


_KV, _GRADS = 0, 1  # message tags


def _mode(causal: bool, source: int, rank: int) -> str | bool | None:
    """The causal argument for the queries of `rank` over the keys of `source`; None: no key is seen."""
    if not causal or source < rank:
        return False
    return "upper_left" if source == rank else None


def _pack(a: Tensor, b: Tensor) -> Tensor:
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def _unpack(block: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return block[:a.numel()].view(a.shape), block[a.numel():].view(b.shape)


def _shards(peers: _Peers, k: Tensor, v: Tensor, causal: bool):
    """The K/V shards as they pass this rank, one per step: (the causal argument for the local
    queries over it, None when they see none of its keys; its k; its v). The next shard is
    already on its way while the caller computes on this one."""
    block = _pack(k, v)
    for step in range(peers.size):
        pending = peers.shift(block, _KV) if step < peers.size - 1 else None
        kb, vb = _unpack(block, k, v)
        yield _mode(causal, (peers.rank - step) % peers.size, peers.rank), kb, vb
        if pending is not None:
            block = pending()


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout):
        peers = _Peers(group)
        o, lse = None, None
        for mode, kb, vb in _shards(peers, k, v, causal):
            if mode is not None:
                part = attention(q, kb, vb, scale=scale, causal=mode, layout=layout, return_lse=True)
                o, lse = part if o is None else merge_attention([o, part[0]], [lse, part[1]], layout=layout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = (peers, causal, scale, layout)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        peers, causal, scale, layout = ctx.options
        dq = torch.zeros(q.shape, dtype=torch.float32)
        grads = torch.zeros(k.numel() + v.numel(), dtype=torch.float32)
        for mode, kb, vb in _shards(peers, k, v, causal):
            if mode is not None:
                dq_s, dk_s, dv_s = attention_backward(q, kb, vb, o, lse, do, scale=scale, causal=mode, layout=layout)
                dq += dq_s
                grads += _pack(dk_s, dv_s)
            grads = peers.shift(grads, _GRADS)()  # after the last step, this rank's own shard's dk/dv
        dk, dv = _unpack(grads, k, v)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
