"""Block lists (FlexAttention's BlockMask): the key-visit facet's block-sparse case.

A query block visits the key blocks its lists name: partial blocks apply the masking rules
(and, with mask bits, each pair's bit: FlexAttention's mask_mod, evaluated once on the host)
and are clipped to the dense visible range; full blocks apply only the additive mask (a
score modification) and the bounds. A block listed twice is visited twice. Blocks have any
positive size: a simdgroup whose 8 rows a block boundary cuts walks each of their blocks'
lists in turn (block_walks.py), so its loop trips stay uniform across the simdgroup. Each
visited range goes through the kernel's own `steps(rules, begin, end)`, as a dense range does.

Per key block the transposed lists (its query blocks) that the dK/dV kernel walks are
built by `attention_transpose_lists` in the same pass (counts, starts and entries, in
query-block order; block_transpose.py). Lists the caller gives (q_indices, padded like
kv_indices) are only checked against them (`attention_verify_lists`, output q_lists_differ),
so the gradients never depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from ..attention.keys import storage_rows
from ..attention.visits import KEY_VISITS, Kernels, KeyVisit, KeyWalk, Steps
from ..attention.masking import MaskRules
from ..kernel.msl import indent
from ..kernel.passes import contiguous
from ..kernel.sizes import Extent
from .block_transpose import (BIT_LISTS, BUILT_BITS, BUILT_QUERY_LISTS, DIFFER, GIVEN_QUERY_LISTS, generate_transpose,
                              generate_verify)
from .block_walks import key_walk, query_walk

# The lists a kernel walking keys reads (a kernel walking queries reads BUILT_QUERY_LISTS).
KEY_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")

# Block-sparse lists, (B|1, H|1, blocks[, width]) int32: name -> (element, what it holds).
CATALOG = {
    "kv_num_blocks": ("int", "partial key blocks per query block"),
    "kv_indices": ("int", "the partial key blocks of each query block, counted part first"),
    "full_kv_num_blocks": ("int", "full key blocks per query block"),
    "full_kv_indices": ("int", "the full key blocks of each query block"),
    "q_num_blocks": ("int", "partial query blocks per key block"),
    "q_indices": ("int", "the partial query blocks of each key block"),
    "full_q_num_blocks": ("int", "full query blocks per key block"),
    "full_q_indices": ("int", "the full query blocks of each key block"),
    "q_counts": ("int", "partial query blocks per key block, built from the kv lists"),
    "q_starts": ("int", "where each key block's partial query blocks start in q_entries"),
    "q_entries": ("int", "the partial query blocks of every key block, in key-block order"),
    "full_q_counts": ("int", "full query blocks per key block, built from the kv lists"),
    "full_q_starts": ("int", "where each key block's full query blocks start in full_q_entries"),
    "full_q_entries": ("int", "the full query blocks of every key block, in key-block order"),
    "kv_bit_blocks": ("int", "the number of the first mask-bit block of each query block's partial list"),
    "kv_bits": ("int", "mask bits of the partial blocks: block p's pair (r, c) is bit p * Qb * Kb + r * Kb + c"),
    BUILT_BITS: ("int", "the mask-bit block of each entry of q_entries"),
    DIFFER: ("int", "per key block: bit 1 its given q list is not the transpose, bit 2 its full_q list"),
    "block_class": ("int", "(B, H, NQ, NK) 0: no pair allowed, 1: some, 2: all (BlockMask.from_mask)"),
}


@KEY_VISITS.register
@dataclass(frozen=True)
class BlockLists(KeyVisit):
    """Block-sparse attention's lists (the tensors of FlexAttention's BlockMask), as far as a
    kernel depends on them. The lists are (B|1, H|1, blocks[, width]) int32, C-contiguous;
    `widths` are the last-axis lengths of kv_indices, full_kv_indices, q_indices and
    full_q_indices, None where that list is absent (a backward pass builds the transposed
    lists on the device from the kv lists, and checks the given ones against them)."""

    q_block: int
    k_block: int
    batch_broadcast: bool   # the lists' batch axis has size 1
    head_broadcast: bool    # their head axis has size 1 (else it is Hq)
    width: int
    full_width: int | None = None
    q_width: int | None = None
    full_q_width: int | None = None
    bit_words: int | None = None   # mask bits of the partial blocks: the words of kv_bits (None: no bits)

    split_length = None   # no split-KV: the lists decide each row's keys
    uniform_walk = False   # a threadgroup's simdgroups may read different lists (no staging)
    size_docs = {"NQ": "query blocks", "NK": "key blocks", "Wp": "width of kv_indices",
                 "Wf": "width of full_kv_indices", "Wq": "width of q_indices", "Wqf": "width of full_q_indices",
                 "Wb": "int32 words of kv_bits (block-sparse mask bits)"}

    def __post_init__(self) -> None:
        for name in ("q_block", "k_block"):
            size = getattr(self, name)
            if size < 1:
                raise ValueError(f"block sizes must be positive, got {name}={size}")

    @property
    def full(self) -> bool:
        return self.full_width is not None

    @property
    def transposed_given(self) -> bool:
        return self.q_width is not None

    def sizes(self, p) -> dict[str, int]:
        sizes = dict(NQ=-(-p.q_len // self.q_block), NK=-(-p.kv_len // self.k_block), Wp=self.width)
        for name, width in (("Wf", self.full_width), ("Wq", self.q_width), ("Wqf", self.full_q_width),
                            ("Wb", self.bit_words)):
            if width is not None:
                sizes[name] = width
        return sizes

    def forward_only(self) -> BlockLists:
        """The forward walks the kv lists only."""
        return replace(self, q_width=None, full_q_width=None)

    def rows(self, p):
        return storage_rows(p)

    def describe(self, p, family: str, baked) -> BlockFacts:
        return BlockFacts(self.q_block, self.k_block, self.batch_broadcast, self.head_broadcast, self.full,
                          self.transposed_given, self.bit_words is not None)


@dataclass(frozen=True)
class BlockFacts(KeyWalk):
    """What block-sparse kernels depend on: the block sizes, which list axes broadcast, which
    lists there are (the widths are runtime sizes Wp, Wf, Wq, Wqf)."""

    q_block: int
    k_block: int
    batch_broadcast: bool
    head_broadcast: bool
    full: bool               # full_kv lists (and, in the backward, full_q lists)
    transposed_given: bool   # backward: q lists given (checked against those built on the device)
    bits: bool = False       # partial blocks read mask bits (kv_bit_blocks, kv_bits)

    catalog = CATALOG

    @property
    def key_lists(self) -> tuple[str, ...]:
        return KEY_LISTS + (BIT_LISTS if self.bits else ())

    @property
    def query_lists(self) -> tuple[str, ...]:
        return BUILT_QUERY_LISTS + ((BUILT_BITS, "kv_bits") if self.bits else ())

    @property
    def sizes_given(self) -> tuple[str, ...]:
        """The given runtime sizes (besides B, Hq, Hkv, R, C): the lists' widths."""
        return ("Wp",) + (("Wf",) if self.full else ()) + \
            ((("Wq",) + (("Wqf",) if self.full else ())) if self.transposed_given else ()) + \
            (("Wb",) if self.bits else ())

    @property
    def derived(self) -> tuple[tuple[str, str], ...]:
        return (("NQ", f"cdiv(R, {self.q_block})"), ("NK", f"cdiv(C, {self.k_block})"))

    def _axes(self, blocks: str) -> tuple[Extent, ...]:
        """(B|1, H|1, blocks): the shape of a count list."""
        return (Extent(1) if self.batch_broadcast else Extent(1, ("B",)),
                Extent(1) if self.head_broadcast else Extent(1, ("Hq",)), Extent(1, (blocks,)))

    def _lists(self, prefix: str, blocks: str, width: str, spec) -> dict:
        """A (num_blocks, indices) pair: int32, C-contiguous, (B|1, H|1, blocks[, width])."""
        num = self._axes(blocks)
        indices = (*num, Extent(1, (width,)))
        return {f"{prefix}_num_blocks": spec("int32", num, contiguous(num), logical=False),
                f"{prefix}_indices": spec("int32", indices, contiguous(indices), logical=False)}

    def inputs(self, spec) -> dict:
        inputs = self._lists("kv", "NQ", "Wp", spec)
        if self.full:
            inputs.update(self._lists("full_kv", "NQ", "Wf", spec))
        if self.bits:
            starts, words = self._axes("NQ"), (Extent(1, ("Wb",)),)
            inputs["kv_bit_blocks"] = spec("int32", starts, contiguous(starts), logical=False)
            inputs["kv_bits"] = spec("int32", words, contiguous(words), logical=False)
        return inputs

    def backward_inputs(self, spec) -> dict:
        inputs = self.inputs(spec)
        if self.transposed_given:
            inputs.update(self._lists("q", "NK", "Wq", spec))
            if self.full:
                inputs.update(self._lists("full_q", "NK", "Wqf", spec))
        return inputs

    def backward_outputs(self, spec) -> dict:
        """With given q lists, which of them differ from the transpose, per (B|1, H|1, key block)."""
        if not self.transposed_given:
            return {}
        axes = self._axes("NK")
        return {DIFFER: spec("int32", axes, contiguous(axes), logical=False)}

    @property
    def heads(self) -> str:
        """The lists' head extent as an MSL expression."""
        return "1" if self.head_broadcast else "Hq"

    def present(self, name: str) -> bool:
        if name == "block_class":
            return True
        if name.startswith("full_") and not self.full:
            return False
        if name in GIVEN_QUERY_LISTS or name == DIFFER:
            return self.transposed_given
        if name in BIT_LISTS or name == BUILT_BITS:
            return self.bits
        return name in KEY_LISTS or name in BUILT_QUERY_LISTS

    def extents(self, d) -> dict[str, Extent]:
        """Block classes, and the transposed lists built on the device: per (batch|1, head|1)."""
        extents = {"block_class": Extent(1, ("B", "Hq", "NQ", "NK"))}
        lists = self.pairs()
        for prefix, width in (("q", "Wp"), ("full_q", "Wf")):
            extents[f"{prefix}_counts"] = extents[f"{prefix}_starts"] = lists.times(Extent(1, ("NK",)))
            extents[f"{prefix}_entries"] = lists.times(Extent(1, ("NQ", width)))
        extents[BUILT_BITS] = extents["q_entries"]
        extents["kv_bits"] = Extent(1, ("Wb",))
        extents["kv_bit_blocks"] = lists.times(Extent(1, ("NQ",)))
        return extents

    def pairs(self) -> Extent:
        """The list pairs, (B|1) * (Hq|1)."""
        return Extent(1, (() if self.batch_broadcast else ("B",)) + (() if self.head_broadcast else ("Hq",)))

    def summary(self) -> str:
        lists = "partial and full lists" if self.full else "partial lists"
        return f"; block-sparse {self.q_block}x{self.k_block}, {lists}" + (", mask bits" if self.bits else "")

    def backward_kernels(self, d, dense: Kernels) -> tuple:
        return (generate_transpose(d),) + ((generate_verify(d),) if self.transposed_given else ()) + dense()

    def keys(self, d, steps: Steps) -> list[str]:
        """The key blocks listed for a forward or dQ simdgroup's query rows (q_first..)."""
        return key_walk(self, d, steps)

    def queries(self, d, steps: Steps) -> list[str]:
        """The query blocks listed for a dK/dV simdgroup's keys (key_first..), head h."""
        return query_walk(self, d, steps)
