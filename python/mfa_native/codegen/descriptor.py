"""Kernel descriptors: exactly the facts the generated source depends on.

`describe(problem)` reduces an AttentionProblem to a KernelDescriptor (the
forward kernels), `describe_backward` an AttentionBackwardProblem to a
BackwardDescriptor (the backward kernels). Both extend AttentionFacts, the
facts every attention kernel depends on. A descriptor is the cache key of its
source, so two problems that differ only in runtime values (sequence lengths,
batch and head counts) share one kernel.

Strides become `Extent`s. A stride that equals the dense stride of its operand
(the product of the inner axes' sizes) is kept symbolic, e.g. `R * 64`, so a
contiguous tensor of another length reuses the kernel; any other stride is a
literal. With `bake_lengths`, the sizes themselves are literals too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .problem import AttentionBackwardProblem, AttentionProblem, QuantizedStorage, contiguous_strides, memory_order
from .quant_format import QuantFormat
from .sizes import Extent, RuntimeSizes
from .tables import CPU_FAMILY, MAX_HEAD_DIM, backward_tile_row, tile_row

# The runtime sizes, by their names in the generated MSL; split-KV kernels add
# S (key/value splits) and Cs (keys per split).
SIZE_DOCS = {"B": "batch", "Hq": "query heads", "Hkv": "key/value heads", "R": "query length",
             "C": "key length", "S": "key/value splits", "Cs": "keys per split",
             "NQ": "query blocks", "NK": "key blocks", "Wp": "width of kv_indices",
             "Wf": "width of full_kv_indices", "Wq": "width of q_indices", "Wqf": "width of full_q_indices",
             "T": "entries per token list (topk)"}
SIZE_NAMES = ("B", "Hq", "Hkv", "R", "C")
SPLIT_SIZE_NAMES = ("S", "Cs")
SIZES_STRUCT = "AttentionSizes"


@dataclass(frozen=True)
class OperandLayout:
    """Strides (as Extents) of one tensor operand, in logical axis order."""

    strides: tuple[Extent, Extent, Extent, Extent]


@dataclass(frozen=True)
class MaskRules:
    """The facts that decide which keys a query may see, as the kernels bake them."""

    causal: str
    window: tuple[int, int] | None
    mask: str
    mask_dtype: str | None
    mask_layout: OperandLayout | None

    @property
    def window_sides(self) -> tuple[int | None, int | None]:
        """The bounded sides of the window, (left, right), None where unbounded."""
        if self.window is None:
            return None, None
        return tuple(None if side == -1 else side for side in self.window)  # type: ignore[return-value]

    @property
    def uses_diagonal(self) -> bool:
        return self.causal == "lower_right" or self.window_sides != (None, None)

    @property
    def limits_keys_above(self) -> bool:
        """Whether some rule removes keys after a query's diagonal."""
        return self.causal != "none" or self.window_sides[1] is not None


@dataclass(frozen=True)
class BlockFacts:
    """What block-sparse kernels depend on: the block sizes, which list axes broadcast, which
    lists there are (the widths are runtime sizes Wp, Wf, Wq, Wqf)."""

    q_block: int
    k_block: int
    batch_broadcast: bool
    head_broadcast: bool
    full: bool               # full_kv lists (and, in the backward, full_q lists)
    transposed_given: bool   # backward: q lists given (else built on the device)

    @property
    def heads(self) -> str:
        """The lists' head extent as an MSL expression."""
        return "1" if self.head_broadcast else "Hq"


@dataclass(frozen=True)
class TokenFacts:
    """What sparse-indexed kernels depend on: the layouts of the token lists (the list width
    is the runtime size T). Rows of a tile are the query heads of one kv head at one query."""

    indices: OperandLayout          # logical (batch, kv head, query, slot)
    lengths: OperandLayout | None   # topk_length, logical (batch, query, -, -)
    shared_kv: bool                 # v is a view of k's first Dv features
    stage_rows: int                 # listed K/V rows staged in threadgroup memory per step


@dataclass(frozen=True)
class QuantFacts:
    """What kernels reading a quantized k or v depend on: its format, the dtype of its affine
    scales and biases, and the layouts of its fields (logical (batch, kv head, key, -) order,
    in elements of each field)."""

    format: QuantFormat
    scale_dtype: str | None
    data: OperandLayout
    scales: OperandLayout | None
    biases: OperandLayout | None


