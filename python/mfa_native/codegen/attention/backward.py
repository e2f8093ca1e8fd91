"""MSL for the attention backward pass, from a BackwardDescriptor: three kernels, no atomics.
Apple GPUs have no float atomics, so each kernel owns its outputs and P is recomputed in both:

attention_backward_dq, parallel over query blocks (one simdgroup per 8 query rows, walking the
keys in blocks): D = rowsum(dO o O) per row, stored for the second kernel (with sinks, also the
row's -p_sink D, which attention_backward_dsinks sums: dsinks.py); then per block of keys
P = exp2(S * scale * log2(e) + bias - lse2) with S = Q K^T, dP = dO V^T, dS = P o (dP - D),
dQ += dS K. At the end dQ *= scale.

attention_backward_dkdv, parallel over key blocks (one simdgroup per 8 keys, walking the
queries in blocks), for every query head of its kv head's group, so the group's dK and dV are
summed in registers: P^T = exp2(S^T ...) with S^T = K Q^T, dV += P^T dO, dP^T = V dO^T,
dS^T = P^T o (dP^T - D), dK += dS^T Q. At the end dK *= scale.

lse2 = lse * log2(e) is the log2-domain denominator the forward stored (sink included); a row
with no key (lse = -inf) gets lse2 = -MASKED, so its P is 0 and nothing it touches turns NaN.
Blocks that causal, window or a mask remove are skipped in both kernels, as in the forward.
Tile loads, masking and the softmax are the forward's building blocks; the products are the
descriptor's (kernel/products.py: simdgroup matrices, or tensor ops over tensor_views.py).
"""

from __future__ import annotations

from functools import lru_cache

from ..kernel.msl import MSL_TYPES, indent, loop, offset
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from ..kernel.accumulators import Accumulator
from ..kernel.products import scores_step, sum_step
from ..kernel.tiles import (HeadTensor, Positions, Rows, block_loop, cached_rows, head_pointer, lane_layout, tiles,
                            zeroed)
from ..kernel.stores import store_rows
from ..storage.staging import StagedTensor
from . import backward_summary, operands, staged_steps
from .descriptor import BackwardDescriptor
from .forward import BUILTINS
from .masking import (MaskRules, bias_over_keys, bias_over_queries, key_range, mask_key_pointer, mask_row_pointer,
                      query_range)
from .pairs import pair_type
from .rows import query_rows_geometry, row_index, threadgroup_span
from .scores import buffers, element, setup
from .softmax import gradient_of_scores, logits, lse2, probabilities, sink_probability
from .tensor_views import backward_views

DQ_KERNEL_NAME = "attention_backward_dq"
DKDV_KERNEL_NAME = "attention_backward_dkdv"
REREAD = "re-read: the rows do not stay in registers at this head dimension"
INPUTS = ("q", "k", "v", "dout", "lse")


