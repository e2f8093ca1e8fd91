"""MSL for sparse-indexed attention, backward: exact gradients without atomics.

sparse_backward_dq, heads as tile rows like the forward (one threadgroup per (query, kv
head, batch)): D = rowsum(dO o O), P recomputed from the forward's lse, dP = dO V^T,
dS = P o (dP - D), dQ += dS K over the listed keys. It also stores every listed slot's P
and dS (and each row's share of dsinks), so the key side needs no recomputation.

sparse_transpose_lists: per (batch, kv head), for each key the (query, slot) entries that
list it: a count, a prefix sum, and a scatter in (query, slot) order, by one thread per list
pair, so every key's contributions reduce in a fixed order.

sparse_backward_dkdv (token_dkdv.py): 8 keys per simdgroup, their entries walked query by
query, dK += W Q and dV += P dO as simdgroup-matrix tiles whose inner dimension is the query
heads, in a fixed order. Two runs give the same bits.
"""

from __future__ import annotations

from functools import lru_cache

from ..attention import operands
from ..attention.descriptor import BackwardDescriptor
from ..attention.forward import BUILTINS
from ..attention.rows import row_index
from ..attention.scores import buffers, setup
from ..attention.softmax import gradient_of_scores, logits, lse2, probabilities, sink_probability
from ..kernel.msl import BUILTINS_THREAD, MSL_TYPES, indent, loop
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from ..kernel.tiles import (HeadTensor, Positions, Rows, accumulate, block_loop, cached_rows, element_offset, scores,
                            tiles, zeroed)
from ..kernel.stores import store_rows
from .token_forward import slot_bias, slot_element, slot_geometry

DQ_KERNEL_NAME = "sparse_backward_dq"
TRANSPOSE_KERNEL_NAME = "sparse_transpose_lists"
INPUTS = ("q", "k", "v", "dout", "lse")
REREAD = "re-read: the rows do not stay in registers at this head dimension"


def dq_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = (operands.reads(d, *INPUTS, "o", "indices", "topk_length", "sinks", *buffers(d.scores))
           + operands.writes(d, "dq", "p_slots", "ds_slots", *(["sink_grad"] if d.sinks else [])) + operands.sizes(d))
    grid = (GridAxis(Extent(1, ("R",))), GridAxis(Extent(1, ("Hkv",))), GridAxis(Extent(1, ("B",))))
    return LaunchPlan(DQ_KERNEL_NAME, tuple(ops), grid, 32 * (d.query_rows // 8), d.sizes)


def transpose_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = (operands.reads(d, "indices", "topk_length")
           + operands.writes(d, "key_counts", "key_starts", "key_entries") + operands.sizes(d))
    grid = (GridAxis(Extent(1, ("B", "Hkv")), 32), GridAxis(Extent(1)), GridAxis(Extent(1)))
    return LaunchPlan(TRANSPOSE_KERNEL_NAME, tuple(ops), grid, 32, d.sizes)


def _heads(d: BackwardDescriptor, name: str, width: int) -> HeadTensor:
    """A (head, feature) view of tensor `name` at this query row: rows are query heads."""
    return HeadTensor(f"{name}_rows", getattr(d, name).strides[1], width)


def _delta(d: BackwardDescriptor) -> list[str]:
    """D = rowsum(dO o O) of the lane's (head, query) row; lse2; the row's share of dsinks."""
    o, dout = _heads(d, "o", d.value_dim), _heads(d, "dout", d.value_dim)
    per_tile = ["simdgroup_float8x8 o_t;", "simdgroup_float8x8 dout_t;", "{"] + indent(o.load_rows("o_t", "h", "t")) \
        + ["}", "{"] + indent(dout.load_rows("dout_t", "h", "t")) + ["}",
           "delta_row += o_t.thread_elements()[0] * dout_t.thread_elements()[0]"
           " + o_t.thread_elements()[1] * dout_t.thread_elements()[1];"]
    lines = ["", "// D = rowsum(dO o O) of the lane's row.", "float delta_row = 0.0f;"]
    lines += loop(f"ushort t = 0; t < {tiles(d.value_dim)}; ++t", per_tile)
    lines += ["delta_row += simd_shuffle_xor(delta_row, 1);", "delta_row += simd_shuffle_xor(delta_row, 8);"]
    lines += lse2("const float lse2", "row_at")
    if d.sinks:
        lines += [f"if (head_slot < {d.gqa_ratio} && tc == 0) {{",
                  f"  sink_grad[row_at] = -{sink_probability('lse2')} * delta_row;  // -p_sink D", "}"]
    return lines


def _dq_steps(d: BackwardDescriptor) -> list[str]:
    count = d.key_block // 8
    q, dout = _heads(d, "q", d.head_dim), _heads(d, "dout", d.value_dim)
    k, v = HeadTensor.of("k", d.k, d.head_dim), HeadTensor.of("v", d.v, d.value_dim)
    listed = Positions("count", listed="listed")
    body = slot_bias(count)
    body += ["", "// S = Q K^T over the listed keys."] + zeroed("p_tile", count, "scores, then probabilities")
    body += scores("p_tile", count=count, lhs=Rows(q, "h", "q_tile" if d.cache_q else None, "q_i"), rhs=k,
                   rhs_tile="k_tile", rhs_comment="K^T of the listed keys", position="key", first="kb",
                   positions=listed, reread=REREAD)
    body += ["", "// P = exp2(S * scale * log2(e) - lse2): the forward's probabilities."]
    body += logits(d, count, "p_tile", keep_slopes=True, at=slot_element(d)) + probabilities(count, "p_tile", "lse2")
    body += ["", "// dP = dO V^T."] + zeroed("dp_tile", count, "dP, then dS")
    body += scores("dp_tile", count=count, lhs=Rows(dout, "h", "dout_tile" if d.cache_dout else None, "dout_i"), rhs=v,
                   rhs_tile="v_tile", rhs_comment="V^T of the listed keys", position="key", first="kb",
                   positions=listed, reread=REREAD)
    body += gradient_of_scores(count, "delta_row", d.scores)
    body += ["", "// P and dS of the lane's slots, for the key side."]
    body += loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", [
        "const int slot = kb + j * 8 + int(tc) + e;",
        f"if (head_slot < {d.gqa_ratio} && slot < count) {{",
        "  p_slots[row_at * T + slot] = p_tile[j].thread_elements()[e];",
        "  ds_slots[row_at * T + slot] = dp_tile[j].thread_elements()[e];",
        "}"]))
    body += ["", "// dQ += dS K."]
    body += accumulate("dq_tile", weights="dp_tile", count=count, rhs=k, rhs_tile="k_tile",
                       rhs_comment="rows are listed keys, columns are head dims", position="key", first="kb",
                       positions=listed)
    return block_loop("kb", "0", "count", d.key_block, body)


