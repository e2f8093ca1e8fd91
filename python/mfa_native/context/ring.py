"""Ring attention over a `Group`: forward and backward, shared by torch and MLX.

Every rank first all-gathers a descriptor (its shard lengths and arguments, checked by
`attention`'s own validation), so a bad or mismatched call raises the same error everywhere.
The queries and keys a rank computes with are its `blocks` (its own shards, or under causal the
zig-zag chunks of each sequence, fetched from their owners by one pass around the ring:
`regroup`; zig-zag on both sides makes every step's work alike, so no rank waits at the next
message for a busier one). K/V blocks then travel around the ring, the next in flight while the
current one is computed: each (query block, key block) pair is one `attention` call
(`schedule.pair`), merged into the query block's float32 output by lse (`merge_attention`).
Outputs and lse go back to the queries' owners the way they came. The backward runs the same
ring: each K/V block carries its float32 dk/dv with it, and dq, dk, dv return to their owners
like the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from ..ops.attention import attention, validate
from ..ops.attention_backward import attention_backward
from ..ops.merge import merge_attention
from ..runtime.frameworks import FrameworkCall, framework_of
from . import schedule
from .agreement import Descriptor, agree, described
from .group import Group, narrow, padded, resized, shift

LSE_AXIS = 2  # lse is (B, Hq, R)


def _seq_axis(layout: str) -> int:
    return 2 if layout == "bhsd" else 1


def _describe(group: Group, q: Any, k: Any, v: Any, sinks: Any, causal: Any, window: Any, scale: Any,
              layout: Any) -> Descriptor:
    """This rank's descriptor, from `attention`'s own checks of its shards (so that no pair of
    shards can fail later, on some ranks only)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        if not group.owns(x) and not (name == "sinks" and x is None):
            raise TypeError(f"{name} must be a {group.framework_name}, got {type(x).__name__}")
    views = FrameworkCall(framework_of(q), q)
    arrays = [views.view(x, name) for name, x in (("q", q), ("k", k), ("v", v))]
    p = validate((*arrays, None, None if sinks is None else views.view(sinks, "sinks")), scale=scale,
                 causal=causal, window=window, layout=layout, return_lse=True).problem
    return Descriptor((p.q_len, p.kv_len), (
        ("the batch size", p.batch), ("the heads (Hq, Hkv)", (p.q_heads, p.kv_heads)),
        ("the head dims (D, Dv)", (p.head_dim, p.value_dim)), ("the dtype", p.dtype), ("the layout", p.layout),
        ("causal", p.causal), ("window", None if window is None else tuple(window)), ("scale", p.scale),
        ("sinks (given or not)", sinks is not None)))


@dataclass
class Ring:
    """One call's plan on this rank: every rank's shards, the query and key blocks each computes
    with (by rank), the rule."""

    group: Group
    layout: str
    scale: float | None
    q_shards: list[schedule.Span]
    kv_shards: list[schedule.Span]
    q_blocks: list[list[schedule.Span]]
    kv_blocks: list[list[schedule.Span]]
    rule: schedule.Band

    @property
    def axis(self) -> int:
        return _seq_axis(self.layout)

    def work(self, rank: int) -> int:
        """The (query, key) pairs rank computes."""
        return sum(schedule.allowed(self.rule, block, keys) for block in self.q_blocks[rank]
                   for blocks in self.kv_blocks for keys in blocks)

    def pairs(self, source: int):
        """This rank's calls with the K/V blocks `source` computes with: (query block index, the
        key block's offset in source's K/V, the Pair)."""
        for index, block in enumerate(self.q_blocks[self.group.rank]):
            offset = 0
            for keys in self.kv_blocks[source]:
                pair = schedule.pair(self.rule, block, keys)
                if pair is not None:
                    yield index, offset, pair
                offset += keys.length


def plan(group: Group, name: str, q: Any, k: Any, v: Any, sinks: Any, causal: Any, window: Any, scale: Any,
         layout: Any) -> Ring:
    """Every rank's descriptor all-gathered and agreed on (raising the same error everywhere), as
    this rank's Ring."""
    descriptors = group.gather_objects(described(lambda: _describe(group, q, k, v, sinks, causal, window, scale,
                                                                   layout)))
    agree(name, descriptors)
    shared = dict(descriptors[0].shared)
    q_shards = schedule.spans([d.own[0] for d in descriptors])
    kv_shards = schedule.spans([d.own[1] for d in descriptors])
    rule = schedule.band(shared["causal"], shared["window"], q_shards[-1].end, kv_shards[-1].end)
    return Ring(group, shared["the layout"], scale, q_shards, kv_shards,
                schedule.blocks(shared["causal"], q_shards), schedule.blocks(shared["causal"], kv_shards), rule)


