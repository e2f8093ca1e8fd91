"""Packed sequences over paged K/V (attention_varlen with a block table): the sequences case
whose keys are read through each sequence's pages, as a paged KV cache's are (cache.py).

The queries stay packed (total_q, Hq, D), one sequence's rows per unit as in sequences.py.
k and v are the pages (num_blocks, page_size, Hkv, D) as one run of rows (page i's first is
row i * page_rows), and sequence s's logical key position p is row p % page_size of page
block_table[s, p / page_size] (`Positions.pages`). Its keys are the logical positions
[0, seqused_k[s]) (`KEY_RANGES["paged"]`; the host gives seqused_k from flash-attn's
cu_seqlens_k, flash-attn 3's seqused_k or the table's width), so causal and the window line
its last query up with its last used key, and only the pages holding used keys are read.
Forward only: flash-attn's paged varlen has no backward, and neither has this case.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel.sizes import Extent
from ..kernel.tiles import Positions
from .sequences import CATALOG, SequenceRanges, SequenceWalk
from .visits import KEY_VISITS

PAGED_CATALOG = {**CATALOG, "block_table": ("int", "(Ns, Wt) the pages of each sequence's keys, in logical order")}
NO_BACKWARD = "paged K/V (a block table) is forward-only: it has no backward pass"


@dataclass(frozen=True)
class PagedSequenceWalk(SequenceWalk):
    """The kernel side: packed sequences whose keys are read through `page_size`-row pages
    starting `page_rows` rows apart."""

    page_size: int = 1
    page_rows: int = 1

    catalog = PAGED_CATALOG
    sizes_given = ("Ncu", "Wt")

    def prologue(self) -> list[str]:
        return ["device const int* pages = block_table + ulong(sequence) * Wt;  // the sequence's pages, in order"]

    def positions(self, end: str) -> Positions:
        return Positions(end, pages="pages", page_size=self.page_size, page_rows=self.page_rows)

    def shapes(self) -> dict[str, tuple[Extent, ...]]:
        return {"block_table": (Extent(1, ("Ns",)), Extent(1, ("Wt",)))}

    def backward_inputs(self, spec) -> dict:
        raise ValueError(NO_BACKWARD)

    def first(self, side: str, rows: int) -> tuple[list[str], str]:
        raise ValueError(NO_BACKWARD)

    def summary(self) -> str:
        apart = f", {self.page_rows} rows apart" if self.page_rows != self.page_size else ""
        return f"; packed sequences (varlen) over paged K/V ({self.page_size} rows a page{apart})"


@KEY_VISITS.register
@dataclass(frozen=True)
class PagedSequences(SequenceRanges):
    """The problem side: packed sequences whose keys lie in pages of `page_size` rows (any, 1
    included), `pages_per_sequence` of them listed per sequence (block_table's width), their
    starts `page_rows` rows apart (None: page_size, pages following each other)."""

    page_size: int = 1
    pages_per_sequence: int = 1
    page_rows: int | None = None

    size_docs = {**SequenceRanges.size_docs, "Wt": "pages per sequence (block_table's width)"}

    def __post_init__(self) -> None:
        if self.page_size < 1 or (self.page_rows is not None and self.page_rows < self.page_size):
            raise ValueError(f"pages of {self.page_size} rows cannot start {self.page_rows} rows apart")

    @property
    def key_range(self) -> str:
        return "paged"

    def sizes(self, p) -> dict[str, int]:
        return {**super().sizes(p), "Wt": self.pages_per_sequence}

    def describe(self, p, family: str, baked) -> PagedSequenceWalk:
        return PagedSequenceWalk(self.query_unit(p), self.key_range, self.page_size, self.page_rows or self.page_size)