def _summary(d: BackwardDescriptor, what: str) -> list[str]:
    return [f"{d.dtype}, D = {d.head_dim}, Dv = {d.value_dim}, {d.gqa_ratio} query heads per kv head", what]


@lru_cache(maxsize=32)
def generate_dq(d: BackwardDescriptor) -> KernelSource:
    """dQ over the listed keys, storing each slot's P and dS."""
    t = MSL_TYPES[d.dtype]
    body = slot_geometry(d)
    for name in ("o", "dout"):
        body.append(f"device const {t}* {name}_rows = {name} + "
                    f"({element_offset(getattr(d, name), ('ulong(b)', 0), ('ulong(r)', 2))});")
    body.append(f"const ulong row_at = {row_index('r')};  // the row in lse, sink_grad and the slot arrays")
    body += cached_rows([(label, f"{name}_tile", _heads(d, name, width)) for label, name, width, kept in
                         (("Q", "q", d.head_dim, d.cache_q), ("dO", "dout", d.value_dim, d.cache_dout)) if kept],
                        "h", " of the 8 heads")
    body += _delta(d) + setup(d)
    body += ["", "// dQ / scale, accumulated over the listed keys."] + zeroed("dq_tile", tiles(d.head_dim), "dQ / scale")
    body += _dq_steps(d)
    store = [f"device {t}* dq_row = dq + ({element_offset(d.dq, ('ulong(b)', 0), ('ulong(h)', 1), ('ulong(r)', 2))});"]
    store += store_rows("dq_row", "dq_tile", d.head_dim, cast=t, factor=d.scale)
    body += ["", "// dQ = scale * dS K.", f"if (head_slot < {d.gqa_ratio}) {{"] + indent(store) + ["}"]
    return assemble(dq_plan(d), summary=_summary(d, "sparse-indexed dQ, heads as tile rows; stores P and dS"),
                    builtins=BUILTINS, body=body)


@lru_cache(maxsize=32)
def generate_transpose(d: BackwardDescriptor) -> KernelSource:
    """Per key, the (query, slot) entries that list it, in (query, slot) order."""
    f = d.keys
    count = "int(T)"
    if f.lengths is not None:
        count = f"max(0, min(int(T), topk_length[{element_offset(f.lengths, ('ulong(b)', 0), ('ulong(r)', 1))}]))"
    row = f"indices + ({element_offset(f.indices, ('ulong(b)', 0), ('ulong(h_kv)', 1), ('ulong(r)', 2))})"
    scan = ["for (uint r = 0; r < R; ++r) {", f"  device const int* listed = {row};", f"  const int count = {count};",
            "  for (int slot = 0; slot < count; ++slot) {", "    const int key = listed[slot];",
            "    if (uint(key) < C) {  // entries < 0 or >= C are skipped"]
    body = ["const uint pair = group.x * 32 + lane;  // (batch, kv head)",
            "if (pair < B * Hkv) {",
            "  const uint b = pair / Hkv;", "  const uint h_kv = pair % Hkv;",
            "  device int* counts = key_counts + ulong(pair) * C;",
            "  device int* starts = key_starts + ulong(pair) * C;",
            "  device int* entries = key_entries + ulong(pair) * R * T;",
            "  for (uint c = 0; c < C; ++c) {", "    counts[c] = 0;", "  }"]
    body += indent(scan + ["      counts[key] += 1;", "    }", "  }", "}"])
    body += ["  int start = 0;", "  for (uint c = 0; c < C; ++c) {", "    starts[c] = start;",
             "    start += counts[c];", "    counts[c] = 0;  // counts again while scattering", "  }"]
    body += indent(scan + ["      entries[starts[key] + counts[key]] = int(r * T) + slot;",
                           "      counts[key] += 1;", "    }", "  }", "}"])
    body.append("}")
    return assemble(transpose_plan(d), summary=_summary(d, "per key, the (query, slot) entries listing it"),
                    builtins=BUILTINS_THREAD, body=body)
