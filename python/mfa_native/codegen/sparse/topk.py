"""DeepSeek's lightning indexer and top-k, on the device: `sparse_topk`'s pass.

sparse_topk_scores: score[b, r, c] = sum_h weights[b, h, r] * relu(q[b, h, r] . k[b, 0, c]),
in float32. One simdgroup per (block of keys, query row, batch); the indexer heads are the
rows of its 8x8 tiles (Q of 8 heads times K^T of 8 keys), so every key row is read once per
8 heads; the weighted sum over heads is a sum over tile rows (lanes differing in bits 1, 2, 4).

sparse_topk_select: per query row, each candidate key's rank in the order (score
descending, key ascending; NaN above every number, as torch.topk) is the number of
candidates before it; the order is total, so every rank is written once and the result does not depend on thread timing; ranks below topk are stored, the
slots past the candidates are padded with -1 (score -inf). With causal, key c is a
candidate for row r iff c <= r + C - R. (O(C^2) comparisons per row: a first, exact
version; a sort in threadgroup memory is the faster one.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..kernel import passes
from ...runtime.templates import PassTemplate
from ..kernel.layouts import OperandLayout, memory_order, operand_layout, physical
from ..kernel.msl import BUILTINS_LANE, BUILTINS_THREAD, MSL_TYPES, indent, loop, ranks_before
from ..kernel.plan import GridAxis, LaunchPlan, Operand
from ..kernel.sizes import SIZES_OPERAND, Extent, RuntimeSizes
from ..kernel.source import KernelSource, assemble
from ..kernel.tiles import HeadTensor, Positions, element_offset, lane_layout, tiles, zeroed

SCORES_KERNEL_NAME = "sparse_topk_scores"
SELECT_KERNEL_NAME = "sparse_topk_select"
KEYS_PER_GROUP = 64
SELECT_THREADS = 256
SIZE_DOCS = (("B", "batch"), ("Hi", "indexer heads"), ("R", "query length"), ("C", "key length"),
             ("K", "entries to keep (topk)"))


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


def scores_plan(d: TopkDescriptor) -> LaunchPlan:
    t = MSL_TYPES[d.dtype]
    ops = (Operand("q", f"device const {t}*", "indexer queries"), Operand("k", f"device const {t}*", "indexer keys"),
           Operand("weights", "device const float*", "(B, Hi, R) head weights"),
           Operand("scores", "device float*", "(B, R, C) indexer scores", Extent(1, ("B", "R", "C"))),
           Operand(SIZES_OPERAND, f"constant {d.sizes.struct}&", "runtime sizes"))
    grid = (GridAxis(Extent(1, ("C",)), KEYS_PER_GROUP), GridAxis(Extent(1, ("R",))), GridAxis(Extent(1, ("B",))))
    return LaunchPlan(SCORES_KERNEL_NAME, ops, grid, 32, d.sizes)


def select_plan(d: TopkDescriptor) -> LaunchPlan:
    ops = (Operand("scores", "device const float*", "(B, R, C) indexer scores", Extent(1, ("B", "R", "C"))),
           Operand("indices", "device int*", "the kept keys of each row, best first, -1 as padding"),
           Operand("topk_scores", "device float*", "their scores, -inf as padding"),
           Operand(SIZES_OPERAND, f"constant {d.sizes.struct}&", "runtime sizes"))
    grid = (GridAxis(Extent(1, ("R",))), GridAxis(Extent(1, ("B",))), GridAxis(Extent(1)))
    return LaunchPlan(SELECT_KERNEL_NAME, ops, grid, SELECT_THREADS, d.sizes)


@lru_cache(maxsize=32)
def generate_scores(d: TopkDescriptor) -> KernelSource:
    t = MSL_TYPES[d.dtype]
    q = HeadTensor("q_rows", d.q.strides[1], d.head_dim)
    k = HeadTensor("k_rows", d.k.strides[2], d.head_dim)
    body = ["const uint r = group.y;", "const uint b = group.z;", *lane_layout(),
            f"const uint key_first = group.x * {KEYS_PER_GROUP};",
            f"device const {t}* q_rows = q + ({element_offset(d.q, ('ulong(b)', 0), ('ulong(r)', 2))});  // row h: head h",
            f"device const {t}* k_rows = k + ({element_offset(d.k, ('ulong(b)', 0))});",
            f"float column[{2 * KEYS_PER_GROUP // 8}];  // the lane's two keys of every tile: summed over heads"]
    body += loop(f"ushort j = 0; j < {2 * KEYS_PER_GROUP // 8}; ++j", ["column[j] = 0.0f;"])
    keys = Positions("int(C)")
    per_head_tile = [
        "const uint head = head_tile * 8 + tr;",
        "const uint head_read = min(head, Hi - 1);",
        f"const float weight = head < Hi ? weights[{element_offset(d.weights, ('ulong(b)', 0), ('ulong(head_read)', 1), ('ulong(r)', 2))}] : 0.0f;",
    ] + zeroed("s_tile", KEYS_PER_GROUP // 8, "Q K^T: 8 heads x 8 keys per tile")
    per_feature = ["simdgroup_float8x8 q_tile;"] + q.load_rows("q_tile", "head_read", "i")
    per_key_tile = ["simdgroup_float8x8 k_tile;"] + k.load_transposed("k_tile", "key", "int(key_first) + j * 8",
                                                                       keys, "i")
    per_key_tile.append("simdgroup_multiply_accumulate(s_tile[j], q_tile, k_tile, s_tile[j]);")
    per_feature += loop(f"int j = 0; j < {KEYS_PER_GROUP // 8}; ++j", per_key_tile)
    per_head_tile += loop(f"ushort i = 0; i < {tiles(d.head_dim)}; ++i", per_feature)
    per_head_tile += loop(f"int j = 0; j < {KEYS_PER_GROUP // 8}; ++j", loop("int e = 0; e < 2; ++e", [
        "const float s = s_tile[j].thread_elements()[e];",
        "column[j * 2 + e] += weight * (s < 0.0f ? 0.0f : s);  // relu, weighted; NaN stays NaN"]))
    body += ["", "// Scores of 64 keys, 8 indexer heads at a time (heads past Hi weigh 0)."]
    body += loop("uint head_tile = 0; head_tile * 8 < Hi; ++head_tile", per_head_tile, unroll=False)
    body += ["", "// The sum over heads: over the 8 rows of each tile (lanes that differ in bits 1, 2 and 4)."]
    body += loop(f"ushort j = 0; j < {2 * KEYS_PER_GROUP // 8}; ++j", [
        "column[j] += simd_shuffle_xor(column[j], 2);", "column[j] += simd_shuffle_xor(column[j], 4);",
        "column[j] += simd_shuffle_xor(column[j], 16);"])
    body += ["if (tr == 0) {"] + indent(loop(f"int j = 0; j < {KEYS_PER_GROUP // 8}; ++j", loop("int e = 0; e < 2; ++e", [
        "const uint key = key_first + j * 8 + tc + e;",
        "if (key < C) {", "  scores[(ulong(b) * R + r) * C + key] = column[j * 2 + e];", "}"]))) + ["}"]
    summary = [f"indexer scores: {d.dtype}, Di = {d.head_dim}, heads as tile rows, {KEYS_PER_GROUP} keys per simdgroup"]
    return assemble(scores_plan(d), summary=summary, builtins=BUILTINS_LANE, body=body)


@lru_cache(maxsize=32)
def generate_select(d: TopkDescriptor) -> KernelSource:
    candidates = "min(C, uint(max(0, int(r) + int(C) - int(R) + 1)))" if d.causal else "C"
    out = "(ulong(b) * R + r) * K"  # both layouts: the size-1 head axis makes (B, 1, R, K) and (B, R, 1, K) alike
    body = ["const uint r = group.x;", "const uint b = group.y;",
            f"const uint candidates = {candidates};  // keys 0 .. candidates - 1",
            "device const float* row = scores + (ulong(b) * R + r) * C;",
            f"for (uint c = lane; c < candidates; c += {SELECT_THREADS}) {{",
            "  const float score = row[c];",
            "  uint rank = 0;",
            "  for (uint other = 0; other < candidates; ++other) {",
            "    const float s = row[other];",
            f"    rank += {ranks_before(score='score', key='c', other_score='s', other_key='other')} ? 1u : 0u;",
            "  }",
            "  if (rank < K) {",
            f"    indices[{out} + rank] = int(c);",
            f"    topk_scores[{out} + rank] = score;",
            "  }",
            "}",
            f"for (uint slot = candidates + lane; slot < K; slot += {SELECT_THREADS}) {{  // fewer candidates than K",
            f"  indices[{out} + slot] = -1;",
            f"  topk_scores[{out} + slot] = -INFINITY;",
            "}"]
    summary = [f"top-k of the indexer scores{' (causal candidates)' if d.causal else ''}: rank of each candidate"]
    return assemble(select_plan(d), summary=summary, builtins=BUILTINS_THREAD, body=body)




def describe_topk(*, dtype: str, shape: dict[str, int], strides: dict[str, tuple[int, ...]], layout: str,
                  causal: bool) -> TopkDescriptor:
    """The indexer's descriptor: `shape` holds B, Hi, R, C, K and Di; `strides` the element
    strides of q, k and weights in logical order. Dense strides stay symbolic, so a new
    length reuses the kernels."""
    B, Hi, R, C = (Extent(1, (name,)) for name in ("B", "Hi", "R", "C"))
    Di, one = Extent(shape["Di"]), Extent(1)
    order = memory_order(layout)
    q = operand_layout((shape["B"], shape["Hi"], shape["R"], shape["Di"]), (B, Hi, R, Di), strides["q"], order, None)
    k = operand_layout((shape["B"], 1, shape["C"], shape["Di"]), (B, one, C, Di), strides["k"], order, None)
    weights = operand_layout((shape["B"], shape["Hi"], shape["R"], 1), (B, Hi, R, one), strides["weights"], order,
                              None)
    return TopkDescriptor(dtype, shape["Di"], q, k, weights, layout, causal, RuntimeSizes("TopkSizes", SIZE_DOCS))


def topk_template(d: TopkDescriptor) -> PassTemplate:
    """The indexer's pass: scores, then selection; inputs q, k, weights laid out as the
    kernels were compiled for, outputs indices and topk_scores."""
    B, Hi, R, C, K = (Extent(1, (name,)) for name in ("B", "Hi", "R", "C", "K"))
    Di, one = Extent(d.head_dim), Extent(1)
    layout = d.out_layout
    inputs = {"q": passes.TensorSpec(d.dtype, physical((B, Hi, R, Di), layout), physical(d.q.strides, layout)),
              "k": passes.TensorSpec(d.dtype, physical((B, one, C, Di), layout), physical(d.k.strides, layout)),
              "weights": passes.TensorSpec("float32", physical((B, Hi, R, one), layout)[:3],
                                           physical(d.weights.strides, layout)[:3])}
    shape = (B, one, R, K) if layout == "bhsd" else (B, R, one, K)
    outputs = {"indices": passes.TensorSpec("int32", shape), "topk_scores": passes.TensorSpec("float32", shape)}
    return passes.build_template("sparse_topk", (generate_scores(d), generate_select(d)),
                                 sizes=tuple(name for name, _ in SIZE_DOCS), inputs=inputs, outputs=outputs,
                                 valid_for=dict(dtype=d.dtype, head_dim=d.head_dim, layout=layout, causal=d.causal))
