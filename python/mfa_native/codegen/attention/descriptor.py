"""Kernel descriptors: exactly the facts the generated source depends on.

`describe(problem)` reduces an AttentionProblem to a KernelDescriptor (the
forward kernels), `describe_backward` an AttentionBackwardProblem to a
BackwardDescriptor (the backward kernels). Both extend AttentionFacts, the
facts every attention kernel depends on. A descriptor is the cache key of its
source, so two problems that differ only in runtime values (sequence lengths,
batch and head counts) share one kernel.

Strides become `OperandLayout`s (kernel/layouts.py): dense strides stay symbolic,
e.g. `R * 64`, so a contiguous tensor of another length reuses the kernel. With
`bake_lengths`, the sizes themselves are literals too. A problem's `runtime_window`,
`runtime_strides` and `runtime_scale` make the window's sides, the inputs' strides and the scale
runtime sizes as well (WINDOW_SIZE_NAMES, `stride_names`, SCALE_SIZE_NAMES: the float32 bits of the
scale and of scale * log2(e), read with as_type<float>). The facets of the problem (keys, storage,
rows, products) describe themselves: their kernel-side facts are fields here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel.layouts import (OperandLayout, contiguous_strides, memory_order, operand_layout, runtime_layout,
                              stride_names)
from ..kernel.products import SIMDGROUP_MATRIX
from ..kernel.sizes import Extent, RuntimeSizes
from ..kernel import tuned
from ..storage.facet import StorageFacts
from ..kernel.tables import CPU_FAMILY, MAX_HEAD_DIM, backward_tile_row, operand_tile_type, tile_row
from . import invariance
from .masking import MaskRules
from .pairs import vector_pairs
from .problem import AttentionBackwardProblem, AttentionProblem
from .visits import KeyWalk
from .rows import shrunk
from .stage_sizes import backward_blocks
from .scale import SCALE_SIZE_DOCS, SCALE_SIZE_NAMES, scale_sizes, scale_terms

# The runtime sizes, by their names in the generated MSL; split-KV kernels add
# S (key/value splits) and Cs (keys per split), the key-visit case its own (KeyVisit.size_docs).
SIZE_DOCS = {"B": "batch", "Hq": "query heads", "Hkv": "key/value heads", "R": "query length",
             "C": "key length", "S": "key/value splits", "Cs": "keys per split"}
WINDOW_SIZE_NAMES = ("window_left", "window_right")
MASK_AXES = ("batch", "head", "row", "key")
STRIDED_INPUTS = ("q", "k", "v", "o", "dout")   # o and dout: the backward's
SIZE_DOCS.update({"window_left": "window's left side (C when unbounded)",
                  "window_right": "window's right side (R when unbounded)"})
SIZE_DOCS.update({name: f"{name.split('_')[0]}'s {name.split('_')[1]} stride (elements)"
                  for operand in STRIDED_INPUTS for name in stride_names(operand)})
SIZE_DOCS.update({name: f"mask's {name.split('_')[1]} stride (elements)" for name in stride_names("mask", MASK_AXES)})
SIZE_DOCS.update(SCALE_SIZE_DOCS)
# The sizes a call's views and options give (rather than its lengths and counts).
VIEW_SIZE_NAMES = frozenset(name for name in SIZE_DOCS
                            if name.startswith("window_") or name.endswith("_stride") or name in SCALE_SIZE_NAMES)
SIZE_NAMES = ("B", "Hq", "Hkv", "R", "C")
SPLIT_SIZE_NAMES = ("S", "Cs")
SIZES_STRUCT = "AttentionSizes"


@dataclass(frozen=True)
class AttentionFacts:
    """What every attention kernel depends on: head dimensions, dtype, GQA ratio, the
    q/k/v layouts, the masking rules, sinks, the scale, the tile table's family, and the
    key-visit and storage facets' kernel-side facts."""

    head_dim: int
    value_dim: int
    dtype: str
    gqa_ratio: int
    q: OperandLayout
    k: OperandLayout
    v: OperandLayout
    rules: MaskRules
    sinks: bool
    scale_log2e: str        # MSL: softmax scale * log2(e), a float32 literal or read from the runtime sizes
    scores: tuple           # the score transforms (scores.py), in order
    family: str
    sizes: RuntimeSizes     # the runtime sizes the kernels read (or their literals)
    keys: KeyWalk           # the key-visit facet's kernel side (visits.py)
    k_storage: StorageFacts  # the storage facets' kernel sides of k and v (storage/facet.py)
    v_storage: StorageFacts

    @property
    def gpu_family(self) -> str:
        """The family without its device's table (tuned.parts): what a kernel's header names, so
        that a device's kernel and the plain family's, with the same tiles, are one text (one compile)."""
        return tuned.parts(self.family)[0]