def _accumulators(d: BackwardDescriptor) -> dict[str, Accumulator]:
    """dQ (dQ kernel), dK and dV (dK/dV kernel): register tiles, or paged (tables.py)."""
    return {"dq": Accumulator("dq_tile", d.head_dim, d.dq_block, d.query_rows // 8),
            "dk": Accumulator("dk_tile", d.head_dim, d.dk_block, d.key_rows // 8),
            "dv": Accumulator("dv_tile", d.value_dim, d.dv_block, d.key_rows // 8)}


def _tensors(d: BackwardDescriptor) -> dict[str, HeadTensor]:
    """q, k, v, dO load operand tiles of the row's type; O (only in D = rowsum(dO o O)) float ones."""
    widths = {"q": d.head_dim, "k": d.head_dim, "v": d.value_dim, "o": d.value_dim, "dout": d.value_dim}
    return {name: HeadTensor.of(name, getattr(d, name), width, "float" if name == "o" else d.tile_type,
                                pair_type(d, name)) for name, width in widths.items()}


def _step(d: BackwardDescriptor, kernel: str, rules: MaskRules, start: str, end: str, block: int, rows: int
          ) -> staged_steps.Step:
    """A block step of `kernel` (threadgroups of `rows` rows): staged where its column says."""
    return staged_steps.step(_staged(d, kernel), block=block, dtype=d.dtype, start=start, end=end,
                             positions=Positions(end), simdgroups=rows // 8, mask=rules.mask)


def _staged(d: BackwardDescriptor, kernel: str) -> list[StagedTensor]:
    """The rows `kernel`'s steps stage (none unless its column says so)."""
    return staged_steps.backward_staged(d, walks_keys=kernel == DQ_KERNEL_NAME)


def dq_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = (operands.reads(d, *INPUTS, "o", "mask", "sinks", *buffers(d.scores), *d.keys.key_lists)
           + operands.writes(d, "dq", "delta", *(["sink_grad"] if d.sinks else [])) + operands.sizes(d))
    grid = (d.keys.grid("queries", d.query_rows), GridAxis(Extent(1, ("Hq",))), GridAxis(Extent(1, ("B",))))
    return LaunchPlan(DQ_KERNEL_NAME, tuple(ops), grid, 32 * (d.query_rows // 8), d.sizes)


def dkdv_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = (operands.reads(d, *INPUTS, "delta", "mask", *buffers(d.scores), *d.keys.query_lists)
           + operands.writes(d, "dk", "dv") + operands.sizes(d))
    grid = (d.keys.grid("keys", d.key_rows), GridAxis(Extent(1, ("Hkv",))), GridAxis(Extent(1, ("B",))))
    return LaunchPlan(DKDV_KERNEL_NAME, tuple(ops), grid, 32 * (d.key_rows // 8), d.sizes)


# ---------------------------------------------------------------------------
# Pieces shared by the two kernels.


def _recomputed_probabilities(d: BackwardDescriptor, count: int, lse2: str, query: str, key: str) -> list[str]:
    """P of the element at (`query`, `key`), MSL ints."""
    return (["", "// P = exp2(S * scale * log2(e) + bias - lse2): the forward's probabilities, from its lse."]
            + logits(d, count, "p_tile", keep_slopes=True, at=element(d, query, key))
            + probabilities(count, "p_tile", lse2))


def _kernel(d: BackwardDescriptor, plan: LaunchPlan, body: list[str]) -> KernelSource:
    summary = backward_summary.lines(d, dq=plan.kernel_name == DQ_KERNEL_NAME)
    return assemble(plan, summary=summary, builtins=BUILTINS, body=body)


# ---------------------------------------------------------------------------
# The dQ kernel.


def _dq_geometry(d: BackwardDescriptor) -> list[str]:
    t = MSL_TYPES[d.dtype]
    located, first = d.keys.first("queries", d.query_rows)
    lines = query_rows_geometry(d.query_rows, d.gqa_ratio, ["const uint b = group.z;", *located], first) + [
        f"const ulong row_at = {row_index('row_read')};  // the row in lse, delta and sink_grad",
        "",
        head_pointer("q", d.q, "h", t, True),
        head_pointer("k", d.k, "h_kv", t, True),
        head_pointer("v", d.v, "h_kv", t, True),
        head_pointer("o", d.o, "h", t, True),
        head_pointer("dout", d.dout, "h", t, True),
        head_pointer("dq", d.dq, "h", t, False),
    ]
    if d.rules.mask != "none":
        lines.append(mask_row_pointer(d.rules))
    staged = _staged(d, DQ_KERNEL_NAME)
    return (lines + staged_steps.declare(staged, d.key_block, d.dtype, d.query_rows // 8, d.rules.mask)
            + backward_views(d, staged_steps.read_from_stage(_tensors(d), staged), walks_keys=True).lines)


def _row_delta(d: BackwardDescriptor) -> list[str]:
    """D of the lane's row, stored for the dK/dV kernel, and lse2; with sinks, -p_sink D."""
    x = _tensors(d)
    per_tile = ["simdgroup_float8x8 o_t;", "{"] + indent(x["o"].load_rows("o_t", "row_read", "t")) + ["}"]
    dout = "dout_tile[t]"
    if not d.cache_dout:
        dout = "dout_t"
        per_tile += [f"{x['dout'].tile} dout_t;", "{"] + indent(x["dout"].load_rows("dout_t", "row_read", "t")) + ["}"]
    per_tile.append(f"delta_row += o_t.thread_elements()[0] * {dout}.thread_elements()[0]"
                    f" + o_t.thread_elements()[1] * {dout}.thread_elements()[1];")
    lines = ["", "// D = rowsum(dO o O) of the lane's row: two columns per tile, then the row's four lanes.",
             "float delta_row = 0.0f;"]
    lines += loop(f"ushort t = 0; t < {tiles(d.value_dim)}; ++t", per_tile)
    lines += ["delta_row += simd_shuffle_xor(delta_row, 1);",
              "delta_row += simd_shuffle_xor(delta_row, 8);"]
    lines += lse2("const float lse2", "row_at")
    stores = ["delta[row_at] = delta_row;"]
    if d.sinks:
        stores.append(f"sink_grad[row_at] = -{sink_probability('lse2')} * delta_row;  // -p_sink D")
    return lines + [f"if (row < {d.keys.bounds.q_end} && tc == 0) {{"] + indent(stores) + ["}"]


def _dq_key_steps(d: BackwardDescriptor, rules: MaskRules, begin: str, end: str) -> list[str]:
    """dQ over the keys [begin, end), key_block at a time, with `rules`."""
    count = d.key_block // 8
    x = staged_steps.read_from_stage(_tensors(d), _staged(d, DQ_KERNEL_NAME))
    body = bias_over_keys(rules, count, end, d.keys.bounds.origin, skip_here=not d.stage_kv)
    step = _step(d, DQ_KERNEL_NAME, rules, "kb", end, d.key_block, d.query_rows)
    views = backward_views(d, x, walks_keys=True)
    products, where = views.products, dict(position="key", first=step.first, positions=step.positions)
    body += step.fills[0] + ["", "// S = Q K^T."] + zeroed("p_tile", count, "scores, then probabilities")
    body += scores_step(products, "p_tile", views=views.pair("q", "k"), count=count,
                        lhs=Rows(x["q"], "row_read", "q_tile" if d.cache_q else None, "q_i"), rhs=x["k"],
                        rhs_tile="k_tile", rhs_comment="K^T: rows are head dims, columns are keys", reread=REREAD,
                        **where)
    body += _recomputed_probabilities(d, count, "lse2", "int(row)", "kb + j * 8 + int(tc) + e")
    body += ["", "// dP = dO V^T."] + zeroed("dp_tile", count, "dP, then dS")
    body += scores_step(products, "dp_tile", views=views.pair("dout", "v"), count=count,
                        lhs=Rows(x["dout"], "row_read", "dout_tile" if d.cache_dout else None, "dout_i"), rhs=x["v"],
                        rhs_tile="v_tile", rhs_comment="V^T: rows are value dims, columns are keys", reread=REREAD,
                        **where)
    body += gradient_of_scores(count, "delta_row", d.scores)
    body += ["", "// dQ += dS K."]
    body += sum_step(products, "dq_tile", weights="dp_tile", count=count, view=views.of("k"),
                     accumulator=_accumulators(d)["dq"], rhs=x["k"].loading(d.weight_tile_type), rhs_tile="k_tile",
                     rhs_comment="rows are keys, columns are head dims", **where)
    return block_loop("kb", begin, end, d.key_block, body)


@lru_cache(maxsize=128)
def generate_dq(d: BackwardDescriptor) -> KernelSource:
    """The dQ kernel (it also stores D, and each row's share of dsinks)."""
    x = _tensors(d)
    body = _dq_geometry(d) + key_range(d.rules, bounds=d.keys.bounds,
                                       **threadgroup_span("q_first", d.query_rows, d.keys.bounds.q_end, d.stage_kv))
    body += cached_rows([(label, f"{name}_tile", x[name]) for label, name, kept in
                         (("Q", "q", d.cache_q), ("dO", "dout", d.cache_dout)) if kept], "row_read", ": the 8 rows")
    body += _row_delta(d)
    body += ["", "// dQ / scale, accumulated over the keys."] + _accumulators(d)["dq"].declare("dQ / scale")
    body += setup(d) + d.keys.keys(d, lambda rules, begin, end: _dq_key_steps(d, rules, begin, end))
    t = MSL_TYPES[d.dtype]
    store = [f"device {t}* dq_row = dq_head + {offset('ulong(row)', d.dq.strides[2])};"]
    store += store_rows("dq_row", "dq_tile", d.head_dim, cast=t, factor=d.scale,
                        element=_accumulators(d)["dq"].element, vector="dq" in d.vector_pairs)
    body += ["", "// dQ = scale * dS K.", f"if (row < {d.keys.bounds.q_end}) {{"] + indent(store) + ["}"]
    return _kernel(d, dq_plan(d), body)


# ---------------------------------------------------------------------------
# The dK/dV kernel.


def _dkdv_geometry(d: BackwardDescriptor) -> list[str]:
    t, staged = MSL_TYPES[d.dtype], _staged(d, DKDV_KERNEL_NAME)
    located, first = d.keys.first("keys", d.key_rows)
    return [
        "// This simdgroup's 8 keys, of one (batch, kv head).",
        "const uint b = group.z;",
        *located,
        "const uint h_kv = group.y;",
        f"const uint key_first = {first};",
        *lane_layout(),
        "const uint key_row = key_first + tr;",
        "const uint key_read = min(key_row, C - 1);  // keys past C compute on a valid key and are never stored",
        "",
        head_pointer("k", d.k, "h_kv", t, True),
        head_pointer("v", d.v, "h_kv", t, True),
        head_pointer("dk", d.dk, "h_kv", t, False),
        head_pointer("dv", d.dv, "h_kv", t, False),
    ] + staged_steps.declare(staged, d.query_block, d.dtype, d.key_rows // 8, d.rules.mask) + backward_views(
        d, staged_steps.read_from_stage(_tensors(d), staged), walks_keys=False).lines


def _query_steps(d: BackwardDescriptor, rules: MaskRules, begin: str, end: str) -> list[str]:
    """dK and dV over the queries [begin, end) of head h, query_block at a time, with `rules`."""
    count = d.query_block // 8
    x = staged_steps.read_from_stage(_tensors(d), _staged(d, DKDV_KERNEL_NAME))
    body = bias_over_queries(rules, count, end, d.keys.bounds.origin, skip_here=not d.stage_q_dout)
    body += ["", "// lse2 and D of the lane's queries.", f"float lse2[{2 * count}];", f"float delta_q[{2 * count}];"]
    body += loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", [
        f"const uint query = uint(min(qb + j * 8 + int(tc) + e, int({end}) - 1));",
        *lse2("lse2[j * 2 + e]", "rows_at + query"),
        "delta_q[j * 2 + e] = delta[rows_at + query];",
    ]))
    step = _step(d, DKDV_KERNEL_NAME, rules, "qb", end, d.query_block, d.key_rows)
    views = backward_views(d, x, walks_keys=False)
    products, where = views.products, dict(position="query", first=step.first, positions=step.positions)
    body += step.fills[0] + ["", "// S^T = K Q^T."] + zeroed("p_tile", count, "scores, then probabilities (keys x queries)")
    body += scores_step(products, "p_tile", views=views.pair("k", "q"), count=count,
                        lhs=Rows(x["k"], "key_read", "k_tile" if d.cache_k else None, "k_i"), rhs=x["q"],
                        rhs_tile="q_tile", rhs_comment="Q^T: rows are head dims, columns are queries", reread=REREAD,
                        **where)
    body += _recomputed_probabilities(d, count, "lse2[j * 2 + e]", "qb + j * 8 + int(tc) + e", "int(key_row)")
    body += ["", "// dV += P^T dO."]
    body += sum_step(products, "dv_tile", weights="p_tile", count=count, view=views.of("dout"),
                     accumulator=_accumulators(d)["dv"], rhs=x["dout"].loading(d.weight_tile_type),
                     rhs_tile="dout_tile", rhs_comment="rows are queries, columns are value dims", **where)
    body += ["", "// dP^T = V dO^T."] + zeroed("dp_tile", count, "dP^T, then dS^T")
    body += scores_step(products, "dp_tile", views=views.pair("v", "dout"), count=count,
                        lhs=Rows(x["v"], "key_read", "v_tile" if d.cache_v else None, "v_i"), rhs=x["dout"],
                        rhs_tile="dout_tile", rhs_comment="dO^T: rows are value dims, columns are queries",
                        reread=REREAD, **where)
    body += gradient_of_scores(count, "delta_q[j * 2 + e]", d.scores)
    body += ["", "// dK += dS^T Q."]
    body += sum_step(products, "dk_tile", weights="dp_tile", count=count, view=views.of("q"),
                     accumulator=_accumulators(d)["dk"], rhs=x["q"].loading(d.weight_tile_type), rhs_tile="q_tile",
                     rhs_comment="rows are queries, columns are head dims", **where)
    return block_loop("qb", begin, end, d.query_block, body)


def _query_heads(d: BackwardDescriptor) -> list[str]:
    """The query loop for every query head that reads this kv head."""
    t = MSL_TYPES[d.dtype]
    per_head = [head_pointer("q", d.q, "h", t, True), head_pointer("dout", d.dout, "h", t, True)]
    if d.rules.mask != "none":
        per_head.append(mask_key_pointer(d.rules))
    per_head.append(f"const ulong rows_at = {row_index('0')};  // this head's rows in lse and delta")
    per_head += setup(d)
    per_head += d.keys.queries(d, lambda rules, begin, end: _query_steps(d, rules, begin, end))
    if d.gqa_ratio == 1:
        return ["", "// The one query head that reads this kv head.", "{", "  const uint h = h_kv;"] \
            + indent(per_head) + ["}"]
    return (["", f"// The {d.gqa_ratio} query heads that read this kv head: their dK and dV add up here."]
            + loop(f"uint g = 0; g < {d.gqa_ratio}; ++g", [f"const uint h = h_kv * {d.gqa_ratio} + g;"] + per_head,
                   unroll=False))


@lru_cache(maxsize=128)
def generate_dkdv(d: BackwardDescriptor) -> KernelSource:
    """The dK/dV kernel (it reads the D the dQ kernel stored)."""
    x = _tensors(d)
    body = _dkdv_geometry(d) + query_range(
        d.rules, d.keys.bounds, **threadgroup_span("key_first", d.key_rows, d.keys.bounds.k_end, d.stage_q_dout))
    body += cached_rows([(label, f"{name}_tile", x[name]) for label, name, kept in
                         (("K", "k", d.cache_k), ("V", "v", d.cache_v)) if kept], "key_read", ": the 8 rows")
    body += ["", "// dK / scale and dV, accumulated over the queries of every head in the group."]
    acc = _accumulators(d)
    body += acc["dk"].declare("dK / scale") + acc["dv"].declare("dV")
    body += _query_heads(d)
    t = MSL_TYPES[d.dtype]
    store = [f"device {t}* dk_row = dk_head + {offset('ulong(key_row)', d.dk.strides[2])};"]
    store += store_rows("dk_row", "dk_tile", d.head_dim, cast=t, factor=d.scale,
                        element=acc["dk"].element, vector="dk" in d.vector_pairs)
    store += [f"device {t}* dv_row = dv_head + {offset('ulong(key_row)', d.dv.strides[2])};"]
    store += store_rows("dv_row", "dv_tile", d.value_dim, cast=t, element=acc["dv"].element,
                        vector="dv" in d.vector_pairs)
    body += ["", "// dK = scale * dS^T Q, dV = P^T dO.", f"if (key_row < {d.keys.bounds.k_end}) {{"] + indent(store) + ["}"]
    return _kernel(d, dkdv_plan(d), body)
