"""Packed sequences (varlen): the key-visit facet's per-sequence case, with its own rows.

q (total_q, Hq, D), k (total_k, Hkv, D) and v hold B sequences packed along their rows
(flash-attn's varlen layout): sequence s is q's rows [cu_seqlens_q[s], cu_seqlens_q[s + 1])
attending k's and v's rows [cu_seqlens_k[s], cu_seqlens_k[s + 1]). The problem is one
"bshd" batch of R = total_q queries and C = total_k keys without its batch axis (`batched`
is False: q, o and lse (Hq, R) are bound as given). Positions stay global; each simdgroup's
8 rows lie in one sequence, whose ranges are its `Bounds`: the visible range (causal and
window per sequence, `diagonal` its own), the allowed test and the stores read them, so the
dense kernels run unchanged.

Work is issued per sequence. A host-built table (`unit_table`) lists every sequence's 8-row
units as (sequence, first row), one simdgroup each: `q_units` for the forward and dQ kernels,
`k_units` for the dK/dV kernel; entries past the last unit are (-1, 0) and their simdgroups
return at once (these kernels have no barriers). NQU = cdiv(R, 8) + Ncu bounds
sum_s cdiv(len_s, 8) for any lengths, so the grid depends on shapes alone and one template
serves every call of them, while the issued work is the sum of per-sequence work, never
B * max_seqlen^2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...runtime.expressions import evaluate
from ..kernel.passes import contiguous
from ..kernel.plan import GridAxis
from ..kernel.sizes import Extent
from .keys import DenseWalk
from .masking import Bounds
from .rows import PerHead, query_rows_geometry

# The sequences' buffers: name -> (element, what it holds).
CATALOG = {
    "cu_seqlens_q": ("int", "(B + 1,) where each sequence's queries start, then total_q"),
    "cu_seqlens_k": ("int", "(B + 1,) where each sequence's keys start, then total_k"),
    "q_units": ("int", "(NQU, 2) (sequence, first query) of every 8-query unit; (-1, 0) past the last"),
    "k_units": ("int", "(NKU, 2) (sequence, first key) of every 8-key unit; (-1, 0) past the last"),
}
# Units per side: the table, its length (a runtime size) and that length's expression.
UNITS = {"queries": ("q_units", "NQU", "cdiv(R, 8) + Ncu"), "keys": ("k_units", "NKU", "cdiv(C, 8) + Ncu")}
SEQUENCE_BOUNDS = Bounds("q_start", "q_end", "k_start", "k_end", origin="origin")


def unit_table(cu_seqlens: np.ndarray, entries: int) -> np.ndarray:
    """The (entries, 2) int32 table of a side's 8-row units: (sequence, first row) for each
    unit of each sequence in order, then (-1, 0). `cu_seqlens` is checked (non-decreasing)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    counts = -(-np.diff(cu) // 8)
    total = int(counts.sum())
    sequence = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    table = np.zeros((entries, 2), np.int32)
    table[:, 0] = -1
    table[:total, 0] = sequence
    table[:total, 1] = cu[sequence] + 8 * within
    return table


def _located(side: str, rows: int) -> tuple[list[str], str]:
    """SequenceWalk.first: the unit's lookup and its sequence's ranges, and its first row."""
    table, count, _ = UNITS[side]
    simdgroups = rows // 8
    lines = [f"// This simdgroup's 8 {side}: a unit of {table}, (sequence, first row); none past the last.",
             f"const uint unit = group.x * {simdgroups} + simd_index;",
             f"const int sequence = unit < {count} ? {table}[2 * unit] : -1;",
             "if (sequence < 0) {",
             "  return;  // these kernels have no barriers: the other simdgroups go on",
             "}"]
    for name, cu in (("q", "cu_seqlens_q"), ("k", "cu_seqlens_k")):
        lines += [f"const uint {name}_start = uint({cu}[sequence]);  // the sequence's rows of {name}",
                  f"const uint {name}_end = uint({cu}[sequence + 1]);"]
    lines.append("const int origin = int(k_start) - int(q_start);  // upper-left causal: query i sees keys to i + origin")
    return lines, f"uint({table}[2 * unit + 1])"


class SequenceWalk(DenseWalk):
    """The kernel side: what the dense kernels read of packed sequences (no fields: the
    lengths are runtime sizes and table contents)."""

    bounds = SEQUENCE_BOUNDS
    catalog = CATALOG
    key_lists = ("cu_seqlens_q", "cu_seqlens_k", "q_units")     # read by kernels walking keys (forward, dQ)
    query_lists = ("cu_seqlens_q", "cu_seqlens_k", "k_units")   # and by the dK/dV kernel
    sizes_given = ("Ncu",)
    derived = tuple((count, expression) for _, count, expression in UNITS.values())

    @staticmethod
    def first(side: str, rows: int) -> tuple[list[str], str]:
        return _located(side, rows)

    @staticmethod
    def grid(side: str, rows: int) -> GridAxis:
        """One simdgroup per unit: cdiv(units, simdgroups per threadgroup) threadgroups."""
        return GridAxis(Extent(1, (UNITS[side][1],)), rows // 8)

    def inputs(self, spec) -> dict:
        return self._inputs(spec, ("queries",))

    def backward_inputs(self, spec) -> dict:
        return self._inputs(spec, ("queries", "keys"))

    @staticmethod
    def _inputs(spec, sides) -> dict:
        n = Extent(1, ("Ncu",))
        inputs = {cu: spec("int32", (n,), (Extent(1),), logical=False) for cu in ("cu_seqlens_q", "cu_seqlens_k")}
        for side in sides:
            table, count, _ = UNITS[side]
            shape = (Extent(1, (count,)), Extent(2))
            inputs[table] = spec("int32", shape, contiguous(shape), logical=False)
        return inputs

    def backward_outputs(self, spec) -> dict:
        return {}

    def present(self, name: str) -> bool:
        return name in CATALOG

    def summary(self) -> str:
        return "; packed sequences (varlen), one simdgroup per 8-row unit of a sequence"


SEQUENCE_WALK = SequenceWalk()


class SequenceRows(PerHead):
    """The rows facet of packed sequences: a threadgroup's simdgroups each take one unit of
    q_units (of any sequence), of one query head."""

    @staticmethod
    def threadgroups_expression(p, family: str) -> str:
        return f"Hq * cdiv(NQU, {PerHead.query_rows(p, family) // 8})"

    @staticmethod
    def grid(gqa_ratio: int, query_rows: int) -> tuple[GridAxis, GridAxis]:
        return SequenceWalk.grid("queries", query_rows), GridAxis(Extent(1, ("Hq",)))

    @staticmethod
    def geometry(query_rows: int, gqa_ratio: int, batch: list[str]) -> list[str]:
        located, first = _located("queries", query_rows)
        return query_rows_geometry(query_rows, gqa_ratio, batch + located, first)


SEQUENCE_ROWS = SequenceRows()


@dataclass(frozen=True)
class SequenceRanges:
    """The problem side: `sequences` packed sequences (cu_seqlens have one entry more)."""

    sequences: int

    split_length = None   # no split-KV: a decode batch is many sequences, each a unit of work
    batched = False    # q, k, v, the outputs and lse have no batch axis

    def sizes(self, p) -> dict[str, int]:
        sizes = {"R": p.q_len, "C": p.kv_len, "Ncu": self.sequences + 1}
        return {"Ncu": sizes["Ncu"], **{count: evaluate(expression, sizes) for _, count, expression in UNITS.values()}}

    def forward_only(self) -> SequenceRanges:
        return self

    def rows(self, p) -> SequenceRows:
        return SEQUENCE_ROWS

    def describe(self, p, family: str, baked) -> SequenceWalk:
        return SEQUENCE_WALK