@dataclass(frozen=True)
class KernelDescriptor(AttentionFacts):
    """The forward kernels: attention_forward, or the split-KV pair (partial and combine)."""

    o: OperandLayout
    return_lse: bool
    query_rows: int         # per threadgroup
    key_block: int
    cache_q: bool
    rows: object            # the rows facet (attention/rows.py)
    o_block: int = 0        # 0: O in registers; else paged, this many features at a time (tables.py)
    tile_type: str = "float"  # element type of the operand tiles Q, K (tables.py, tiles16)
    stage_kv: bool = False  # each step's K/V rows staged in threadgroup memory (packed heads; stage_kv)
    weight_tile_type: str = "float"  # of P and V in O += P V (tables.py, p16)
    vector_pairs: frozenset[str] = frozenset()  # operands whose row pairs are vector accesses (vector_access)
    split_keys: int = 0     # batch-invariant mode: keys per split, merged in order (invariance.py); 0: off
    products: str = SIMDGROUP_MATRIX  # how the products are computed (kernel/products.py; the rows facet's choice)

    @property
    def simdgroups(self) -> int:
        return self.query_rows // 8


@dataclass(frozen=True)
class BackwardDescriptor(AttentionFacts):
    """The backward kernels (see backward.py)."""

    o: OperandLayout        # the forward output, an input here
    dout: OperandLayout     # its gradient, dO
    dq: OperandLayout       # the gradients, allocated contiguous in the problem's layout
    dk: OperandLayout
    dv: OperandLayout
    scale: str              # MSL: the softmax scale (dQ and dK carry it), a float32 literal or a runtime size
    query_rows: int         # dQ kernel: query rows per threadgroup
    key_block: int          # dQ kernel: keys per step
    key_rows: int           # dK/dV kernel: keys per threadgroup
    query_block: int        # dK/dV kernel: queries per step
    cache_q: bool           # dQ kernel: each simdgroup's rows of Q stay in registers
    cache_dout: bool        # dQ kernel: its rows of dO, the same
    cache_k: bool           # dK/dV kernel: each simdgroup's rows of K stay in registers
    cache_v: bool           # dK/dV kernel: its rows of V, the same
    dq_block: int = 0       # 0: the accumulator in registers; else paged, this many features at a time
    dk_block: int = 0
    dv_block: int = 0
    tile_type: str = "float"  # element type of the operand tiles Q, K, V, dO (tables.py, tiles16)
    stage_kv: bool = False    # dQ kernel: each key block's K and V rows staged in threadgroup memory
    stage_q_dout: bool = False  # dK/dV kernel: each query block's Q and dO rows, the same
    weight_tile_type: str = "float"  # of P, dS and K, dO, Q in dQ += dS K, dV += P^T dO, dK += dS^T Q (p16)
    vector_pairs: frozenset[str] = frozenset()  # operands whose row pairs are vector accesses (vector_access)
    products: str = SIMDGROUP_MATRIX  # how the products are computed (kernel/products.py; stage_sizes.backward_blocks)


def sizes_of(problem: AttentionProblem, split: tuple[int, int] | None = None) -> dict[str, int]:
    """Runtime size name -> value, in struct order; with a split, also S (splits) and Cs (keys
    per split); then the key facet's sizes, the window's sides and the inputs' strides where
    the problem makes them runtime sizes."""
    p = problem
    sizes = dict(zip(SIZE_NAMES, (p.batch, p.q_heads, p.kv_heads, p.q_len, p.kv_len)))
    if split is not None:
        sizes.update(zip(SPLIT_SIZE_NAMES, split))
    sizes.update(p.keys.sizes(p))
    if p.runtime_window:
        sizes.update(zip(WINDOW_SIZE_NAMES, window_values(p)))
    if p.runtime_strides:
        for name, strides in (("q", p.q_strides), ("k", p.k_strides), ("v", p.v_strides)):
            sizes.update(zip(stride_names(name), strides[:3]))
        if p.mask != "none":
            sizes.update(zip(stride_names("mask", MASK_AXES), p.mask_strides))
    if p.runtime_scale:
        sizes.update(scale_sizes(p))
    return sizes


