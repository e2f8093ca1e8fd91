"""Where each sequence of `attention_varlen` finds its keys, and the pages' layout.

Three ways, flash-attn's: rows [cu_seqlens_k[s], cu_seqlens_k[s + 1]) of packed k and v
(flash-attn 2); the first seqused_k[s] of those rows (flash-attn 3's seqused_k); or, with a
block table, logical positions [0, length) read through sequence s's pages (flash-attn's paged
varlen), the length being seqused_k[s] when given, else cu_seqlens_k[s + 1] - cu_seqlens_k[s]
(flash-attn 2, whose cu_seqlens_k then counts logical keys: it ends anywhere), else (no
cu_seqlens_k, as flash-attn 3 takes a page table) every listed page, max_blocks * page_size.
Each array's form and contents are its rule's (varlen_rules.py), those spanning several (a
sequence's used keys within its rows or its pages, the pages read) too; the pages' layout is
checked here.
"""

from __future__ import annotations

import numpy as np

from ..codegen import PagedSequences, SequenceRanges
from . import arguments as check
from .pages import as_rows, page_rows
from .warm import same_memory


def _pages(x, name: str) -> np.ndarray:
    x = check.as_array(x, name)
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions (num_blocks, page_size, Hkv, D) with block_table, "
                         f"got shape {x.shape}")
    return x


class SequenceKeys:
    """A call's keys: packed or paged k and v (the pages' layout), and where each sequence's
    keys lie. `width`, the block table's max_blocks, is set once its rule has checked it."""

    def __init__(self, k, v, cu_k, seqused_k, block_table, sequences: int) -> None:
        self.paged, self.used, self.sequences = block_table is not None, seqused_k is not None, sequences
        self.width = 0
        if self.paged:
            k, v = _pages(k, "k"), _pages(v, "v")
            if v.shape[:3] != k.shape[:3]:
                raise ValueError(f"v must have k's pages, page size and heads: k {k.shape}, v {v.shape}")
            self.blocks, self.page = k.shape[:2]
            if self.page == 0:
                raise ValueError(f"k's page_size (axis 1 of (num_blocks, page_size, Hkv, D)) must be at least 1, "
                                 f"got shape {k.shape}")
            self.page_rows, v_rows = page_rows(k, "k"), page_rows(v, "v")
            if v_rows != self.page_rows:
                raise ValueError(f"v's pages must be as many rows apart as k's ({self.page_rows}), got {v_rows}")
        elif cu_k is None:
            raise ValueError("cu_seqlens_k is required without block_table: it says where each sequence's keys lie "
                             "in k")

    def rows(self, x, name: str) -> np.ndarray:
        """k or v (`name`) as the kernels read it: (rows, Hkv, D), pages as every page's rows."""
        x = check.as_array(x, name)
        return as_rows(x, 1, self.page_rows)[0] if self.paged else x

    def visit(self, max_queries: int | None) -> SequenceRanges:
        """The problem's key-visit case."""
        if self.paged:
            return PagedSequences(self.sequences, max_queries, page_size=self.page, pages_per_sequence=self.width,
                                  page_rows=self.page_rows)
        return SequenceRanges(self.sequences, max_queries, used_keys=self.used)

    def bind(self, checked, given: dict, lengths: np.ndarray) -> None:
        """Binds the key side's buffers into `checked` (bound, converts, sources) from the call's
        arguments `given` (k, v, cu_seqlens_k, seqused_k, block_table): k and v as rows, and
        cu_seqlens_k, seqused_k and block_table as the kernels read them."""
        if self.paged:
            for name in "kv":
                checked.converts[name] = lambda x, name=name: check.bindable(self.rows(x, name))
            checked.bound["block_table"] = np.ascontiguousarray(check.as_array(given["block_table"], "block_table"))
            checked.converts["block_table"] = np.ascontiguousarray
            checked.bound["seqused_k"] = lengths
            if self.used:
                checked.converts["seqused_k"] = np.ascontiguousarray
            elif given["cu_seqlens_k"] is not None:
                checked.converts["seqused_k"] = lambda cu: np.diff(cu).astype(np.int32)
                checked.sources["seqused_k"] = "cu_seqlens_k"
            else:   # None is part of the signature: its warm calls bind the same whole-table lengths
                checked.converts["seqused_k"] = lambda _: lengths
            return
        cu = np.ascontiguousarray(check.as_array(given["cu_seqlens_k"], "cu_seqlens_k"))
        checked.bound["cu_seqlens_k"] = cu
        checked.converts["cu_seqlens_k"] = None if same_memory(given["cu_seqlens_k"], cu) else np.ascontiguousarray
        if self.used:
            used = check.as_array(given["seqused_k"], "seqused_k")
            checked.bound["seqused_k"] = np.ascontiguousarray(used)
            checked.converts["seqused_k"] = None if same_memory(given["seqused_k"], used) else np.ascontiguousarray
