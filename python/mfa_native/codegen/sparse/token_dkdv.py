"""MSL for sparse-indexed attention's dK/dV kernel: simdgroup-matrix tiles, no atomics.

sparse_backward_dkdv: one simdgroup per 8 keys of one (batch, kv head). A key's entries
(sparse_transpose_lists: the (query, slot) pairs that list it, in (query, slot) order) are
walked query by query, all 8 keys together: each step takes the smallest next query r among
the 8 keys (simd_min, so the walk is uniform across the simdgroup) and forms, per 8 query
heads of the kv head, the 8 keys x 8 heads tiles

  W[key, head] = sum of ds_slots over the key's slots at query r (duplicates add up),
  P[key, head] = the same sum of p_slots,

then dK += W Q_r and dV += P dO_r with simdgroup_multiply_accumulate, Q_r and dO_r being the
8 heads' rows at query r (heads as the tile's inner dimension, as the forward's heads are
its rows). A key with no entry at r has a zero row. At the end dK *= scale. dK and dV are
register tiles, or paged through threadgroup memory like the dense kernel's (the backward
table's dk_block, dv_block). The order is
fixed (queries ascending, then slots, then head tiles), so two runs give the same bits.
"""

from __future__ import annotations

from functools import lru_cache

from ..attention import operands
from ..attention.descriptor import BackwardDescriptor
from ..attention.forward import BUILTINS
from ..attention.rows import row_index
from ..kernel.msl import MSL_TYPES, indent, loop
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from ..kernel.accumulators import Accumulator
from ..kernel.tiles import HeadTensor, element_offset, lane_layout, tiles
from ..kernel.stores import store_rows

DKDV_KERNEL_NAME = "sparse_backward_dkdv"
KEYS = 8          # keys per simdgroup (the tiles' rows), one simdgroup per threadgroup
NO_QUERY = "0xFFFFFFFFu"


def dkdv_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = (operands.reads(d, "q", "dout", "p_slots", "ds_slots", "key_counts", "key_starts", "key_entries")
           + operands.writes(d, "dk", "dv") + operands.sizes(d))
    grid = (GridAxis(Extent(1, ("C",)), KEYS), GridAxis(Extent(1, ("Hkv",))), GridAxis(Extent(1, ("B",))))
    return LaunchPlan(DKDV_KERNEL_NAME, tuple(ops), grid, 32, d.sizes)


def _geometry(d: BackwardDescriptor) -> list[str]:
    """The simdgroup's 8 keys; the lane's key (row tr), its entries and how many."""
    return ["// This simdgroup's 8 keys, of one (batch, kv head); the lane's key is row tr.",
            "const uint b = group.z;", "const uint h_kv = group.y;", *lane_layout(),
            f"const uint key_row = group.x * {KEYS} + tr;",
            "const uint key_read = min(key_row, C - 1);",
            "const ulong pair = ulong(b) * Hkv + h_kv;",
            "device const int* entries = key_entries + pair * R * T + key_starts[pair * C + key_read];",
            "const int listings = key_row < C ? key_counts[pair * C + key_read] : 0;  // keys past C list nothing",
            "int cursor = 0;  // the lane's key's next entry"]


def _next_query() -> list[str]:
    """Defines r (the smallest next query of the 8 keys; the loop ends when none is left) and
    `end`: the lane's key's entries at r are [cursor, end)."""
    return ["// The next query: the smallest among the 8 keys' next entries.",
            f"const uint next = cursor < listings ? uint(entries[cursor]) / T : {NO_QUERY};",
            "const uint r = simd_min(next);",
            f"if (r == {NO_QUERY}) {{ break; }}",
            "int end = cursor;",
            "while (end < listings && uint(entries[end]) / T == r) { ++end; }  // the key's slots at r"]


def _weights(d: BackwardDescriptor) -> list[str]:
    """ds_w, p_w: the 8 keys x heads [j * 8, + 8) tiles of summed dS and P at query r."""
    G = d.gqa_ratio
    per_element = [
        "const uint head = j * 8 + tc + e;",
        "float ds = 0.0f;", "float p = 0.0f;",
        f"if (head < {G}) {{",
        f"  const uint h = h_kv * {G} + head;",
        f"  const ulong at = ({row_index('r')}) * T;",
        "  for (int n = cursor; n < end; ++n) {",
        "    const uint slot = uint(entries[n]) % T;",
        "    ds += ds_slots[at + slot];", "    p += p_slots[at + slot];",
        "  }", "}",
        "ds_w.thread_elements()[e] = ds;", "p_w.thread_elements()[e] = p;"]
    return (["simdgroup_float8x8 ds_w;  // dS summed over the key's slots: keys x heads",
             "simdgroup_float8x8 p_w;   // P, the same"]
            + loop("ushort e = 0; e < 2; ++e", per_element))


