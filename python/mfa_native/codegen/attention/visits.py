"""Which keys a query tile visits: the key-visit facet's two bases and its registry.

A case is a problem-side `KeyVisit` (in `AttentionProblem.keys`: its sizes' values, its rows,
whether split-KV may cut it) whose `describe` gives its kernel-side `KeyWalk` (in the
descriptor's `keys`: the ranges a simdgroup walks, its buffers, its pass inputs, its kernels).
Every member is declared here once, with its type and what it means; its default is the
dense case's behaviour (every key of the visible range, no buffers, the dense kernels) where
that is a natural default, and `describe` is abstract. A case overrides what differs.

A new case is one module (the two classes, or one class deriving from both when the kernel
side needs nothing of the problem's, as `keys.DENSE`) and one line registering it
(`@KEY_VISITS.register` on its problem-side class); its size names (`size_docs`) and buffers
(`catalog`) are its own, so no list elsewhere names them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from ..kernel.facets import Cases
from ..kernel.plan import GridAxis
from ..kernel.sizes import Extent
from ..kernel.tiles import Positions
from .masking import DENSE_BOUNDS, Bounds, MaskRules
from .rows import dense_rows

Steps = Callable[[MaskRules, str, str], list[str]]   # the kernel's tile loop over one range: steps(rules, begin, end)
Kernels = Callable[[], tuple]                         # the dense kernels of a pass, made on demand

KEY_VISITS = Cases("key-visit")
"""The registered key-visit cases (problem side), by name: `valid_for(...)["keys"]`."""


class KeyVisit(ABC):
    """The problem side of a key-visit case: what an `AttentionProblem` knows of it."""

    split_length: str | None = None
    """The logical key positions split-KV may cut, a size expression ("C" for dense keys, a
    KV cache's capacity), or None for a case that never splits (its lists decide each row's keys)."""

    batched: bool = True
    """Whether q, k, v, the outputs and lse have a batch axis (varlen's packed sequences have none)."""

    uniform_walk: bool = True
    """Whether a per-head threadgroup's simdgroups walk the same key blocks, so that they may
    stage them in threadgroup memory (the tables' stage_kv); False for per-simdgroup lists."""

    size_docs: dict[str, str] = {}
    """The runtime sizes the case adds (given and derived), name -> what it counts: the doc
    lines of the kernels' sizes struct."""

    def sizes(self, p) -> dict[str, int]:
        """The values of the runtime sizes it adds for problem `p` (the names of `size_docs`)."""
        return {}

    def forward_only(self) -> KeyVisit:
        """The case as the forward pass needs it (block lists drop their transposed lists)."""
        return self

    def rows(self, p):
        """The rows facet of problem `p` (rows.py): per head, or packed heads for quantized K/V
        and GQA decode (rows.dense_rows)."""
        return dense_rows(p)

    @abstractmethod
    def describe(self, p, family: str, baked) -> KeyWalk:
        """The kernel-side facts of problem `p` for tile family `family`; `baked`: the sizes
        baked as literals, or None."""


class KeyWalk:
    """The kernel side of a key-visit case: what the generators ask of a descriptor's `keys`."""

    # Sizes and buffers.
    sizes_given: tuple[str, ...] = ()
    """The runtime sizes a caller gives (besides B, Hq, Hkv, R, C): list widths, counts."""

    derived: tuple[tuple[str, str], ...] = ()
    """The sizes a template derives, in order: (name, size expression)."""

    catalog: dict[str, tuple[str, str]] = {}
    """Its buffers: name -> (MSL element type, what it holds)."""

    key_lists: tuple[str, ...] = ()
    """The buffers a kernel walking keys (forward, dQ) reads."""

    query_lists: tuple[str, ...] = ()
    """The buffers a kernel walking queries (dK/dV) reads."""

    batch_index: str = "b"
    """The MSL index of the batch a kernel's rows belong to (a per-batch table's row): b, or a
    packed sequence's index."""

    batches: str = "B"
    """The runtime size counting those batches (a per-batch table's rows)."""

    queries_end_the_sequence: bool = False
    """Whether a sequence's queries are its last positions (a KV cache's call: query r is at
    cache length - R + r), not its first; where a score_mod's q_idx counts from."""

    rebinds: dict[str, str] = {}
    """Pass inputs the caller's arrays bind under another name: buffer -> name. The case's own
    kernels read the array there and write the buffer, which the other kernels read as usual
    (a KV cache's rotary embedding: q -> q_unrotated)."""

    def present(self, name: str) -> bool:
        """Whether buffer `name` of `catalog` exists for this problem (optional lists)."""
        return True

    def extents(self, d) -> dict[str, Extent]:
        """The elements of its buffers that are intermediates of a pass (built on the device)."""
        return {}

    def inputs(self, spec) -> dict:
        """The forward pass's inputs it declares: name -> `spec(dtype, shape, strides, ...)`."""
        return {}

    def backward_inputs(self, spec) -> dict:
        """The backward pass's inputs it declares: by default, the forward's."""
        return self.inputs(spec)

    def backward_outputs(self, spec) -> dict:
        """The backward pass's outputs it adds (the block lists' check of given q lists)."""
        return {}

    # Where a simdgroup's rows lie.
    bounds: Bounds = DENSE_BOUNDS
    """The ranges of a simdgroup's sequences (masking.Bounds): [0, R) and [0, C), a KV cache's
    attended length, one packed sequence's rows."""

    def prologue(self) -> list[str]:
        """MSL a forward kernel runs after its geometry (b defined): names its bounds and key
        positions read (a KV cache's attended length, its page table)."""
        return []

    def positions(self, end: str) -> Positions:
        """Where the keys [.., end) of a step are loaded from: contiguous rows."""
        return Positions(end)

    def first(self, side: str, rows: int) -> tuple[list[str], str]:
        """MSL lines a simdgroup runs to find its 8 rows of `side` ("queries" or "keys") when a
        threadgroup holds `rows` of them, and its first row's expression. Reads group, simd_index."""
        return [], f"group.x * {rows} + simd_index * 8"

    def grid(self, side: str, rows: int) -> GridAxis:
        """The grid's x axis for threadgroups of `rows` rows of `side`."""
        return GridAxis(Extent(1, ("R" if side == "queries" else "C",)), rows)

    # The walks and the kernels.
    def keys(self, d, steps: Steps) -> list[str]:
        """The MSL walk of a forward or dQ simdgroup over its keys: `steps` over each range;
        by default the visible range [key_begin, key_end)."""
        return steps(d.rules, "key_begin", "key_end")

    def queries(self, d, steps: Steps) -> list[str]:
        """The MSL walk of a dK/dV simdgroup over its queries: [query_begin, query_end)."""
        return steps(d.rules, "query_begin", "query_end")

    def summary(self) -> str:
        """A clause for a kernel's header ("; block-sparse 16x16, ...")."""
        return ""

    def forward_kernels(self, d, dense: Kernels) -> tuple:
        """The forward pass's kernels: the dense ones (`dense()`), unless the case has its own."""
        return dense()

    def backward_kernels(self, d, dense: Kernels) -> tuple:
        """The backward pass's kernels: the dense dQ and dK/dV, unless the case has its own."""
        return dense()