def backward_sizes(problem: AttentionBackwardProblem) -> dict[str, int]:
    """sizes_of the forward problem, and with runtime strides those of o and dout."""
    sizes = sizes_of(problem.forward)
    if problem.forward.runtime_strides:
        sizes.update(zip(stride_names("o"), problem.o_strides[:3]))
        sizes.update(zip(stride_names("dout"), problem.dout_strides[:3]))
    return sizes


def window_values(p: AttentionProblem) -> tuple[int, int]:
    """The runtime window sides of `p`: its own, an unbounded side (-1, or none) as C on the
    left and R on the right, which remove no key. The kernels compute positions up to R + C
    in 32-bit ints, so that must stay below 2**31 (ValueError naming R and C)."""
    if p.q_len + p.kv_len > 2**31 - 1:
        raise ValueError(f"R + C (query and key lengths, {p.q_len} + {p.kv_len}) must be below 2**31 for a "
                         "runtime window: its kernels compute positions up to R + C in 32-bit integers")
    left, right = p.window if p.window is not None else (-1, -1)
    return (p.kv_len if left == -1 else min(left, p.kv_len), p.q_len if right == -1 else min(right, p.q_len))


def _check_head_dims(p: AttentionProblem) -> None:
    if not 1 <= max(p.head_dim, p.value_dim) <= MAX_HEAD_DIM or min(p.head_dim, p.value_dim) < 1:
        raise ValueError(f"head dimensions must be in 1..{MAX_HEAD_DIM}, got D={p.head_dim}, Dv={p.value_dim}")


class _Layouts:
    """The symbolic layouts of a problem's tensors (`of`), of its stored k/v fields (`field`),
    and its mask rules."""

    def __init__(self, p: AttentionProblem, baked: dict[str, int] | None) -> None:
        D, Dv = Extent(p.head_dim), Extent(p.value_dim)
        B, Hq, Hkv, R, C = (Extent(1, (name,)) for name in SIZE_NAMES)
        self._p, self._baked, self._order = p, baked, memory_order(p.layout)
        self._kinds = {"q": (p.q_shape, (B, Hq, R, D)), "k": (p.k_shape, (B, Hkv, C, D)),
                       "v": (p.v_shape, (B, Hkv, C, Dv)), "o": (p.o_shape, (B, Hq, R, Dv))}
        mask_layout = None
        if p.mask != "none" and p.runtime_strides:
            mask_layout = runtime_layout(stride_names("mask", MASK_AXES), baked)
        elif p.mask != "none":
            mask_layout = operand_layout(p.mask_shape, (B, Hq, R, C), p.mask_strides, (0, 1, 2, 3), baked)
        window = WINDOW_SIZE_NAMES if p.runtime_window else p.window
        self.rules = MaskRules(p.causal, window, p.mask, p.mask_dtype, mask_layout)

    def field(self, columns: int, strides) -> OperandLayout:
        """The layout of a stored field of k or v: (B, Hkv, C, columns), these strides."""
        p = self._p
        B, Hkv, C = (Extent(1, (name,)) for name in ("B", "Hkv", "C"))
        shape = (p.batch, p.kv_heads, p.kv_len, columns)
        return operand_layout(shape, (B, Hkv, C, Extent(columns)), strides, self._order, self._baked)

    def of(self, kind: str, strides=None, name: str | None = None) -> OperandLayout:
        """The layout of a tensor shaped like q, k, v or o ("kind"); strides None: contiguous
        (allocated). An input `name`d has runtime strides when the problem asks for them."""
        if name is not None and self._p.runtime_strides:
            return runtime_layout(stride_names(name), self._baked)
        shape, sizes = self._kinds[kind]
        strides = contiguous_strides(self._p.layout, shape) if strides is None else strides
        return operand_layout(shape, sizes, strides, self._order, self._baked)


def _facts(p: AttentionProblem, family: str, sizes: dict[str, int], bake_lengths: bool) -> tuple[dict, _Layouts]:
    """The AttentionFacts fields of `p`, and the layouts helper for the rest."""
    _check_head_dims(p)
    baked = sizes if bake_lengths else None
    layouts = _Layouts(p, baked)
    facts = dict(head_dim=p.head_dim, value_dim=p.value_dim, dtype=p.dtype, gqa_ratio=p.gqa_ratio,
                 q=layouts.of("q", p.q_strides, "q"), k=layouts.of("k", p.k_strides, "k"),
                 v=layouts.of("v", p.v_strides, "v"),
                 rules=layouts.rules, sinks=p.sinks,
                 scale_log2e=scale_terms(p)[1], scores=p.scores, family=family,
                 sizes=RuntimeSizes(SIZES_STRUCT, tuple((name, SIZE_DOCS.get(name) or p.keys.size_docs[name])
                                                        for name in sizes),
                                    tuple(sizes.items()) if bake_lengths else None),
                 keys=p.keys.describe(p, family, baked),
                 k_storage=p.k_storage.describe(p.head_dim, layouts.field),
                 v_storage=p.v_storage.describe(p.value_dim, layouts.field))
    return facts, layouts