def _accumulators(d: BackwardDescriptor) -> tuple[Accumulator, Accumulator]:
    """dK and dV: register tiles, or paged like the dense kernel's (dk_block, dv_block)."""
    return (Accumulator("dk_tile", d.head_dim, d.dk_block), Accumulator("dv_tile", d.value_dim, d.dv_block))


def _product(result: Accumulator, weights: str, tensor: HeadTensor, G: int) -> list[str]:
    """result += weights . the heads' rows [j * 8, + 8) of `tensor` (heads past G load 0)."""
    head = f"h_kv * {G} + min(j * 8 + tr, {G - 1}u)"

    def product(features):
        first, count = features or (0, tiles(tensor.width))
        load = ["simdgroup_float8x8 rows_t;  // rows are query heads, columns are features"]
        load += tensor.load_rows("rows_t", head, f"({first} + t)" if first else "t", valid=f"j * 8 + tr < {G}")
        load.append(f"simdgroup_multiply_accumulate({result.name}[t], {weights}, rows_t, {result.name}[t]);")
        return loop(f"ushort t = 0; t < {count}; ++t", load)

    return result.blocks(product)


def _query_step(d: BackwardDescriptor) -> list[str]:
    t = MSL_TYPES[d.dtype]
    q, dout = (HeadTensor(f"{name}_rows", getattr(d, name).strides[1], width)
               for name, width in (("q", d.head_dim), ("dout", d.value_dim)))
    per_heads = _weights(d) + ["", "// dK += W Q_r, dV += P dO_r."]
    dk, dv = _accumulators(d)
    per_heads += _product(dk, "ds_w", q, d.gqa_ratio) + _product(dv, "p_w", dout, d.gqa_ratio)
    body = _next_query() + [
        f"device const {t}* q_rows = q + ({element_offset(d.q, ('ulong(b)', 0), ('ulong(r)', 2))});",
        f"device const {t}* dout_rows = dout + ({element_offset(d.dout, ('ulong(b)', 0), ('ulong(r)', 2))});"]
    body += loop(f"ushort j = 0; j < {tiles(d.gqa_ratio)}; ++j", per_heads, unroll=False)
    body.append("cursor = end;")
    return ["", "// Query by query, every query that lists one of the 8 keys."] + ["while (true) {"] \
        + indent(body) + ["}"]


def _row_offset(layout) -> str:
    """The lane's key row of (batch b, kv head h_kv) in a k-shaped layout."""
    return element_offset(layout, ("ulong(b)", 0), ("ulong(h_kv)", 1), ("ulong(key_row)", 2))


def _store(d: BackwardDescriptor) -> list[str]:
    t = MSL_TYPES[d.dtype]
    store = [f"device {t}* dk_row = dk + ({_row_offset(d.dk)});"]
    dk, dv = _accumulators(d)
    store += store_rows("dk_row", "dk_tile", d.head_dim, cast=t, factor=d.scale, element=dk.element)
    store += [f"device {t}* dv_row = dv + ({_row_offset(d.dv)});"]
    store += store_rows("dv_row", "dv_tile", d.value_dim, cast=t, element=dv.element)
    return ["", "// dK = scale * sum dS q, dV = sum P dO.", "if (key_row < C) {"] + indent(store) + ["}"]


@lru_cache(maxsize=32)
def generate_dkdv(d: BackwardDescriptor) -> KernelSource:
    """dK and dV of 8 keys per simdgroup: their entries' stored dS and P against q and dO, as tiles."""
    body = _geometry(d) + ["", "// dK / scale and dV of the 8 keys."]
    dk, dv = _accumulators(d)
    body += dk.declare("dK / scale") + dv.declare("dV")
    body += _query_step(d) + _store(d)
    summary = [f"{d.dtype}, D = {d.head_dim}, Dv = {d.value_dim}, {d.gqa_ratio} query heads per kv head",
               "sparse-indexed dK, dV: 8 keys per simdgroup, query by query, heads as the tiles' inner dimension"]
    return assemble(dkdv_plan(d), summary=summary, builtins=BUILTINS, body=body)
