"""DeepSeek's lightning indexer and top-k, on the device: `sparse_topk`'s pass, two kernels.

sparse_topk_stream (topk_stream.py): per (split of the key range, query row, batch) the
scores of the split's candidate keys, block by block (topk_scores.py), merged into a running
top L = min(K, C) in threadgroup memory; each split's sorted run goes to device memory.
sparse_topk_merge (topk_merge.py): per row, the S runs merged into the top K, padded with -1
(score -inf). The order (score descending, key ascending; NaN above every number, as
torch.topk) is total, so the result does not depend on the splits or on thread timing. With
causal, key c is a candidate for row r iff c <= r + C - R. No R x C score matrix exists:
device memory written per call is (S + 1) * B * R * K entries of 8 bytes at most.

Splits, chosen like split-KV's (attention/split.py) as size expressions over the runtime sizes
and the device's parallel threadgroups P: enough (split, row) threadgroups to fill the device
when B * R is small, at most MAX_SPLITS, each at least MIN_KEYS_PER_SPLIT keys (whole blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...runtime.templates import PassTemplate
from ..kernel import passes
from ..kernel.layouts import OperandLayout, memory_order, operand_layout, physical, runtime_layout, stride_names
from ..kernel.sizes import Extent, RuntimeSizes
from .topk_merge import generate_merge
from .topk_scores import PRECISIONS, check_exact  # noqa: F401 (PRECISIONS: the op's choices)
from .topk_stream import BLOCK_KEYS, TOPK_LIMIT, generate_stream

GIVEN_SIZES = ("B", "Hi", "R", "C", "K", "P")   # P: the threadgroups the device runs at once
SIZE_DOCS = (("B", "batch"), ("Hi", "indexer heads"), ("R", "query length"), ("C", "key length"),
             ("K", "entries to keep (topk)"), ("S", "splits of the key range"), ("Cs", "keys per split"),
             ("L", "entries a split keeps: min(K, C)"))
# With runtime strides (a bundle's template), the inputs' strides in elements, logical (batch, head,
# row) order: q's, k's (its head axis has extent 1) and weights'; each feature axis is unit.
STRIDE_SIZES = tuple(name for operand in ("q", "k", "weights") for name in stride_names(operand))
STRIDE_DOCS = tuple((name, f"{name.rsplit('_', 2)[0]}'s {name.rsplit('_', 2)[1]} stride (elements)")
                    for name in STRIDE_SIZES)
MIN_KEYS_PER_SPLIT = 1024   # below this a split's run costs more than its keys
MAX_SPLITS = 15             # device bytes written stay below 16 * B * R * K entries
DERIVED = (("L", "min(K, C)"),
           ("S0", f"max(min(cdiv(P, B * R), C / {MIN_KEYS_PER_SPLIT}, {MAX_SPLITS}), 1)"),
           ("Cs", f"cdiv(cdiv(C, S0), {BLOCK_KEYS}) * {BLOCK_KEYS}"),
           ("S", "cdiv(C, Cs)"))


@dataclass(frozen=True)
class TopkDescriptor:
    dtype: str
    head_dim: int              # Di
    q: OperandLayout           # logical (batch, head, query, feature)
    k: OperandLayout           # logical (batch, -, key, feature)
    weights: OperandLayout     # logical (batch, head, query, -)
    out_layout: str            # "bhsd": (B, 1, R, topk), "bshd": (B, R, 1, topk)
    causal: bool
    sizes: RuntimeSizes
    precision: str = "float"   # "int8": q and k quantized per token in the kernel (topk_scores.py)
    runtime_strides: bool = False   # q's, k's and weights' strides read from the sizes (STRIDE_SIZES)


def describe_topk(*, dtype: str, shape: dict[str, int], strides: dict[str, tuple[int, ...]], layout: str,
                  causal: bool, precision: str = "float", runtime_strides: bool = False) -> TopkDescriptor:
    """The indexer's descriptor: `shape` holds B, Hi, R, C, K and Di; `strides` the element
    strides of q, k and weights in logical order. Dense strides stay symbolic, so a new
    length reuses the kernels; with `runtime_strides` (a bundle's) every stride but the
    feature axes' is a runtime size (STRIDE_SIZES), so one kernel serves every view."""
    B, Hi, R, C = (Extent(1, (name,)) for name in ("B", "Hi", "R", "C"))
    Di, one = Extent(shape["Di"]), Extent(1)
    order = memory_order(layout)
    q = operand_layout((shape["B"], shape["Hi"], shape["R"], shape["Di"]), (B, Hi, R, Di), strides["q"], order, None)
    k = operand_layout((shape["B"], 1, shape["C"], shape["Di"]), (B, one, C, Di), strides["k"], order, None)
    weights = operand_layout((shape["B"], shape["Hi"], shape["R"], 1), (B, Hi, R, one), strides["weights"], order,
                              None)
    docs = SIZE_DOCS
    if runtime_strides:
        q, k, weights = (runtime_layout(stride_names(name), None) for name in ("q", "k", "weights"))
        docs = SIZE_DOCS + STRIDE_DOCS
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "int8":
        check_exact(shape["Di"])
    return TopkDescriptor(dtype, shape["Di"], q, k, weights, layout, causal, RuntimeSizes("TopkSizes", docs),
                          precision, runtime_strides)


def topk_sizes(shape: dict[str, int], strides: dict[str, tuple[int, ...]], parallel_threadgroups: int,
               runtime_strides: bool = False) -> dict[str, int]:
    """The sizes a call gives the template (GIVEN_SIZES, and with runtime strides STRIDE_SIZES)."""
    sizes = {**{name: shape[name] for name in GIVEN_SIZES if name != "P"}, "P": parallel_threadgroups}
    if runtime_strides:
        sizes.update(zip(STRIDE_SIZES, (s for name in ("q", "k", "weights") for s in strides[name][:3])))
    return sizes


def topk_template(d: TopkDescriptor) -> PassTemplate:
    """The indexer's pass: the stream of scores into each split's run, then their merge;
    inputs q, k, weights laid out as the kernels were compiled for, outputs indices and
    topk_scores. Valid while L = min(K, C) <= TOPK_LIMIT."""
    B, Hi, R, C, K = (Extent(1, (name,)) for name in ("B", "Hi", "R", "C", "K"))
    Di, one = Extent(d.head_dim), Extent(1)
    layout = d.out_layout
    inputs = {"q": passes.TensorSpec(d.dtype, physical((B, Hi, R, Di), layout), physical(d.q.strides, layout)),
              "k": passes.TensorSpec(d.dtype, physical((B, one, C, Di), layout), physical(d.k.strides, layout)),
              "weights": passes.TensorSpec("float32", physical((B, Hi, R, one), layout)[:3],
                                           physical(d.weights.strides, layout)[:3])}
    shape = (B, one, R, K) if layout == "bhsd" else (B, R, one, K)
    outputs = {"indices": passes.TensorSpec("int32", shape), "topk_scores": passes.TensorSpec("float32", shape)}
    given = GIVEN_SIZES + (STRIDE_SIZES if d.runtime_strides else ())
    return passes.build_template("sparse_topk", (generate_stream(d), generate_merge(d)), sizes=given,
                                 inputs=inputs, outputs=outputs, derived=DERIVED, guards=(f"L <= {TOPK_LIMIT}",),
                                 valid_for=dict(dtype=d.dtype, head_dim=d.head_dim, layout=layout, causal=d.causal,
                                                precision=d.precision,
                                                **({"strides": "runtime"} if d.runtime_strides else {})))