def describe(problem: AttentionProblem, *, family: str = CPU_FAMILY, bake_lengths: bool = False,
             split: tuple[int, int] | None = None, rows=None) -> KernelDescriptor:
    """The descriptor of the forward kernels of `problem`, tiles from `family`'s table;
    `split` = (splits, keys per split) adds the split sizes S and Cs (the split-KV pair);
    `rows`: the rows facet, None for the problem's own (a family whose kernel has one geometry
    passes it, as int8 passes rows.PER_HEAD)."""
    p = problem
    facts, layouts = _facts(p, family, sizes_of(p, split), bake_lengths)
    rows = p.rows if rows is None else rows
    row = tile_row(family, p.dtype, max(p.head_dim, p.value_dim))
    o = layouts.of("o")  # allocated contiguous
    D, Dv = p.head_dim, p.value_dim
    partial = OperandLayout((Extent(0), Extent(0), Extent(Dv), Extent(1)))   # rows of Dv floats
    pairs = vector_pairs(p, row.vector_access, {"q": (facts["q"], D), "k": (facts["k"], D), "v": (facts["v"], Dv),
                                                "o": (o, Dv), "o_partial": (partial, Dv)})
    key_block, products = rows.key_block(p, family), rows.products(p, family)
    return KernelDescriptor(**facts, o=o, return_lse=p.return_lse, products=products,
                            query_rows=rows.query_rows(p, family), key_block=key_block,
                            split_keys=invariance.split_keys(key_block) if p.batch_invariant else 0,
                            cache_q=row.cache_q and products == SIMDGROUP_MATRIX, rows=rows,
                            o_block=0 if rows.packed else row.o_block,
                            tile_type=operand_tile_type(p.dtype, family, row.tiles16),
                            weight_tile_type=operand_tile_type(p.dtype, family, row.p16),
                            stage_kv=rows.packed or rows.stages(p, family), vector_pairs=pairs)


def describe_backward(problem: AttentionBackwardProblem, *, family: str = CPU_FAMILY,
                      bake_lengths: bool = False) -> BackwardDescriptor:
    """The descriptor of the backward kernels of `problem`, tiles from `family`'s backward table."""
    p = problem.forward
    facts, layouts = _facts(p, family, backward_sizes(problem), bake_lengths)
    row = backward_tile_row(family, p.dtype, max(p.head_dim, p.value_dim))
    query_rows, key_rows = p.rows.backward_query_rows(p, family), shrunk(row.key_rows, p.kv_len)
    given = dict(o=layouts.of("o", problem.o_strides, "o"), dout=layouts.of("o", problem.dout_strides, "dout"),
                 dq=layouts.of("q"), dk=layouts.of("k"), dv=layouts.of("v"))   # the gradients allocated contiguous
    D, Dv = p.head_dim, p.value_dim
    widths = {"q": D, "k": D, "v": Dv, "o": Dv, "dout": Dv, "dq": D, "dk": D, "dv": Dv}
    layouts_of = {**{name: facts[name] for name in ("q", "k", "v")}, **given}
    pairs = vector_pairs(p, row.vector_access, {name: (layouts_of[name], widths[name]) for name in widths})
    return BackwardDescriptor(
        **facts,
        **given,
        scale=scale_terms(p)[0],
        query_rows=query_rows,
        key_rows=key_rows,
        cache_q=row.cache_q,
        cache_dout=row.cache_dout,
        cache_k=row.cache_k,
        cache_v=row.cache_v,
        dq_block=row.dq_block,
        dk_block=row.dk_block,
        dv_block=row.dv_block,
        tile_type=operand_tile_type(p.dtype, family, row.tiles16),
        weight_tile_type=operand_tile_type(p.dtype, family, row.p16),
        vector_pairs=pairs,
        **backward_blocks(p, family, row, query_rows, key_rows),
    )
