"""Ring attention over a `Group`: forward and backward, shared by torch and MLX.

Every rank first all-gathers a descriptor (its shard lengths and arguments, checked by
`attention`'s own validation), so a bad or mismatched call raises the same error everywhere.
The queries a rank computes are its `query_blocks` (its own shard, or under causal its zig-zag
chunks, fetched from their owners by one pass around the ring: `regroup`). K/V shards then
travel around the ring, the next one in flight while the current one is computed: each (query
block, key shard) pair is one `attention` call (`schedule.pair`), merged into the block's
float32 output by lse (`merge_attention`). Outputs and lse go back to the queries' owners the
way they came. The backward runs the same ring: each K/V shard carries its float32 dk/dv with
it back to its owner, and dq returns to its owner like the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ops.attention import attention, validate
from ..ops.attention_backward import attention_backward
from ..ops.merge import merge_attention
from ..runtime.frameworks import FrameworkCall, framework_of
from . import schedule
from .agreement import Descriptor, agree, described
from .group import Group, narrow, padded, resized

LSE_AXIS = 2  # lse is (B, Hq, R)


def _seq_axis(layout: str) -> int:
    return 2 if layout == "bhsd" else 1


def _describe(group: Group, q: Any, k: Any, v: Any, sinks: Any, causal: Any, window: Any, scale: Any,
              layout: Any) -> Descriptor:
    """This rank's descriptor, from `attention`'s own checks of its shards (so that no pair of
    shards can fail later, on some ranks only)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        if not group.owns(x) and not (name == "sinks" and x is None):
            raise TypeError(f"{name} must be a {group.framework_name} array, got {type(x).__name__}")
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
    """One call's plan on this rank: every rank's shards, the queries each computes, the rule."""

    group: Group
    layout: str
    scale: float | None
    q_shards: list[schedule.Span]
    kv_shards: list[schedule.Span]
    blocks: list[list[schedule.Span]]  # by rank: the query blocks it computes
    rule: schedule.Band

    @property
    def axis(self) -> int:
        return _seq_axis(self.layout)

    @property
    def mine(self) -> list[schedule.Span]:
        return self.blocks[self.group.rank]

    def work(self, rank: int) -> int:
        """The (query, key) pairs rank computes."""
        return sum(schedule.allowed(self.rule, block, shard) for block in self.blocks[rank] for shard in self.kv_shards)


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
                schedule.query_blocks(shared["causal"], q_shards), rule)


def regroup(ring: Ring, pieces: list[Any], have: list[list[schedule.Span]], want: list[list[schedule.Span]],
            axis: int, like: Any) -> list[Any]:
    """Rows moved between ranks: this rank holds `pieces` (arrays over its `have` spans along
    `axis`, of `like`'s other dimensions and dtype); returns arrays over its `want` spans. Every
    rank's pieces go once around the ring; each rank keeps what it wants of them."""
    group = ring.group
    if have == want:
        return pieces
    found: list[list[tuple[int, Any]]] = [[] for _ in want[group.rank]]
    message = pieces
    for step in range(group.size):
        source = (group.rank - step) % group.size
        for span, piece in zip(have[source], message):
            for index, wanted in enumerate(want[group.rank]):
                common = span.overlap(wanted)
                if common is not None:
                    found[index].append((common.start, narrow(piece, axis, common.start - span.start, common.length)))
        if step < group.size - 1:
            incoming = have[(source - 1) % group.size]
            message = group.shift(message, [resized(tuple(like.shape), axis, s.length) for s in incoming], like)()
    return [group.cat([part for _, part in sorted(parts, key=lambda p: p[0])], axis) for parts in found]


def _kv_shards(ring: Ring, k: Any, v: Any):
    """The K/V shards as they pass this rank, one per step: (the rank that owns it, its k, its v).
    The next shard is already on its way while the caller computes on this one."""
    group, axis = ring.group, ring.axis
    block = [k, v]
    for step in range(group.size):
        source = (group.rank - step) % group.size
        incoming = ring.kv_shards[(source - 1) % group.size].length
        pending = None if step == group.size - 1 else group.shift(
            block, [resized(tuple(x.shape), axis, incoming) for x in (k, v)], k)
        yield source, block[0], block[1]
        if pending is not None:
            block = pending()


def _own(ring: Ring) -> list[list[schedule.Span]]:
    """Every rank's own query shard, as blocks."""
    return [[shard] if shard.length else [] for shard in ring.q_shards]


@dataclass
class Saved:
    """What the backward needs of the forward: this rank's query blocks, their outputs and lse."""

    q: list[Any]
    o: list[Any]
    lse: list[Any]


