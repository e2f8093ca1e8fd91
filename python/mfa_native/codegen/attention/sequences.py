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

A sequence's keys (`KEY_RANGES`): its rows of k from cu_seqlens_k, all of them or its first
seqused_k (flash-attn 3's seqused_k); paged_sequences.py reads logical positions through pages.

Decode batches pack heads (`PackedSequenceRows`): with grouped queries and a per-sequence
query bound `max_queries` (max_seqlen_q, else total_q) whose (query, head) pairs fit the
PACKING table, a forward unit is `max_queries` queries of one sequence and one threadgroup
holds every head of a kv head for them, so each K/V row is read once per kv head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...runtime.expressions import evaluate
from ..kernel.passes import contiguous
from ..kernel.plan import GridAxis
from ..kernel.sizes import Extent
from .masking import Bounds
from ..kernel.packing import packs_plain_heads
from ..kernel.tiles import lane_layout
from .rows import PackedHeads, PerHead, query_rows_geometry
from .visits import KEY_VISITS, KeyVisit, KeyWalk

# The sequences' buffers: name -> (element, what it holds).
CATALOG = {
    "cu_seqlens_q": ("int", "(B + 1,) where each sequence's queries start, then total_q"),
    "cu_seqlens_k": ("int", "(B + 1,) where each sequence's keys start, then total_k"),
    "seqused_k": ("int", "(Ns,) the keys each sequence uses: its first rows of k, or its logical positions (paged)"),
    "q_units": ("int", "(NQU, 2) (sequence, first query) of every 8-query unit; (-1, 0) past the last"),
    "k_units": ("int", "(NKU, 2) (sequence, first key) of every 8-key unit; (-1, 0) past the last"),
}
# Units per side: the table, its length (a runtime size) and that length's expression, given
# the rows of a unit (8, or a packed forward's queries per sequence).
UNITS = {"queries": ("q_units", "NQU", "cdiv(R, {unit}) + Ncu"), "keys": ("k_units", "NKU", "cdiv(C, {unit}) + Ncu")}
SEQUENCE_BOUNDS = Bounds("q_start", "q_end", "k_start", "k_end", origin="origin")
# Where a sequence's keys lie: the MSL defining k_start and k_end, and the buffers it reads.
KEY_RANGES = {
    "packed": (["const uint k_start = uint(cu_seqlens_k[sequence]);  // the sequence's rows of k",
                "const uint k_end = uint(cu_seqlens_k[sequence + 1]);"], ("cu_seqlens_k",)),
    "used": (["const uint k_start = uint(cu_seqlens_k[sequence]);  // the first seqused_k of its rows of k",
              "const uint k_end = k_start + uint(seqused_k[sequence]);"], ("cu_seqlens_k", "seqused_k")),
    "paged": (["const uint k_start = 0;  // logical positions, read through the sequence's pages",
               "const uint k_end = uint(seqused_k[sequence]);"], ("seqused_k", "block_table")),
}


def unit_table(cu_seqlens: np.ndarray, entries: int, unit: int = 8) -> np.ndarray:
    """The (entries, 2) int32 table of a side's `unit`-row units: (sequence, first row) for each
    unit of each sequence in order, then (-1, 0). `cu_seqlens` is checked (non-decreasing)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    counts = -(-np.diff(cu) // unit)
    total = int(counts.sum())
    sequence = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    table = np.zeros((entries, 2), np.int32)
    table[:, 0] = -1
    table[:total, 0] = sequence
    table[:total, 1] = cu[sequence] + unit * within
    return table


def located(side: str, unit: str, holder: str = "simdgroup", keys: str = "packed") -> tuple[list[str], str]:
    """The lookup of unit `unit` (an MSL expression) of `side` and its sequence's ranges (its
    keys as `KEY_RANGES[keys]` finds them), and its first row. Past the last unit the `holder`
    returns: a simdgroup of kernels without barriers, or a whole threadgroup (packed heads), so
    every thread reaches the same barriers."""
    table, count, _ = UNITS[side]
    lines = [f"// This {holder}'s {side}: a unit of {table}, (sequence, first row); none past the last.",
             f"const uint unit = {unit};",
             f"const int sequence = unit < {count} ? {table}[2 * unit] : -1;",
             "if (sequence < 0) {",
             f"  return;  // {'these kernels have no barriers: the other simdgroups go on' if holder == 'simdgroup' else 'the whole threadgroup: no barrier waits for it'}",
             "}"]
    lines += ["const uint q_start = uint(cu_seqlens_q[sequence]);  // the sequence's rows of q",
              "const uint q_end = uint(cu_seqlens_q[sequence + 1]);", *KEY_RANGES[keys][0]]
    lines.append("const int origin = int(k_start) - int(q_start);  // upper-left causal: query i sees keys to i + origin")
    return lines, f"uint({table}[2 * unit + 1])"


def _located(side: str, rows: int, keys: str) -> tuple[list[str], str]:
    """SequenceWalk.first: one 8-row unit per simdgroup."""
    return located(side, f"group.x * {rows // 8} + simd_index", keys=keys)


def derived_units(query_unit: int) -> tuple[tuple[str, str], ...]:
    """NQU and NKU's expressions (forward units of `query_unit` queries, 8-key units), and Ns
    (the sequences: per-sequence buffers other than cu_seqlens are Ns long)."""
    units = {"queries": query_unit, "keys": 8}
    counts = tuple((count, expression.format(unit=units[side])) for side, (_, count, expression) in UNITS.items())
    return counts + (("Ns", "Ncu - 1"),)


@dataclass(frozen=True)
class SequenceWalk(KeyWalk):
    """The kernel side: what the dense kernels read of packed sequences: the queries of a
    forward unit (8, or a packed forward's per-sequence bound) and where the keys lie (a
    `KEY_RANGES` name); the lengths are runtime sizes and table contents."""

    query_unit: int = 8
    key_range: str = "packed"

    bounds = SEQUENCE_BOUNDS
    catalog = CATALOG
    sizes_given = ("Ncu",)
    batch_index = "uint(sequence)"
    batches = "Ns"

    @property
    def key_lists(self) -> tuple[str, ...]:
        """Read by kernels walking keys (forward, dQ)."""
        return ("cu_seqlens_q", *KEY_RANGES[self.key_range][1], "q_units")

    @property
    def query_lists(self) -> tuple[str, ...]:
        """Read by the dK/dV kernel."""
        return ("cu_seqlens_q", *KEY_RANGES[self.key_range][1], "k_units")

    @property
    def derived(self) -> tuple[tuple[str, str], ...]:
        return derived_units(self.query_unit)

    def first(self, side: str, rows: int) -> tuple[list[str], str]:
        return _located(side, rows, self.key_range)

    @staticmethod
    def grid(side: str, rows: int) -> GridAxis:
        """One simdgroup per unit: cdiv(units, simdgroups per threadgroup) threadgroups."""
        return GridAxis(Extent(1, (UNITS[side][1],)), rows // 8)

    def inputs(self, spec) -> dict:
        return self._inputs(spec, self.key_lists)

    def backward_inputs(self, spec) -> dict:
        return self._inputs(spec, self.key_lists + ("k_units",))

    def _inputs(self, spec, names) -> dict:
        shapes = {"cu_seqlens_q": (Extent(1, ("Ncu",)),), "cu_seqlens_k": (Extent(1, ("Ncu",)),),
                  "seqused_k": (Extent(1, ("Ns",)),), **self.shapes()}
        shapes.update({table: (Extent(1, (count,)), Extent(2)) for table, count, _ in UNITS.values()})
        return {name: spec("int32", shapes[name], contiguous(shapes[name]), logical=False) for name in names}

    def shapes(self) -> dict[str, tuple[Extent, ...]]:
        """The shapes of the buffers a variant adds (paged: block_table)."""
        return {}

    def summary(self) -> str:
        return "; packed sequences (varlen), one simdgroup per 8-row unit of a sequence"




class SequenceRows(PerHead):
    """The rows facet of packed sequences: a threadgroup's simdgroups each take one unit of
    q_units (of any sequence), of one query head; the sequences' keys as `KEY_RANGES[keys]`."""

    def __init__(self, keys: str) -> None:
        super().__init__()
        self.keys = keys

    @staticmethod
    def threadgroups_expression(p, family: str) -> str:
        return f"Hq * cdiv(NQU, {PerHead.query_rows(p, family) // 8})"

    @staticmethod
    def grid(gqa_ratio: int, query_rows: int) -> tuple[GridAxis, GridAxis]:
        return SequenceWalk.grid("queries", query_rows), GridAxis(Extent(1, ("Hq",)))

    def geometry(self, query_rows: int, gqa_ratio: int, batch: list[str]) -> list[str]:
        located, first = _located("queries", query_rows, self.keys)
        return query_rows_geometry(query_rows, gqa_ratio, batch + located, first)


