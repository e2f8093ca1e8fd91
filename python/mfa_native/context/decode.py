"""Decode over a KV cache sharded by position across the ranks of a `Group`, shared by torch and MLX.

Rank r holds positions of every sequence after those of ranks 0..r-1 (`cache_seqlens` is its
local length, per sequence); the new rows (k, v) are appended by the last rank, which holds the
sequences' tails. Every rank first all-gathers its local lengths and its arguments' checks (the
last rank's include the append's capacity), so a bad call raises the same error everywhere
before anything is written. Each rank then attends its part with the framework's
`attention_with_kvcache`: causal and window by global position become, per group of sequences
that see its part alike, one call over the part's first keys (`schedule.pair`). One all-gather of
every rank's (output, lse), float32, and `merge_attention` give every rank the same result.
Bytes per step: the lengths (B int32 per rank, pickled) and N * B * R * Hq * (Dv + 1) * 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..ops.kvcache import checked_append
from ..ops.merge import merge_attention
from ..runtime.frameworks import FrameworkCall, framework_of
from . import schedule
from .agreement import Descriptor, agree, described
from .group import Group, narrow, padded

NAME = "sharded_decode"
LOCAL = ("q", "k_cache", "v_cache", "cache_seqlens", "k", "v", "block_table")


@dataclass(frozen=True)
class Options:
    scale: float | None
    causal: Any
    window: Any
    sinks: Any
    return_lse: bool


def _describe(group: Group, arrays: dict[str, Any], options: Options) -> Descriptor:
    """This rank's local lengths and the facts the ranks share, after the checks of its own call
    (the last rank's with the append, so a full cache raises here, before any write)."""
    q = arrays["q"]
    if not group.owns(q):
        raise TypeError(f"q must be a {group.framework_name}, got {type(q).__name__}")
    views = FrameworkCall(framework_of(q), q)
    host = {name: x if x is None or not group.owns(x) else views.view(x, name) for name, x in arrays.items()}
    last = group.rank == group.size - 1
    if arrays["cache_seqlens"] is None:
        raise ValueError("cache_seqlens is required: each rank's local lengths place its part in the sequences")
    checked_append(*(host[n] if n not in ("k", "v") or last else None for n in LOCAL))
    lengths = np.asarray(host["cache_seqlens"], np.int64)
    sinks = options.sinks
    if sinks is not None and (not group.owns(sinks) or tuple(sinks.shape) != (q.shape[2],)):
        raise ValueError(f"sinks must be a {group.framework_name} (Hq,) = ({q.shape[2]},), got {getattr(sinks, 'shape', sinks)}")
    new = arrays["k"]
    return Descriptor(tuple(int(n) for n in lengths), (
        ("q's shape", tuple(q.shape)), ("q's dtype", str(q.dtype)),
        ("k's shape (None: no append)", None if new is None else tuple(new.shape)),
        ("the value dim", int(arrays["v_cache"].shape[-1])), ("scale", options.scale),
        ("causal", options.causal), ("window", None if options.window is None else tuple(options.window)),
        ("sinks (given or not)", options.sinks is not None), ("return_lse", bool(options.return_lse))))


def _groups(pairs: list[schedule.Pair | None]) -> dict[tuple, list[int]]:
    """The sequences by the call that computes them: (rows, window) -> each sequence's keys (0
    for those the call does not cover, which then see nothing in it)."""
    calls: dict[tuple, list[int]] = {}
    for b, p in enumerate(pairs):
        if p is not None:
            calls.setdefault((p.rows, p.window), [0] * len(pairs))[b] = p.keys
    return calls


def sharded_decode(group: Group, attend: Callable, arrays: dict[str, Any], options: Options) -> Any:
    """The whole sequences' attention on every rank: (out, lse if return_lse); `attend` is the
    framework's attention_with_kvcache."""
    descriptors = group.gather_objects(described(lambda: _describe(group, arrays, options)))
    agree(NAME, descriptors)
    q, new = arrays["q"], arrays["k"]
    B, R = q.shape[0], q.shape[1]
    appended = 0 if new is None else new.shape[1]
    local = np.array([d.own for d in descriptors], np.int64).reshape(group.size, B)
    local[-1] += appended                       # the last rank's part grows by the append
    offsets = np.cumsum(local, axis=0) - local
    causal = {False: "none", True: "lower_right"}.get(options.causal, options.causal)
    mine = [schedule.pair(schedule.band(causal, options.window, R, int(local[:, b].sum())), schedule.Span(0, R),
                          schedule.Span(int(offsets[group.rank, b]), int(local[group.rank, b]))) for b in range(B)]
    last = group.rank == group.size - 1
    base = {name: arrays[name] for name in ("k_cache", "v_cache", "block_table")}
    parts = []
    try:
        if last and appended:
            # The last rank's part ends at every sequence's end, so the call's own causal and window
            # are the global ones, except upper-left alignment: then the append is a call of its own.
            appending = dict(base, cache_seqlens=arrays["cache_seqlens"], k=new, v=arrays["v"], scale=options.scale,
                             return_lse=True)
            if causal != "upper_left":
                parts.append(attend(q, causal=options.causal, window=options.window, **appending))
                mine = []
            else:
                attend(q, **appending)
        for (rows, window), keys in _groups(mine).items():
            o, lse = attend(narrow(q, 1, 0, rows), cache_seqlens=group.int32(keys), window=window,
                            scale=options.scale, return_lse=True, **base)
            parts.append((padded(group, o, 1, R), padded(group, lse, 2, R, -float("inf"))))
        status = 0.0
    except (TypeError, ValueError, RuntimeError) as error:   # reported to every rank below
        failure, status, parts = error, 1.0, []
    Hq, Dv = q.shape[2], arrays["v_cache"].shape[-1]
    o_like, lse_like = group.zeros((B, R, Hq, Dv), q, float32=True), group.zeros((B, Hq, R), q, float32=True)
    if parts:
        o, lse = merge_attention([group.float32(o) for o, _ in parts], [lse for _, lse in parts], layout="bshd") \
            if len(parts) > 1 else (group.float32(parts[0][0]), parts[0][1])
    else:
        o, lse = o_like, lse_like - float("inf")
    flag = group.zeros((1,), q, float32=True) + status
    gathered = group.all_gather(group.cat([flag, o.reshape(-1), lse.reshape(-1)], 0))
    if any(float(g[0]) for g in gathered):   # a rank failed: every rank raises its message
        messages = group.gather_objects((type(failure).__name__, str(failure)) if status else None)
        rank, (kind, message) = next((r, m) for r, m in enumerate(messages) if m is not None)
        raise {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)(f"{NAME}: rank {rank}: {message}")
    n = int(np.prod(o_like.shape))
    outputs = [g[1:1 + n].reshape(o_like.shape) for g in gathered]
    lses = [g[1 + n:].reshape(lse_like.shape) for g in gathered]
    if options.sinks is not None:   # the sink enters once: one more part with no value
        outputs.append(o_like)
        lses.append(lse_like + group.float32(options.sinks)[None, :, None])
    out, lse = merge_attention(outputs, lses, layout="bshd")
    out = group.cast(out, q)
    return (out, lse) if options.return_lse else out