def forward(ring: Ring, q: Any, k: Any, v: Any, sinks: Any) -> tuple[Any, Any, Saved]:
    """This rank's output shard (q's dtype) and lse (B, Hq, R) float32, and what the backward needs."""
    group, axis, layout = ring.group, ring.axis, ring.layout
    q_blocks = regroup(ring, [q] if q.shape[axis] else [], _own(ring), ring.blocks, axis, q)
    B, Hq = q.shape[0], q.shape[1 if layout == "bhsd" else 2]
    outputs, lses = [], []
    for block in ring.mine:
        o_shape = resized((*q.shape[:-1], v.shape[-1]), axis, block.length)
        outputs.append(group.zeros(o_shape, q, float32=True))
        lse = group.zeros((B, Hq, block.length), q, float32=True)
        lses.append(lse - float("inf") if sinks is None else lse + group.float32(sinks)[None, :, None])
    for source, kb, vb in _kv_shards(ring, k, v):
        for index, (block, qb) in enumerate(zip(ring.mine, q_blocks)):
            pair = schedule.pair(ring.rule, block, ring.kv_shards[source])
            if pair is None:
                continue
            part_o, part_lse = attention(narrow(qb, axis, 0, pair.rows), narrow(kb, axis, 0, pair.keys),
                                         narrow(vb, axis, 0, pair.keys), scale=ring.scale, window=pair.window,
                                         layout=layout, return_lse=True)
            outputs[index], lses[index] = merge_attention(
                [outputs[index], padded(group, group.float32(part_o), axis, block.length)],
                [lses[index], padded(group, part_lse, LSE_AXIS, block.length, -float("inf"))], layout=layout)
    outputs = [group.cast(o, q) for o in outputs]
    o_like = group.zeros(resized((*q.shape[:-1], v.shape[-1]), axis, 0), q)
    lse_like = group.zeros((B, Hq, 0), q, float32=True)
    o = regroup(ring, outputs, ring.blocks, _own(ring), axis, o_like)
    lse = regroup(ring, lses, ring.blocks, _own(ring), LSE_AXIS, lse_like)
    return (o[0] if o else o_like), (lse[0] if lse else lse_like), Saved(q_blocks, outputs, lses)


def backward(ring: Ring, saved: Saved, q: Any, k: Any, v: Any, sinks: Any, do: Any) -> tuple[Any, Any, Any, Any]:
    """dq, dk, dv of this rank's shards (their dtypes; float32 accumulation) and dsinks through the
    queries this rank computed (sum it over the group), from the forward's Saved."""
    group, axis, layout = ring.group, ring.axis, ring.layout
    do_blocks = regroup(ring, [do] if do.shape[axis] else [], _own(ring), ring.blocks, axis, do)
    dq_blocks = [group.zeros(tuple(x.shape), x, float32=True) for x in saved.q]
    grads = [group.zeros(tuple(k.shape), k, float32=True), group.zeros(tuple(v.shape), v, float32=True)]
    for source, kb, vb in _kv_shards(ring, k, v):
        for index, block in enumerate(ring.mine):
            pair = schedule.pair(ring.rule, block, ring.kv_shards[source])
            if pair is None:
                continue
            rows = [narrow(x, axis, 0, pair.rows) for x in (saved.q[index], saved.o[index], do_blocks[index])]
            dq, dk, dv = attention_backward(rows[0], narrow(kb, axis, 0, pair.keys), narrow(vb, axis, 0, pair.keys),
                                            rows[1], narrow(saved.lse[index], LSE_AXIS, 0, pair.rows), rows[2],
                                            scale=ring.scale, window=pair.window, layout=layout)
            dq_blocks[index] = dq_blocks[index] + padded(group, group.float32(dq), axis, block.length)
            grads = [g + padded(group, group.float32(d), axis, g.shape[axis]) for g, d in zip(grads, (dk, dv))]
        incoming = ring.kv_shards[(source - 1) % group.size].length  # the shard the previous rank held
        grads = group.shift(grads, [resized(tuple(x.shape), axis, incoming) for x in (k, v)], grads[0])()
    # after the last step, grads are this rank's own shard's dk/dv
    dq = regroup(ring, dq_blocks, ring.blocks, _own(ring), axis, group.zeros(tuple(q.shape), q, float32=True))
    dq = dq[0] if dq else group.zeros(tuple(q.shape), q, float32=True)
    dsinks = None
    if sinks is not None:
        dsinks = group.zeros(tuple(sinks.shape), sinks, float32=True)
        for o, lse, d in zip(saved.o, saved.lse, do_blocks):
            dsinks = dsinks + _sinks_gradient(group, sinks, o, lse, d, layout)
        dsinks = group.cast(dsinks, sinks)
    return group.cast(dq, q), group.cast(grads[0], k), group.cast(grads[1], v), dsinks


def _sinks_gradient(group: Group, sinks: Any, o: Any, lse: Any, do: Any, layout: str) -> Any:
    """dsinks[h] = -sum over batch and rows of p_sink * delta, delta = rowsum(do * o), p_sink =
    exp(sinks[h] - lse): the sink logit has no value (as `attention_backward` computes it)."""
    delta = (group.float32(do) * group.float32(o)).sum(-1)
    if layout == "bshd":
        delta = group.swap(delta, 1, 2)
    return -(group.exp(group.float32(sinks)[None, :, None] - lse) * delta).sum((0, 2))
