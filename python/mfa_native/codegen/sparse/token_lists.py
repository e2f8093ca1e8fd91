"""Token lists (DeepSeek sparse attention): the key-visit facet's sparse-indexed case.

Each query row attends the keys its list names: `indices` (B, Hkv|1, R, topk) int32 and,
optionally, `topk_length` (B, R). Its rows facet is `TOKEN_ROWS`: a threadgroup holds one
query row of every query head that reads one kv head (heads as tile rows), staging the
listed K/V rows once for all of them. Its kernels are its own (token_forward.py,
token_backward.py); the online softmax, masking constants and finish are the dense
family's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..attention.visits import KEY_VISITS, Kernels, KeyVisit, KeyWalk, Steps
from ..attention.stage_sizes import stage_rows, staged_width
from ..kernel.products import SIMDGROUP_MATRIX
from ..kernel.layouts import OperandLayout, operand_layout, runtime_layout, stride_names
from ..kernel.tables import tile_row
from ..kernel.sizes import Extent
from . import token_backward, token_dkdv, token_forward

# The lists' buffers and what the backward pass keeps per slot: name -> (element, what it holds).
CATALOG = {
    "indices": ("int", "(B, Hkv|1, R, topk) the keys each query row attends; entries < 0 or >= C skipped"),
    "topk_length": ("int", "(B, R) how many entries of each list to read"),
    "p_slots": ("float", "(B, Hq, R, T) P of every listed slot, for the key side"),
    "ds_slots": ("float", "(B, Hq, R, T) dS of every listed slot, for the key side"),
    "key_counts": ("int", "(B, Hkv, C) how many (query, slot) entries list each key"),
    "key_starts": ("int", "(B, Hkv, C) where each key's entries start in key_entries"),
    "key_entries": ("int", "(B, Hkv, R * T) query * T + slot of every listing, by key"),
}
# With runtime strides (a bundle's templates), the lists' strides in elements: the slot axis is unit.
INDEX_STRIDES = stride_names("indices")                          # logical (batch, kv head, query)
LENGTH_STRIDES = stride_names("topk_length", ("batch", "row"))   # (batch, query)


class TokenRows:
    """A threadgroup's rows: the query heads of one kv head, at one query row."""

    packed = True

    @staticmethod
    def products(p, family: str) -> str:
        """Simdgroup matrices: the token-list kernels have no tensor-op products."""
        return SIMDGROUP_MATRIX

    @staticmethod
    def query_rows(p, family: str) -> int:
        return 8 * -(-p.gqa_ratio // 8)

    @staticmethod
    def key_block(p, family: str) -> int:
        """Listed rows staged per step: K's and V's, or K's alone when V is a view of K."""
        return stage_rows(p, staged_width(p, family, p.keys.shared_kv),
                          tile_row(family, p.dtype, max(p.head_dim, p.value_dim)).key_block)

    @staticmethod
    def backward_query_rows(p, family: str) -> int:
        return 8 * -(-p.gqa_ratio // 8)

    @staticmethod
    def guards(p, family: str) -> tuple[str, ...]:
        return ()

    @staticmethod
    def backward_guards(p, family: str) -> tuple[str, ...]:
        """The dK/dV kernel is one simdgroup per key: no tile depends on a length."""
        return ()


TOKEN_ROWS = TokenRows()


@KEY_VISITS.register
@dataclass(frozen=True)
class TokenLists(KeyVisit):
    """Sparse-indexed attention's per-query key lists: `indices` (B, Hkv|1, R, topk) int32 in
    logical order with these element strides (the slot axis contiguous; a kv-head stride of 0
    shares one list among the kv heads), and optionally `topk_length` (B, R) int32 with its
    strides."""

    topk: int
    index_strides: tuple[int, int, int, int]
    length_strides: tuple[int, int] | None = None
    shared_kv: bool = False   # v is k's first Dv features (MLA's latent): one staged row serves both

    split_length = None   # no split-KV: one threadgroup walks a row's list
    uniform_walk = False   # its own kernels, which always stage (tile_row stage_kv does not apply)
    size_docs = {"T": "entries per token list (topk)",
                 **{name: f"indices' {name.split('_')[1]} stride (elements)" for name in INDEX_STRIDES},
                 **{name: f"topk_length's {name.split('_')[2]} stride (elements)" for name in LENGTH_STRIDES}}

    def sizes(self, p) -> dict[str, int]:
        """T, and with runtime strides (p.runtime_strides) the lists' strides."""
        sizes = {"T": self.topk}
        if p.runtime_strides:
            sizes.update(zip(INDEX_STRIDES, self.index_strides[:3]))
            if self.length_strides is not None:
                sizes.update(zip(LENGTH_STRIDES, self.length_strides))
        return sizes

    def rows(self, p) -> TokenRows:
        return TOKEN_ROWS

    def describe(self, p, family: str, baked) -> TokenFacts:
        B, Hkv, R, T = (Extent(1, (name,)) for name in ("B", "Hkv", "R", "T"))
        shape = (p.batch, p.kv_heads, p.q_len, self.topk)
        if p.runtime_strides:   # read from the runtime sizes; the slot axis unit
            lengths = None if self.length_strides is None else runtime_layout(LENGTH_STRIDES, baked)
            return TokenFacts(runtime_layout(INDEX_STRIDES, baked), lengths, self.shared_kv,
                              TOKEN_ROWS.key_block(p, family))
        indices = operand_layout(shape, (B, Hkv, R, T), self.index_strides, (0, 1, 2, 3), baked)
        lengths = None
        if self.length_strides is not None:
            one = Extent(1)
            lengths = operand_layout((p.batch, p.q_len, 1, 1), (B, R, one, one), (*self.length_strides, 1, 1),
                                     (0, 1, 2, 3), baked)
        return TokenFacts(indices, lengths, self.shared_kv, TOKEN_ROWS.key_block(p, family))


@dataclass(frozen=True)
class TokenFacts(KeyWalk):
    """What sparse-indexed kernels depend on: the layouts of the token lists (the list width
    is the runtime size T). Rows of a tile are the query heads of one kv head at one query."""

    indices: OperandLayout          # logical (batch, kv head, query, slot)
    lengths: OperandLayout | None   # topk_length, logical (batch, query, -, -)
    shared_kv: bool                 # v is a view of k's first Dv features
    stage_rows: int                 # listed K/V rows staged in threadgroup memory per step

    catalog = CATALOG
    key_lists = ("indices", "topk_length")
    sizes_given = ("T", *INDEX_STRIDES, *LENGTH_STRIDES)   # the strides: with runtime strides only

    def inputs(self, spec) -> dict:
        """The lists, laid out as the kernels were compiled for."""
        B, Hkv, R, T = (Extent(1, (name,)) for name in ("B", "Hkv", "R", "T"))
        inputs = {"indices": spec("int32", (B, Hkv, R, T), self.indices.strides)}
        if self.lengths is not None:
            inputs["topk_length"] = spec("int32", (B, R), self.lengths.strides[:2], logical=False)
        return inputs

    def present(self, name: str) -> bool:
        return name != "topk_length" or self.lengths is not None

    def extents(self, d) -> dict[str, Extent]:
        """The backward's slots and the lists by key."""
        extents = {"p_slots": Extent(1, ("B", "Hq", "R", "T")), "ds_slots": Extent(1, ("B", "Hq", "R", "T")),
                   "key_entries": Extent(1, ("B", "Hkv", "R", "T"))}
        extents["key_counts"] = extents["key_starts"] = Extent(1, ("B", "Hkv", "C"))
        return extents

    def summary(self) -> str:
        return f"; token lists{' with topk_length' if self.lengths else ''}"

    def keys(self, d, steps: Steps) -> list[str]:
        raise ValueError("token lists are walked by the sparse-indexed kernels, not the dense ones")

    queries = keys

    def forward_kernels(self, d, dense: Kernels) -> tuple:
        return (token_forward.generate_sparse(d),)

    def backward_kernels(self, d, dense: Kernels) -> tuple:
        return (token_backward.generate_transpose(d), token_backward.generate_dq(d), token_dkdv.generate_dkdv(d))
