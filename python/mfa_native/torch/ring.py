"""`ring_attention`: context-parallel attention over torch.distributed, K/V shards passed around a ring.

The global query sequence is the concatenation of the ranks' q shards in rank order, the global
key sequence that of their k/v shards; a shard may have any length (0 too), and a rank's q and
k/v shards may differ in length. causal and window mean what they mean for `attention` on the
global sequences. Each (local q shard, K/V shard) pair becomes one `attention` call whose
window (and a trim of trailing queries or keys that see nothing) expresses the global rule;
a pair that allows no key is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.attention import attention, validate
from ..ops.attention_backward import attention_backward
from ..ops.merge import merge_attention
from ..runtime.frameworks import FrameworkCall, Torch

Window = tuple[int, int]
Bound = int | None  # None: unbounded


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None,
                   causal: bool | str = False, window: Window | None = None, sinks: Tensor | None = None,
                   scale: float | None = None, layout: str = "bhsd") -> Tensor:
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

    Each step computes attention of the local queries over one K/V shard while the shards
    move one rank on around the ring (torch.distributed point-to-point ops, overlapped with
    the compute); the partial results merge on q's device by their lse
    (`mfa_native.merge_attention`). Differentiable: the backward ring carries each K/V shard's
    float32 dk/dv along with it (on q's device between messages) and returns them to their
    owner; every rank must call backward.

    Every rank must call it. The ranks first exchange their shard lengths and arguments
    (one all-gather): an argument one rank rejects, or dimensions, dtypes, layouts or options
    that differ between ranks, raise the same error on every rank. Any process-group backend
    with point-to-point ops works; with gloo the messages go through host memory.
    """
    return _Ring.apply(q, k, v, sinks, group, causal, window, scale, layout)


@dataclass(frozen=True)
class _Call:
    """What a rank tells the others about its call: its shard lengths, the facts every rank
    must share, or why its own arguments are wrong (exception type name and message)."""

    q_len: int
    kv_len: int
    shared: tuple[tuple[str, Any], ...] = ()
    error: tuple[str, str] | None = None


def _describe(q: Any, k: Any, v: Any, sinks: Any, causal: Any, window: Any, scale: Any, layout: Any) -> _Call:
    """This rank's _Call, from `attention`'s own checks of its shards (so that no pair of shards
    can fail later, on some ranks only)."""
    try:
        for name, x in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
            if not isinstance(x, Tensor) and not (name == "sinks" and x is None):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        views = FrameworkCall(Torch(), q)
        arrays = [views.view(x, name) for name, x in (("q", q), ("k", k), ("v", v))]
        p = validate((*arrays, None, None if sinks is None else views.view(sinks, "sinks")), scale=scale,
                     causal=causal, window=window, layout=layout, return_lse=True).problem
    except (TypeError, ValueError) as error:
        return _Call(0, 0, error=(type(error).__name__, str(error)))
    return _Call(p.q_len, p.kv_len, (
        ("the batch size", p.batch), ("the heads (Hq, Hkv)", (p.q_heads, p.kv_heads)),
        ("the head dims (D, Dv)", (p.head_dim, p.value_dim)), ("the dtype", p.dtype), ("the layout", p.layout),
        ("causal", p.causal), ("window", None if window is None else tuple(window)), ("scale", p.scale),
        ("sinks (given or not)", sinks is not None)))


def _agree(calls: list[_Call]) -> None:
    """Raises, identically on every rank (each has the same `calls`), the first rank's own
    argument error, or a ValueError naming the first fact the ranks disagree on."""
    for rank, call in enumerate(calls):
        if call.error is not None:
            kind, message = call.error
            raise (TypeError if kind == "TypeError" else ValueError)(f"ring_attention: rank {rank}: {message}")
    for index, (fact, _) in enumerate(calls[0].shared):
        values = [call.shared[index][1] for call in calls]
        if any(value != values[0] for value in values):
            listed = ", ".join(f"rank {rank} has {value!r}" for rank, value in enumerate(values))
            raise ValueError(f"ring_attention: the ranks disagree on {fact}: {listed}")