@dataclass(frozen=True)
class AttentionFacts:
    """What every attention kernel depends on: head dimensions, dtype, GQA ratio, the
    q/k/v layouts, the masking rules, sinks, the scale and the tile table's family."""

    head_dim: int
    value_dim: int
    dtype: str
    gqa_ratio: int
    q: OperandLayout
    k: OperandLayout
    v: OperandLayout
    rules: MaskRules
    sinks: bool
    scale_log2e: float      # softmax scale * log2(e), as the float32 the kernels use
    family: str
    sizes: RuntimeSizes     # the runtime sizes the kernels read (or their literals)
    blocks: BlockFacts | None  # block-sparse: only listed key blocks are visited


@dataclass(frozen=True)
class KernelDescriptor(AttentionFacts):
    """The forward kernels: attention_forward, or the split-KV pair (partial and combine)."""

    o: OperandLayout
    return_lse: bool
    query_rows: int         # per threadgroup
    key_block: int
    cache_q: bool
    tokens: TokenFacts | None = None   # sparse-indexed: rows are heads, keys come from lists
    packed_heads: bool = False         # rows are (query, head) pairs of one kv head; K/V staged
    k_quant: QuantFacts | None = None  # k read quantized, dequantized into the stage
    v_quant: QuantFacts | None = None

    @property
    def simdgroups(self) -> int:
        return self.query_rows // 8


@dataclass(frozen=True)
class BackwardDescriptor(AttentionFacts):
    """The backward kernels (see attention_backward.py)."""

    o: OperandLayout        # the forward output, an input here
    dout: OperandLayout     # its gradient, dO
    dq: OperandLayout       # the gradients, allocated contiguous in the problem's layout
    dk: OperandLayout
    dv: OperandLayout
    scale: float            # softmax scale, as the float32 the kernels use (dQ and dK carry it)
    query_rows: int         # dQ kernel: query rows per threadgroup
    key_block: int          # dQ kernel: keys per step
    key_rows: int           # dK/dV kernel: keys per threadgroup
    query_block: int        # dK/dV kernel: queries per step
    cache: bool             # each simdgroup's own rows stay in registers
    tokens: TokenFacts | None = None   # sparse-indexed: rows are heads, keys come from lists


def _operand_layout(shape, sizes, strides, order, baked: dict[str, int] | None) -> OperandLayout:
    """Symbolic strides: dense ones as products of the inner sizes, others as literals.

    `shape` are the actual sizes, `sizes` their Extents (runtime names or literals),
    `strides` the actual strides, all in logical order; `order` lists the logical
    axes from outermost to innermost in memory.
    """
    result: list[Extent] = [Extent(0)] * 4
    dense = Extent(1)
    for axis in reversed(order):
        stride = strides[axis]
        if shape[axis] == 1 or (stride != 0 and stride == dense.value(_actual_sizes(shape, sizes))):
            result[axis] = dense        # dense (or irrelevant: a single index)
        else:
            result[axis] = Extent(stride)
        if stride != 0 or shape[axis] == 1:
            dense = sizes[axis].times(result[axis])
    if baked is not None:
        result = [e.bake(baked) for e in result]
    return OperandLayout(tuple(result))  # type: ignore[arg-type]


def _actual_sizes(shape, sizes) -> dict[str, int]:
    """Runtime size names -> values, read off an operand's shape and its size Extents."""
    return {e.sizes[0]: n for n, e in zip(shape, sizes) if e.sizes}


def _shrunk(rows: int, length: int) -> int:
    """`rows` per threadgroup, halved (down to 8) while half of them still cover `length`."""
    while rows > 8 and rows // 2 >= length:
        rows //= 2
    return rows


PACKED_ROWS = 128   # (query, head) pairs per packed-heads threadgroup: every head of a kv head, up to MQA's 128