def _own(shards: list[schedule.Span]) -> list[list[schedule.Span]]:
    """Every rank's own shard, as blocks."""
    return [[shard] if shard.length else [] for shard in shards]


def _pieces(x: Any, spans: list[schedule.Span], axis: int) -> list[Any]:
    """x (the spans' rows one after the other along axis) cut into one array per span."""
    starts = [0, *accumulate(span.length for span in spans)]
    return [narrow(x, axis, start, span.length) for start, span in zip(starts, spans)]


def regroup(ring: Ring, x: Any, have: list[list[schedule.Span]], want: list[list[schedule.Span]], axis: int) -> Any:
    """Rows moved between ranks: this rank's x holds its `have` spans one after the other along
    `axis`; returns the array of its `want` spans likewise. Every rank's rows go once around the
    ring; each rank keeps what it wants of them."""
    group = ring.group
    if have == want:
        return x
    found: list[list[tuple[int, Any]]] = [[] for _ in want[group.rank]]
    message = _pieces(x, have[group.rank], axis)
    for step in range(group.size):
        source = (group.rank - step) % group.size
        for span, piece in zip(have[source], message):
            for index, wanted in enumerate(want[group.rank]):
                common = span.overlap(wanted)
                if common is not None:
                    found[index].append((common.start, narrow(piece, axis, common.start - span.start, common.length)))
        if step < group.size - 1:
            incoming = have[(source - 1) % group.size]
            message = shift(group, message, [resized(tuple(x.shape), axis, s.length) for s in incoming], x)()
    parts = [part for spans in found for _, part in sorted(spans, key=lambda p: p[0])]
    total = sum(span.length for span in want[group.rank])
    return group.cat(parts, axis) if parts else group.zeros(resized(tuple(x.shape), axis, total), x)


def _kv_blocks(ring: Ring, k: Any, v: Any):
    """The K/V blocks as they pass this rank, one per step: (the rank that computes with them,
    its k, its v). The next is already on its way while the caller computes on this one."""
    group, axis = ring.group, ring.axis
    block = [k, v]
    for step in range(group.size):
        source = (group.rank - step) % group.size
        incoming = sum(span.length for span in ring.kv_blocks[(source - 1) % group.size])
        pending = None if step == group.size - 1 else shift(
            group, block, [resized(tuple(x.shape), axis, incoming) for x in (k, v)], k)
        yield source, block[0], block[1]
        if pending is not None:
            block = pending()


@dataclass
class Saved:
    """What the backward needs of the forward: this rank's query blocks (one after the other),
    K/V blocks, outputs (float32 per query block, cast) and lse."""

    q: Any
    k: Any
    v: Any
    o: list[Any]
    lse: list[Any]


def forward(ring: Ring, q: Any, k: Any, v: Any, sinks: Any) -> tuple[Any, Any, Saved]:
    """This rank's output shard (q's dtype) and lse (B, Hq, R) float32, and what the backward needs."""
    group, axis, layout, rank = ring.group, ring.axis, ring.layout, ring.group.rank
    q_all = regroup(ring, q, _own(ring.q_shards), ring.q_blocks, axis)
    k_all, v_all = (regroup(ring, x, _own(ring.kv_shards), ring.kv_blocks, axis) for x in (k, v))
    q_blocks = _pieces(q_all, ring.q_blocks[rank], axis)
    B, Hq = q.shape[0], q.shape[1 if layout == "bhsd" else 2]
    outputs, lses = [], []
    for block in ring.q_blocks[rank]:
        outputs.append(group.zeros(resized((*q.shape[:-1], v.shape[-1]), axis, block.length), q, float32=True))
        lse = group.zeros((B, Hq, block.length), q, float32=True)
        lses.append(lse - float("inf") if sinks is None else lse + group.float32(sinks)[None, :, None])
    for source, kb, vb in _kv_blocks(ring, k_all, v_all):
        for index, offset, pair in ring.pairs(source):
            part_o, part_lse = attention(narrow(q_blocks[index], axis, 0, pair.rows), narrow(kb, axis, offset, pair.keys),
                                         narrow(vb, axis, offset, pair.keys), scale=ring.scale, window=pair.window,
                                         layout=layout, return_lse=True)
            length = outputs[index].shape[axis]
            outputs[index], lses[index] = merge_attention(
                [outputs[index], padded(group, group.float32(part_o), axis, length)],
                [lses[index], padded(group, part_lse, LSE_AXIS, length, -float("inf"))], layout=layout)
    outputs = [group.cast(o, q) for o in outputs]
    o_like = group.zeros(resized((*q.shape[:-1], v.shape[-1]), axis, 0), q)
    lse_like = group.zeros((B, Hq, 0), q, float32=True)
    o = regroup(ring, group.cat(outputs, axis) if outputs else o_like, ring.q_blocks, _own(ring.q_shards), axis)
    lse = regroup(ring, group.cat(lses, LSE_AXIS) if lses else lse_like, ring.q_blocks, _own(ring.q_shards),
                  LSE_AXIS)
    return o, lse, Saved(q_all, k_all, v_all, outputs, lses)