class _Peers:
    """This rank's place in the ring (it sends to the next rank, receives from the previous
    one) and every rank's shard lengths and global offsets."""

    def __init__(self, group: dist.ProcessGroup | None, calls: list[_Call]) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

        def global_rank(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        self.next, self.previous = global_rank((self.rank + 1) % self.size), global_rank((self.rank - 1) % self.size)
        self.wire = torch.device("cpu") if dist.get_backend(group) == "gloo" else None  # gloo sends CPU tensors
        self.q_lens, self.kv_lens = [c.q_len for c in calls], [c.kv_len for c in calls]
        self.q_offsets = [0, *accumulate(self.q_lens)]
        self.kv_offsets = [0, *accumulate(self.kv_lens)]

    def shift(self, tensor: Tensor, incoming: int, tag: int) -> Callable[[], Tensor]:
        """Starts sending `tensor` (1-d) to the next rank and receiving the previous rank's,
        `incoming` elements (messages of one kind share a tag; empty ones are not sent);
        returns a wait that gives the received tensor, on `tensor`'s device. A ring of one rank
        passes `tensor` to itself."""
        if self.size == 1:
            return lambda: tensor
        wire = tensor.device if self.wire is None else self.wire
        outgoing = tensor.to(wire)
        received = torch.empty(incoming, dtype=tensor.dtype, device=wire)
        ops = ([dist.P2POp(dist.isend, outgoing, self.next, self.group, tag)] if outgoing.numel() else []) + \
              ([dist.P2POp(dist.irecv, received, self.previous, self.group, tag)] if incoming else [])
        requests = dist.batch_isend_irecv(ops) if ops else []

        def wait() -> Tensor:
            for request in requests:
                request.wait()
            ops.clear()  # the sent tensor was held until here
            return received.to(tensor.device)

        return wait


_KV, _GRADS = 0, 1  # message tags


def _seq_axis(layout: str) -> int:
    return 2 if layout == "bhsd" else 1


def _resized(shape: torch.Size, axis: int, length: int) -> torch.Size:
    """`shape` with `axis` `length` long."""
    return torch.Size((*shape[:axis], length, *shape[axis + 1:]))


def _leading(x: Tensor, axis: int, length: int) -> Tensor:
    """The first `length` positions of x along `axis` (a view)."""
    return x.narrow(axis, 0, length)


def _padded(x: Tensor, axis: int, length: int, fill: float) -> Tensor:
    """x extended along `axis` to `length` with `fill`."""
    missing = length - x.shape[axis]
    if missing == 0:
        return x
    return torch.cat([x, x.new_full(_resized(x.shape, axis, missing), fill)], axis)


def _pack(a: Tensor, b: Tensor) -> Tensor:
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def _unpack(block: Tensor, a_shape: torch.Size, b_shape: torch.Size) -> tuple[Tensor, Tensor]:
    n = a_shape.numel()
    return block[:n].view(a_shape), block[n:].view(b_shape)


def _band(causal: str, window: Window | None, q_total: int, kv_total: int) -> tuple[Bound, Bound]:
    """The allowed keys by global position: key j for query i iff low <= j - i <= high."""
    diagonal = kv_total - q_total  # the lower-right alignment
    low: Bound = None
    high: Bound = None
    if window is not None:
        left, right = window
        low = None if left == -1 else diagonal - left
        high = None if right == -1 else diagonal + right
    causal_high = {"lower_right": diagonal, "upper_left": 0}.get(causal)
    if causal_high is not None:
        high = causal_high if high is None else min(high, causal_high)
    return low, high


@dataclass(frozen=True)
class _Pair:
    """What the queries of a q shard see of a K/V shard: the first `rows` queries over the first
    `keys` keys, with `window` (relative to those lengths' lower-right alignment); later queries
    and keys of the shards have no allowed pair."""

    rows: int
    keys: int
    window: Window | None


def _pair(band: tuple[Bound, Bound], q_offset: int, q_len: int, kv_offset: int, kv_len: int) -> _Pair | None:
    """The global band over one pair of shards as an `attention` call; None if it allows no key.

    Locally key j is allowed for query i iff low <= j - i <= high. Keys from q_len + high on
    are allowed for no query, nor queries from keys - low on for any key, so the pair trims
    them; then the lower-right alignment keys - rows lies within [low, high] and the band is
    the window (diagonal - low, high - diagonal)."""
    low, high = (None if bound is None else bound - (kv_offset - q_offset) for bound in band)
    keys = kv_len if high is None else min(kv_len, q_len + high)
    rows = q_len if low is None else min(q_len, keys - low)
    if rows <= 0 or keys <= 0 or (low is not None and high is not None and low > high):
        return None
    diagonal = keys - rows
    window = (-1 if low is None else diagonal - low, -1 if high is None else high - diagonal)
    return _Pair(rows, keys, None if window == (-1, -1) else window)


def _kv_shapes(peers: _Peers, k: Tensor, v: Tensor, axis: int, rank: int) -> tuple[torch.Size, torch.Size]:
    """The shapes of the k and v shards of `rank`."""
    return _resized(k.shape, axis, peers.kv_lens[rank]), _resized(v.shape, axis, peers.kv_lens[rank])


def _kv_size(peers: _Peers, k: Tensor, v: Tensor, axis: int, rank: int) -> int:
    """The elements of the k and v shards of `rank`, together."""
    return sum(shape.numel() for shape in _kv_shapes(peers, k, v, axis, rank))


def _pairs(peers: _Peers, band: tuple[Bound, Bound]) -> list[_Pair | None]:
    """This rank's queries over each rank's K/V shard, by the owning rank."""
    q_offset, q_len = peers.q_offsets[peers.rank], peers.q_lens[peers.rank]
    return [_pair(band, q_offset, q_len, kv_offset, kv_len)
            for kv_offset, kv_len in zip(peers.kv_offsets, peers.kv_lens)]


def _shards(peers: _Peers, k: Tensor, v: Tensor, axis: int) -> Iterator[tuple[int, Tensor, Tensor]]:
    """The K/V shards as they pass this rank, one per step: (the rank that owns it, its k, its
    v). The next shard is already on its way while the caller computes on this one."""
    block = _pack(k, v)
    for step in range(peers.size):
        source = (peers.rank - step) % peers.size
        last = step == peers.size - 1
        pending = None if last else peers.shift(block, _kv_size(peers, k, v, axis, (source - 1) % peers.size), _KV)
        yield source, *_unpack(block, *_kv_shapes(peers, k, v, axis, source))
        if pending is not None:
            block = pending()


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, causal, window, scale, layout):
        calls: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(calls, _describe(q, k, v, sinks, causal, window, scale, layout), group=group)
        _agree(calls)
        peers = _Peers(group, calls)
        shared = dict(calls[0].shared)
        layout = shared["the layout"]
        band = _band(shared["causal"], shared["window"], peers.q_offsets[-1], peers.kv_offsets[-1])
        axis = _seq_axis(layout)
        B, Hq, R = shared["the batch size"], shared["the heads (Hq, Hkv)"][0], q.shape[axis]
        o = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        lse = (torch.full((B, Hq, R), -torch.inf, device=q.device) if sinks is None  # the sink: one more part
               else sinks.detach().to(q.device, torch.float32)[None, :, None].expand(B, Hq, R).contiguous())
        pairs = _pairs(peers, band)
        for source, kb, vb in _shards(peers, k, v, axis):
            pair = pairs[source]
            if pair is None:
                continue
            part_o, part_lse = attention(_leading(q, axis, pair.rows), _leading(kb, axis, pair.keys),
                                         _leading(vb, axis, pair.keys), scale=scale, window=pair.window,
                                         layout=layout, return_lse=True)
            o, lse = merge_attention([o, _padded(part_o, axis, R, 0.0)], [lse, _padded(part_lse, 2, R, -torch.inf)],
                                     layout=layout)
        ctx.save_for_backward(q, k, v, sinks, o, lse)
        ctx.options = (peers, pairs, scale, layout)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, sinks, o, lse = ctx.saved_tensors
        peers, pairs, scale, layout = ctx.options
        axis = _seq_axis(layout)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grads = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=q.device)
        for source, kb, vb in _shards(peers, k, v, axis):
            pair = pairs[source]
            if pair is not None:
                rows = [_leading(x, axis, pair.rows) for x in (q, o, do)]
                dq_s, dk_s, dv_s = attention_backward(
                    rows[0], _leading(kb, axis, pair.keys), _leading(vb, axis, pair.keys), rows[1],
                    _leading(lse, 2, pair.rows), rows[2], scale=scale, window=pair.window, layout=layout)
                _leading(dq, axis, pair.rows).add_(dq_s)
                for grad, part in zip(_unpack(grads, kb.shape, vb.shape), (dk_s, dv_s)):
                    _leading(grad, axis, pair.keys).add_(part)
            incoming = (source - 1) % peers.size  # the shard the previous rank held this step
            grads = peers.shift(grads, _kv_size(peers, k, v, axis, incoming), _GRADS)()
        # after the last step, grads are this rank's own shard's dk/dv
        dk, dv = _unpack(grads, k.shape, v.shape)
        dsinks = None if sinks is None else _sinks_gradient(sinks, o, lse, do, layout).to(sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None


def _sinks_gradient(sinks: Tensor, o: Tensor, lse: Tensor, do: Tensor, layout: str) -> Tensor:
    """dsinks[h] = -sum over batch and rows of p_sink * delta, delta = rowsum(do * o), p_sink =
    exp(sinks[h] - lse): the sink logit has no value (as `attention_backward` computes it)."""
    delta = (do.float() * o.float()).sum(-1)
    if layout == "bshd":
        delta = delta.transpose(1, 2)
    return -(torch.exp(sinks.detach().to(lse)[None, :, None] - lse) * delta).sum((0, 2))
