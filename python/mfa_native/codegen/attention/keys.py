"""Which keys a query tile visits: the key-visit facet.

`DENSE` is the dense family's case: every key of the visible range [key_begin, key_end)
that causal and window leave (and, in the dK/dV kernel, every query of [query_begin,
query_end)). The list-driven cases (block lists, token lists) live in the sparse wing and
answer the same questions:

- problem side: the runtime sizes it adds with their values (`sizes`), what the forward pass
  needs of it (`forward_only`), how its rows map to tiles (`rows`), and its kernel-side facts
  (`describe`);
- kernel side: the sizes a caller gives and those it derives (`sizes_given`, `derived`),
  the pass inputs it declares (`inputs`, `backward_inputs`) and the backward's outputs it
  adds (`backward_outputs`: the block lists' check of given q lists), the ranges a forward or dQ
  simdgroup visits (`keys`) and a dK/dV simdgroup (`queries`), the buffers it adds
  (`catalog`, `extents`, `present`, and the names the key and query walks read), a clause
  for a kernel's header (`summary`), and which kernels run its forward and backward passes
  (`forward_kernels`, `backward_kernels`: the dense ones, given as a callable, unless the
  case has its own); and where a simdgroup's rows lie (`DenseWalk`: the `bounds` of its
  sequences, the MSL that finds its first row, `first`, and the grid axis, `grid`), which the
  varlen case (sequences.py) answers per packed sequence.
"""

from __future__ import annotations

from typing import Callable

from ..kernel.plan import GridAxis
from ..kernel.sizes import Extent
from ..kernel.tiles import Positions
from .masking import DENSE_BOUNDS, MaskRules
from .rows import PACKED_HEADS, PER_HEAD, dense_rows

Steps = Callable[[MaskRules, str, str], list[str]]


def storage_rows(p):
    """The rows facet of a problem whose keys form a range: heads packed when K/V storage asks."""
    return PACKED_HEADS if p.k_storage.packs_heads or p.v_storage.packs_heads else PER_HEAD


class DenseWalk:
    """Where the rows of a dense kernel's simdgroups lie: threadgroup x holds `rows`
    consecutive rows of the whole sequence (queries: [0, R), keys: [0, C))."""

    bounds = DENSE_BOUNDS

    @staticmethod
    def prologue() -> list[str]:
        """MSL a forward kernel runs after its geometry (b defined): names its bounds and key
        positions read (a KV cache's attended length, its page table)."""
        return []

    @staticmethod
    def positions(end: str) -> Positions:
        """Where the keys [.., end) of a step are loaded from: contiguous rows."""
        return Positions(end)

    @staticmethod
    def first(side: str, rows: int) -> tuple[list[str], str]:
        """MSL lines a simdgroup runs to find its 8 rows of `side` ("queries" or "keys") when a
        threadgroup holds `rows` of them, and its first row's expression. Reads group, simd_index."""
        return [], f"group.x * {rows} + simd_index * 8"

    @staticmethod
    def grid(side: str, rows: int) -> GridAxis:
        """The grid's x axis for threadgroups of `rows` rows of `side`."""
        return GridAxis(Extent(1, ("R" if side == "queries" else "C",)), rows)

    # The walk over one key range per row, its queries over one range per key, no extra
    # buffers, the dense kernels: what every range-shaped case shares.
    def keys(self, d, steps: Steps) -> list[str]:
        return steps(d.rules, "key_begin", "key_end")

    def queries(self, d, steps: Steps) -> list[str]:
        return steps(d.rules, "query_begin", "query_end")

    def extents(self, d) -> dict:
        return {}

    def forward_kernels(self, d, dense: Callable[[], tuple]) -> tuple:
        return dense()

    def backward_kernels(self, d, dense: Callable[[], tuple]) -> tuple:
        return dense()


class DenseKeys(DenseWalk):
    """Every key of the visible range."""

    split_length = "C"     # split-KV may cut the keys [0, C) for decode (None: a case that never splits)
    batched = True         # q, k, v and the outputs have a batch axis (varlen's packed sequences have none)
    uniform_walk = True    # a per-head threadgroup's simdgroups walk the same blocks (they may stage them)
    key_lists: tuple[str, ...] = ()
    query_lists: tuple[str, ...] = ()
    catalog: dict[str, tuple[str, str]] = {}

    # Problem side.
    def sizes(self, p) -> dict[str, int]:
        return {}

    def forward_only(self) -> DenseKeys:
        return self

    def rows(self, p):
        """Per head, or packed heads for quantized K/V and GQA decode (rows.dense_rows)."""
        return dense_rows(p)

    def describe(self, p, family: str, baked) -> DenseKeys:
        return self

    # Kernel side.
    sizes_given: tuple[str, ...] = ()
    derived: tuple[tuple[str, str], ...] = ()

    def inputs(self, spec) -> dict:
        return {}

    def backward_inputs(self, spec) -> dict:
        return {}

    def backward_outputs(self, spec) -> dict:
        return {}

    def present(self, name: str) -> bool:
        return False

    def summary(self) -> str:
        return ""



DENSE = DenseKeys()
