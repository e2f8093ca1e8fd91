"""What each rank computes in context-parallel attention, from global positions alone.

The global query sequence is the ranks' q shards in rank order, the global key sequence their
K/V shards. `band` is the causal/window rule on global positions; `pair` is that rule over one
block of queries and one key shard as a single `attention` call (or None: no query sees a key);
`blocks` assigns the global queries (and keys) to the ranks that compute with them: each its own
shard, or under causal a zig-zag (rank r gets chunks r and 2N-1-r of 2N equal chunks), so every
rank's work is the mean within a chunk's rounding; `allowed` counts a block's work.

No framework is imported here: torch and MLX share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np

Window = tuple[int, int]
Bound = int | None  # None: unbounded
Band = tuple[Bound, Bound]


@dataclass(frozen=True)
class Span:
    """Global positions [start, start + length)."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    def overlap(self, other: Span) -> Span | None:
        """The positions both hold, or None."""
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Span(start, end - start) if end > start else None


def spans(lengths: list[int]) -> list[Span]:
    """The shards of the given lengths, one after the other from position 0."""
    return [Span(start, length) for start, length in zip([0, *accumulate(lengths)], lengths)]


def band(causal: str, window: Window | None, q_total: int, kv_total: int) -> Band:
    """The allowed keys by global position: key j for query i iff low <= j - i <= high
    (`attention`'s causal and window on the whole sequences)."""
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
class Pair:
    """What a block of queries sees of a key shard: its first `rows` queries over the shard's first
    `keys` keys, with `window` (relative to those lengths' lower-right alignment); later queries
    and keys have no allowed pair."""

    rows: int
    keys: int
    window: Window | None


def pair(rule: Band, queries: Span, keys: Span) -> Pair | None:
    """The global band over queries x keys as an `attention` call; None if it allows no key.

    Locally key j is allowed for query i iff low <= j - i <= high. Keys from q_len + high on
    are allowed for no query, nor queries from keys - low on for any key, so the pair trims
    them; then the lower-right alignment keys - rows lies within [low, high] and the band is
    the window (diagonal - low, high - diagonal)."""
    low, high = (None if bound is None else bound - (keys.start - queries.start) for bound in rule)
    n_keys = keys.length if high is None else min(keys.length, queries.length + high)
    rows = queries.length if low is None else min(queries.length, n_keys - low)
    if rows <= 0 or n_keys <= 0 or (low is not None and high is not None and low > high):
        return None
    diagonal = n_keys - rows
    window = (-1 if low is None else diagonal - low, -1 if high is None else high - diagonal)
    return Pair(rows, n_keys, None if window == (-1, -1) else window)


def zigzag(total: int, size: int) -> list[list[Span]]:
    """Each rank's two chunks of `total` positions cut in 2 * size near-equal chunks: rank r gets
    chunks r and 2 * size - 1 - r (empty chunks left out)."""
    cuts = [total * c // (2 * size) for c in range(2 * size + 1)]
    chunks = [Span(cuts[c], cuts[c + 1] - cuts[c]) for c in range(2 * size)]
    return [[chunk for chunk in (chunks[r], chunks[2 * size - 1 - r]) if chunk.length] for r in range(size)]


def blocks(causal: str, shards: list[Span]) -> list[list[Span]]:
    """The positions (queries, or keys) each rank computes with: under causal (either alignment)
    the zig-zag chunks, which with zig-zag queries and keys give every rank the same work at
    every step of the ring; otherwise its own shard (every query's work is alike)."""
    if causal == "none":
        return [[shard] if shard.length else [] for shard in shards]
    return zigzag(sum(shard.length for shard in shards), len(shards))


def allowed(rule: Band, queries: Span, keys: Span) -> int:
    """How many (query, key) pairs of queries x keys the band allows: the work of their call."""
    rows = np.arange(queries.start, queries.end, dtype=np.int64)
    low = np.full_like(rows, keys.start) if rule[0] is None else np.maximum(rows + rule[0], keys.start)
    high = np.full_like(rows, keys.end - 1) if rule[1] is None else np.minimum(rows + rule[1], keys.end - 1)
    return int(np.maximum(high - low + 1, 0).sum())