def backward(ring: Ring, saved: Saved, q: Any, k: Any, v: Any, sinks: Any, do: Any) -> tuple[Any, Any, Any, Any]:
    """dq, dk, dv of this rank's shards (their dtypes; float32 accumulation) and dsinks through the
    queries this rank computed (sum it over the group), from the forward's Saved."""
    group, axis, layout, rank = ring.group, ring.axis, ring.layout, ring.group.rank
    do_blocks = _pieces(regroup(ring, do, _own(ring.q_shards), ring.q_blocks, axis), ring.q_blocks[rank], axis)
    q_blocks = _pieces(saved.q, ring.q_blocks[rank], axis)
    dq_blocks = [group.zeros(tuple(x.shape), x, float32=True) for x in q_blocks]
    grads = [group.zeros(tuple(saved.k.shape), k, float32=True), group.zeros(tuple(saved.v.shape), v, float32=True)]
    for source, kb, vb in _kv_blocks(ring, saved.k, saved.v):
        for index, offset, pair in ring.pairs(source):
            rows = [narrow(x, axis, 0, pair.rows) for x in (q_blocks[index], saved.o[index], do_blocks[index])]
            dq, dk, dv = attention_backward(rows[0], narrow(kb, axis, offset, pair.keys),
                                            narrow(vb, axis, offset, pair.keys), rows[1],
                                            narrow(saved.lse[index], LSE_AXIS, 0, pair.rows), rows[2],
                                            scale=ring.scale, window=pair.window, layout=layout)
            dq_blocks[index] = dq_blocks[index] + padded(group, group.float32(dq), axis, dq_blocks[index].shape[axis])
            grads = [g + _placed(group, group.float32(d), axis, offset, g.shape[axis]) for g, d in zip(grads, (dk, dv))]
        incoming = sum(span.length for span in ring.kv_blocks[(source - 1) % group.size])  # the previous rank's
        grads = shift(group, grads, [resized(tuple(x.shape), axis, incoming) for x in (k, v)], grads[0])()
    # after the last step, grads are the dk/dv of this rank's own K/V blocks
    dq = regroup(ring, group.cat(dq_blocks, axis) if dq_blocks else group.zeros(resized(tuple(q.shape), axis, 0), q,
                                                                                 float32=True),
                 ring.q_blocks, _own(ring.q_shards), axis)
    dk, dv = (regroup(ring, g, ring.kv_blocks, _own(ring.kv_shards), axis) for g in grads)
    dsinks = None
    if sinks is not None:
        dsinks = group.zeros(tuple(sinks.shape), sinks, float32=True)
        for o, lse, d in zip(saved.o, saved.lse, do_blocks):
            dsinks = dsinks + _sinks_gradient(group, sinks, o, lse, d, layout)
        dsinks = group.cast(dsinks, sinks)
    return group.cast(dq, q), group.cast(dk, k), group.cast(dv, v), dsinks


def _placed(group: Group, x: Any, axis: int, start: int, length: int) -> Any:
    """x at positions [start, start + x's length) of `length` zeros along axis."""
    before = group.zeros(resized(tuple(x.shape), axis, start), x)
    return padded(group, group.cat([before, x], axis), axis, length)


def _sinks_gradient(group: Group, sinks: Any, o: Any, lse: Any, do: Any, layout: str) -> Any:
    """dsinks[h] = -sum over batch and rows of p_sink * delta, delta = rowsum(do * o), p_sink =
    exp(sinks[h] - lse): the sink logit has no value (as `attention_backward` computes it)."""
    delta = (group.float32(do) * group.float32(o)).sum(-1)
    if layout == "bshd":
        delta = group.swap(delta, 1, 2)
    return -(group.exp(group.float32(sinks)[None, :, None] - lse) * delta).sum((0, 2))