def query_rows(problem: AttentionProblem, family: str) -> int:
    """Rows per threadgroup. A row is a query of one head: the table's count, or fewer when
    the queries cannot fill it (decode). With packed heads a row is a (query, head) pair of one
    kv head: all of them up to PACKED_ROWS, so decode reads each K/V byte once per kv head."""
    p = problem
    if p.packs_heads:
        return min(8 * -(-p.q_len * p.gqa_ratio // 8), PACKED_ROWS)
    return _shrunk(tile_row(family, max(p.head_dim, p.value_dim)).query_rows, p.q_len)


def forward_threadgroups(problem: AttentionProblem, family: str) -> int:
    """Threadgroups of the one-pass forward kernel (before any split of the keys)."""
    p = problem
    heads, rows = (p.kv_heads, p.q_len * p.gqa_ratio) if p.packs_heads else (p.q_heads, p.q_len)
    return p.batch * heads * -(-rows // query_rows(p, family))


def forward_key_block(problem: AttentionProblem, family: str) -> int:
    """Keys per step of the forward kernels: the table's, or the staged rows (packed heads)."""
    p = problem
    if p.packs_heads:
        return stage_rows(p, family, p.head_dim + p.value_dim)
    return tile_row(family, max(p.head_dim, p.value_dim)).key_block


def sizes_of(problem: AttentionProblem, split: tuple[int, int] | None = None) -> dict[str, int]:
    """Runtime size name -> value, in struct order; with a split, also S (splits) and Cs (keys per split)."""
    sizes = dict(zip(SIZE_NAMES, (problem.batch, problem.q_heads, problem.kv_heads, problem.q_len, problem.kv_len)))
    if split is not None:
        sizes.update(zip(SPLIT_SIZE_NAMES, split))
    if problem.tokens is not None:
        sizes["T"] = problem.tokens.topk
    lists = problem.blocks
    if lists is not None:
        sizes.update(NQ=-(-problem.q_len // lists.q_block), NK=-(-problem.kv_len // lists.k_block), Wp=lists.width)
        for name, width in (("Wf", lists.full_width), ("Wq", lists.q_width), ("Wqf", lists.full_q_width)):
            if width is not None:
                sizes[name] = width
    return sizes


def _check_head_dims(p: AttentionProblem) -> None:
    if not 1 <= max(p.head_dim, p.value_dim) <= MAX_HEAD_DIM or min(p.head_dim, p.value_dim) < 1:
        raise ValueError(f"head dimensions must be in 1..{MAX_HEAD_DIM}, got D={p.head_dim}, Dv={p.value_dim}")


class _Layouts:
    """The symbolic layouts of a problem's tensors (`of`) and its mask rules."""

    def __init__(self, p: AttentionProblem, baked: dict[str, int] | None) -> None:
        D, Dv = Extent(p.head_dim), Extent(p.value_dim)
        B, Hq, Hkv, R, C = (Extent(1, (name,)) for name in SIZE_NAMES)
        self._p, self._baked, self._order = p, baked, memory_order(p.layout)
        self._kinds = {"q": (p.q_shape, (B, Hq, R, D)), "k": (p.k_shape, (B, Hkv, C, D)),
                       "v": (p.v_shape, (B, Hkv, C, Dv)), "o": (p.o_shape, (B, Hq, R, Dv))}
        mask_layout = None
        if p.mask != "none":
            mask_layout = _operand_layout(p.mask_shape, (B, Hq, R, C), p.mask_strides, (0, 1, 2, 3), baked)
        self.rules = MaskRules(p.causal, p.window, p.mask, p.mask_dtype, mask_layout)

    def quantized(self, storage: QuantizedStorage | None, width: int) -> QuantFacts | None:
        """The layouts of a quantized k or v of `width` features, None when it is not quantized."""
        if storage is None:
            return None
        f, p = storage.format, self._p
        B, Hkv, C = (Extent(1, (name,)) for name in ("B", "Hkv", "C"))

        def field(columns: int, strides) -> OperandLayout:
            shape = (p.batch, p.kv_heads, p.kv_len, columns)
            return _operand_layout(shape, (B, Hkv, C, Extent(columns)), strides, self._order, self._baked)

        scales = biases = None
        if f.affine:
            scales, biases = (field(f.groups(width), storage.scale_strides),
                              field(f.groups(width), storage.bias_strides))
        return QuantFacts(f, storage.scale_dtype, field(f.data_width(width), storage.data_strides), scales, biases)

    def of(self, kind: str, strides=None) -> OperandLayout:
        """The layout of a tensor shaped like q, k, v or o ("kind"); strides None: contiguous (allocated)."""
        shape, sizes = self._kinds[kind]
        strides = contiguous_strides(self._p.layout, shape) if strides is None else strides
        return _operand_layout(shape, sizes, strides, self._order, self._baked)


def _facts(p: AttentionProblem, family: str, sizes: dict[str, int], bake_lengths: bool) -> tuple[dict, _Layouts]:
    """The AttentionFacts fields of `p`, and the layouts helper for the rest."""
    _check_head_dims(p)
    layouts = _Layouts(p, sizes if bake_lengths else None)
    facts = dict(head_dim=p.head_dim, value_dim=p.value_dim, dtype=p.dtype, gqa_ratio=p.gqa_ratio,
                 q=layouts.of("q", p.q_strides), k=layouts.of("k", p.k_strides), v=layouts.of("v", p.v_strides),
                 rules=layouts.rules, sinks=p.sinks,
                 scale_log2e=float(np.float32(p.softmax_scale * np.log2(np.e))), family=family,
                 sizes=RuntimeSizes(SIZES_STRUCT, tuple((name, SIZE_DOCS[name]) for name in sizes),
                                    tuple(sizes.items()) if bake_lengths else None),
                 blocks=_block_facts(p.blocks))
    return facts, layouts


def _block_facts(lists) -> BlockFacts | None:
    if lists is None:
        return None
    return BlockFacts(lists.q_block, lists.k_block, lists.batch_broadcast, lists.head_broadcast, lists.full,
                      lists.transposed_given)


def describe(problem: AttentionProblem, *, family: str = CPU_FAMILY, bake_lengths: bool = False,
             split: tuple[int, int] | None = None) -> KernelDescriptor:
    """The descriptor of the forward kernels of `problem`, tiles from `family`'s table;
    `split` = (splits, keys per split) adds the split sizes S and Cs (the split-KV pair)."""
    p = problem
    facts, layouts = _facts(p, family, sizes_of(p, split), bake_lengths)
    row = tile_row(family, max(p.head_dim, p.value_dim))
    if p.tokens is None:
        rows, key_block = query_rows(p, family), forward_key_block(p, family)
    else:  # sparse: a row per head
        rows, key_block = 8 * -(-p.gqa_ratio // 8), _token_stage_rows(p, family)
    return KernelDescriptor(**facts, o=layouts.of("o"), return_lse=p.return_lse,  # o is allocated contiguous
                            query_rows=rows, key_block=key_block, cache_q=row.cache_q,
                            tokens=_token_facts(p, bake_lengths, family), packed_heads=p.packs_heads,
                            k_quant=layouts.quantized(p.k_quant, p.head_dim),
                            v_quant=layouts.quantized(p.v_quant, p.value_dim))


def _token_facts(p: AttentionProblem, bake_lengths: bool, family: str) -> TokenFacts | None:
    if p.tokens is None:
        return None
    B, Hkv, R, T = (Extent(1, (name,)) for name in ("B", "Hkv", "R", "T"))
    baked = sizes_of(p) if bake_lengths else None
    shape = (p.batch, p.kv_heads, p.q_len, p.tokens.topk)
    indices = _operand_layout(shape, (B, Hkv, R, T), p.tokens.index_strides, (0, 1, 2, 3), baked)
    lengths = None
    if p.tokens.length_strides is not None:
        one = Extent(1)
        lengths = _operand_layout((p.batch, p.q_len, 1, 1), (B, R, one, one), (*p.tokens.length_strides, 1, 1),
                                  (0, 1, 2, 3), baked)
    return TokenFacts(indices, lengths, p.tokens.shared_kv, _token_stage_rows(p, family))


STAGE_BYTES = 24 * 1024   # threadgroup memory for staged K/V rows, under the 32 KiB every Apple GPU has


def stage_rows(p: AttentionProblem, family: str, width: int) -> int:
    """Rows staged per step: the table's key block, fewer when rows of `width` features (K's and
    V's together) would not fit STAGE_BYTES; a multiple of 8."""
    item = {"float32": 4, "float16": 2, "bfloat16": 2}[p.dtype]
    fits = STAGE_BYTES // (width * item) // 8 * 8
    return max(8, min(tile_row(family, max(p.head_dim, p.value_dim)).key_block, fits))


def _token_stage_rows(p: AttentionProblem, family: str) -> int:
    """Listed rows staged per step: K's and V's, or K's alone when V is a view of K."""
    return stage_rows(p, family, p.head_dim + (0 if p.tokens.shared_kv else p.value_dim))


def describe_backward(problem: AttentionBackwardProblem, *, family: str = CPU_FAMILY,
                      bake_lengths: bool = False) -> BackwardDescriptor:
    """The descriptor of the backward kernels of `problem`, tiles from `family`'s backward table."""
    p = problem.forward
    facts, layouts = _facts(p, family, sizes_of(p), bake_lengths)
    row = backward_tile_row(family, max(p.head_dim, p.value_dim))
    return BackwardDescriptor(
        **facts,
        o=layouts.of("o", problem.o_strides),
        dout=layouts.of("o", problem.dout_strides),
        dq=layouts.of("q"),
        dk=layouts.of("k"),
        dv=layouts.of("v"),
        scale=float(np.float32(p.softmax_scale)),
        query_rows=_shrunk(row.query_rows, p.q_len) if p.tokens is None else 8 * -(-p.gqa_ratio // 8),
        key_block=row.key_block,
        key_rows=_shrunk(row.key_rows, p.kv_len),
        query_block=row.query_block,
        cache=row.cache,
        tokens=_token_facts(p, bake_lengths, family),
    )
