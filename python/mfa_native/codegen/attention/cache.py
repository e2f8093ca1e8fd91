"""A KV cache (flash-attn's flash_attn_with_kvcache): the key-visit facet's per-batch-length
case, contiguous or paged.

Batch b's queries attend the cache's first kv_end = cache_seqlens[b] + Rn keys (Rn rows
appended by this call, already written), so its `Bounds` are [0, R) and [0, kv_end): causal
(the last query on the last attended key) and window hold per batch, and no key at or past
kv_end is ever loaded, so cache rows past the attended length (even NaN) change nothing.

Contiguous: k is the (B, Cmax, Hkv, D) cache itself. Paged: k is the pages (num_blocks,
page_size, Hkv, D) as one run of rows shared by every batch (batch stride 0), and a key's
logical position p of batch b is row p % page_size of page block_table[b, p / page_size]
(`Positions.pages`); only the pages holding attended keys are read. Inference only: the
forward kernel, or for long caches and few (batch, kv head) threadgroups the split-KV pair:
the splits cut the logical positions [0, capacity) (`split_length`: Cmax, or Wt pages), each
split walks its share of [0, kv_end), and attention_combine merges them with the sinks.

With Rn > 0 the pass first runs the append kernels (append.py): k_new and v_new, (B, Rn, Hkv,
D) contiguous, written into k and v (plain or quantized) in place, so k and v are "inout".
The append is one dispatch before every split (the core's barrier orders the attention
kernel's reads after it), so each split reads appended rows from the cache like any other:
one copy of the key walk, and a quantized cache's splits read exactly the stored integers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel.passes import contiguous
from ..kernel.sizes import Extent
from ..kernel.tiles import Positions
from .append import NEW, generate_append
from .masking import Bounds
from .rotary import TABLES, Rotary, generate_rotate
from .visits import KEY_VISITS, Kernels, KeyVisit, KeyWalk, Steps

CATALOG = {
    "cache_seqlens": ("int", "(B,) valid cache length of each batch before this call's Rn appended rows"),
    "block_table": ("int", "(B, Wt) the pages of each batch's cache, in logical order"),
    "rotary_seqlens": ("int", "(B,) each batch's first rotary position, in place of cache_seqlens"),
}
CACHE_BOUNDS = Bounds("0", "R", "0", "kv_end")


@KEY_VISITS.register
@dataclass(frozen=True)
class CacheKeys(KeyVisit):
    """The problem side: `appended` rows (Rn) written by this call; paged with `page_size`
    rows per page (any, 1 included), `pages_per_batch` (block_table's width) and the pages'
    starts `page_rows` rows apart (None: page_size, pages following each other), else
    contiguous; `rotary`: q and the appended rows rotated first (rotary.py), or None."""

    appended: int
    page_size: int | None = None
    pages_per_batch: int | None = None
    page_rows: int | None = None
    rotary: Rotary | None = None
    rotary_positions: int = 0

    size_docs = {"Rn": "rows appended to the KV cache by this call", "Wt": "pages per batch (block_table's width)",
                 "Lro": "positions of the rotary tables (seqlen_ro)"}

    def __post_init__(self) -> None:
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.page_rows is not None and (self.page_size is None or self.page_rows < self.page_size):
            raise ValueError(f"pages {self.page_rows} rows apart cannot hold {self.page_size} rows each")
        if self.rotary is not None and not self.appended:
            raise ValueError("the rotary embedding applies to appended rows: a rotated call appends")

    @property
    def split_length(self) -> str:
        """The logical key positions split-KV cuts: the cache's capacity per batch."""
        return "C" if self.page_size is None else f"Wt * {self.page_size}"

    def sizes(self, p) -> dict[str, int]:
        return {"Rn": self.appended, **({"Wt": self.pages_per_batch} if self.page_size is not None else {}),
                **({"Lro": self.rotary_positions} if self.rotary else {})}

    def describe(self, p, family: str, baked) -> CacheFacts:
        return CacheFacts(self.page_size, (p.dtype, p.head_dim, p.value_dim) if self.appended else None,
                          self.page_rows or self.page_size, self.rotary)


@dataclass(frozen=True)
class CacheFacts(KeyWalk):
    """The kernel side: the page size (None: contiguous), with an append the new rows' (dtype,
    D, Dv), the rows from one page's start to the next's, and the rotation; lengths are
    runtime values."""

    page_size: int | None
    new_rows: tuple[str, int, int] | None = None
    page_rows: int | None = None
    rotary: Rotary | None = None

    bounds = CACHE_BOUNDS
    catalog = CATALOG
    queries_end_the_sequence = True

    @property
    def key_lists(self) -> tuple[str, ...]:
        return ("cache_seqlens",) + (("block_table",) if self.page_size else ())

    @property
    def sizes_given(self) -> tuple[str, ...]:
        return ("Rn",) + (("Wt",) if self.page_size else ()) + (("Lro",) if self.rotary else ())

    @property
    def rebinds(self) -> dict[str, str]:
        return self.rotary.rebinds() if self.rotary else {}

    def prologue(self) -> list[str]:
        lines = ["", "// The keys batch b attends: its cache before this call and the Rn rows appended to it.",
                 "const uint kv_end = min(uint(cache_seqlens[b]) + Rn, C);"]
        if self.page_size:
            lines.append("device const int* pages = block_table + ulong(b) * Wt;  // batch b's pages, in order")
        return lines

    def positions(self, end: str) -> Positions:
        if not self.page_size:
            return Positions(end)
        return Positions(end, pages="pages", page_size=self.page_size, page_rows=self.page_rows)

    def inputs(self, spec) -> dict:
        B = Extent(1, ("B",))
        inputs = {"cache_seqlens": spec("int32", (B,), (Extent(1),), logical=False)}
        if self.page_size:
            shape = (B, Extent(1, ("Wt",)))
            inputs["block_table"] = spec("int32", shape, contiguous(shape), logical=False)
        if self.new_rows:
            dtype, *widths = self.new_rows
            for name, width in zip("kv", widths):
                shape = (B, Extent(1, ("Rn",)), Extent(1, ("Hkv",)), Extent(width))
                inputs[NEW.format(name)] = spec(dtype, shape, contiguous(shape), logical=False)
        if self.rotary:
            dtype, width = self.new_rows[0], self.rotary.dim // 2
            shape = (Extent(1, ("Lro",)), Extent(width))
            inputs.update({table: spec(dtype, shape, contiguous(shape), logical=False) for table in TABLES})
            if self.rotary.starts != "cache_seqlens":
                inputs[self.rotary.starts] = spec("int32", (B,), (Extent(1),), logical=False)
        return inputs

    def backward_inputs(self, spec) -> dict:
        raise ValueError("a KV cache has no backward pass")

    def queries(self, d, steps: Steps) -> list[str]:
        raise ValueError("a KV cache has no backward pass")

    def present(self, name: str) -> bool:
        return name in self.key_lists

    def summary(self) -> str:
        if not self.page_size:
            return "; KV cache, contiguous"
        apart = f", {self.page_rows} rows apart" if self.page_rows != self.page_size else ""
        return f"; KV cache, paged ({self.page_size} rows a page{apart})"

    def forward_kernels(self, d, dense: Kernels) -> tuple:
        """The rotation kernels (with a rotary embedding), the append kernels (with new rows),
        then the attention kernel reading what they wrote."""
        rotations = tuple(generate_rotate(d, name, self.rotary) for name in "qk") if self.rotary else ()
        appends = tuple(generate_append(d, name) for name in "kv") if self.new_rows else ()
        return rotations + appends + dense()

    def backward_kernels(self, d, dense: Kernels) -> tuple:
        raise ValueError("a KV cache has no backward pass")