SEQUENCE_ROWS = {keys: SequenceRows(keys) for keys in KEY_RANGES}   # one each: descriptors holding it compare equal


class PackedSequenceRows(PackedHeads):
    """Packed heads over packed sequences: threadgroup (x, y) takes unit x of q_units,
    `unit` queries of one sequence, as (query, head) pairs of kv head y; pairs past the unit's
    are dead (their row is the sequence's end: computed on a valid row, never stored)."""

    def __init__(self, unit: int, keys: str) -> None:
        super().__init__()
        self.unit, self.keys = unit, keys

    last_query = "int(q_last)"

    def query_rows(self, p, family: str) -> int:
        return 8 * -(-self.unit * p.gqa_ratio // 8)

    @staticmethod
    def threadgroups_expression(p, family: str) -> str:
        return "Hkv * NQU"

    def guards(self, p, family: str) -> tuple[str, ...]:
        return ()   # the unit is baked (its size expressions name it); lengths are table contents

    @staticmethod
    def grid(gqa_ratio: int, query_rows: int) -> tuple[GridAxis, GridAxis]:
        return GridAxis(Extent(1, ("NQU",)), 1), GridAxis(Extent(1, ("Hkv",)))

    def geometry(self, query_rows: int, gqa_ratio: int, batch: list[str]) -> list[str]:
        lines, first = located("queries", "group.x", "threadgroup", self.keys)
        pairs = self.unit * gqa_ratio
        return [f"// This simdgroup's 8 rows: (query, head) pairs of {self.unit} queries of one sequence and the "
                f"{gqa_ratio} query heads reading kv head h_kv.", *batch, *lines,
                "const uint h_kv = group.y;", *lane_layout(),
                f"const uint q_first = {first};",
                f"const uint q_last = min(q_first + {self.unit}, q_end) - 1;  // the unit's last query",
                "const uint pair = simd_index * 8 + tr;",
                f"const uint row = pair < {pairs} ? q_first + pair / {gqa_ratio} : q_end;  // the lane's query",
                f"const uint h = h_kv * {gqa_ratio} + pair % {gqa_ratio};  // and its head",
                "const uint row_read = min(row, R - 1);  // rows past the unit compute on a valid row, never stored"]


@KEY_VISITS.register
@dataclass(frozen=True)
class SequenceRanges(KeyVisit):
    """The problem side: `sequences` packed sequences (cu_seqlens have one entry more), with
    `used_keys` each one's first seqused_k rows of k; the forward packs heads when
    `max_queries` (a bound on every sequence's queries, None: no packing, as the backward) and
    the GQA ratio fit the PACKING table."""

    sequences: int
    max_queries: int | None = None
    used_keys: bool = False

    split_length = None   # no split-KV: a decode batch is many sequences, each a unit of work
    size_docs = {"Ncu": "entries of cu_seqlens (sequences + 1)", "Ns": "sequences",
                 "NQU": "8-query units of the packed sequences (a bound)",
                 "NKU": "8-key units of the packed sequences (a bound)"}
    batched = False    # q, k, v, the outputs and lse have no batch axis
    uniform_walk = False   # a threadgroup's simdgroups may hold units of different sequences

    @property
    def key_range(self) -> str:
        """Where a sequence's keys lie: a `KEY_RANGES` name."""
        return "used" if self.used_keys else "packed"

    def packs(self, p) -> bool:
        return self.max_queries is not None and packs_plain_heads(p.gqa_ratio, max(self.max_queries, 1))

    def query_unit(self, p) -> int:
        """The queries of a forward unit: the bound when heads are packed, else 8."""
        return max(self.max_queries, 1) if self.packs(p) else 8

    def sizes(self, p) -> dict[str, int]:
        sizes = {"R": p.q_len, "C": p.kv_len, "Ncu": self.sequences + 1}
        return {"Ncu": sizes["Ncu"], **{count: evaluate(expression, sizes)
                                        for count, expression in derived_units(self.query_unit(p))}}

    def rows(self, p):
        return PackedSequenceRows(self.query_unit(p), self.key_range) if self.packs(p) else SEQUENCE_ROWS[self.key_range]

    def describe(self, p, family: str, baked) -> SequenceWalk:
        return SequenceWalk(self.query_unit(p), self.key_range)
