"""MSL for the attention forward pass (FlashAttention-2 order), from a KernelDescriptor.

One threadgroup holds `query_rows` query rows of one (batch, query head); each
simdgroup owns 8 of those rows and walks the keys in blocks on its own (no
threadgroup memory, no barriers). Per block of keys:

  1. allowed keys of the lane's elements (bounds, causal, window, mask), with
     additive mask values in the log2 domain; with a mask, a block that no row
     may see is skipped (one simd_max per block);
  2. S = Q K^T with 8x8 simdgroup matrices, only for tiles below the last key
     the rows may see (so causal blocks above the diagonal cost nothing);
  3. online softmax in the exp2 domain: m = running max, l = running sum,
     O *= exp2(m_old - m_new);
  4. O += P V.
At the end O /= l and lse = (m + log2 l) * ln 2. Removed keys carry the
finite logit MASKED; a row with no allowed key keeps l = 0 and stores O = 0,
lse = -inf.

The split-KV variant ("attention_partial", for decode) runs the same loop over
one split of the keys per threadgroup and stores the unnormalized O and (m, l)
of each split, in float32, for attention_combine.

Every 8x8 tile is read and written lane-locally through thread_elements():
lane `lane` holds row tr = (lane / 16) * 4 + (lane / 2) % 4 and columns
tc, tc + 1 with tc = ((lane / 4) & 2) * 2 + (lane % 2) * 2, so the four lanes
of a row differ in lane bits 0 and 3 (row reductions: shuffle_xor 1 and 8).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .descriptor import Extent, KernelDescriptor, OperandLayout
from .msl import (MSL_TYPES, SIZES_STRUCT, constants, float_literal, header, indent, loop, offset, signature,
                  sizes_struct)
from .plan import GridAxis, LaunchPlan, Operand

KERNEL_NAME = "attention_forward"
PARTIAL_KERNEL_NAME = "attention_partial"
MASKED_BELOW = "-1.0e30f"   # additive mask values at or below this remove the key (see reference.py)
BUILTINS = ["uint3 group [[threadgroup_position_in_grid]]",
            "ushort simd_index [[simdgroup_index_in_threadgroup]]",
            "ushort lane [[thread_index_in_simdgroup]]"]


@dataclass(frozen=True)
class KernelSource:
    source: str
    plan: LaunchPlan


def _tiles(n: int) -> int:
    return -(-n // 8)


def _size(*names: str, factor: int = 1) -> Extent:
    return Extent(factor, names)


def partial_scratch(d: KernelDescriptor) -> dict[str, Extent]:
    """Float32 elements of the split-KV intermediates: unnormalized O and (m, l) per split and row."""
    return {"o_partial": _size("S", "B", "Hq", "R", factor=d.value_dim),
            "ml_partial": _size("S", "B", "Hq", "R", factor=2)}


def launch_plan(d: KernelDescriptor) -> LaunchPlan:
    t = MSL_TYPES[d.dtype]
    operands = [
        Operand("q", f"device const {t}*", "queries"),
        Operand("k", f"device const {t}*", "keys"),
        Operand("v", f"device const {t}*", "values"),
    ]
    if d.mask != "none":
        kind = "True = attend" if d.mask == "bool" else "added to the logits"
        operands.append(Operand("mask", f"device const {MSL_TYPES[d.mask_dtype]}*", f"mask, {kind}"))
    if d.kv_split:
        scratch = partial_scratch(d)
        operands += [
            Operand("o_partial", "device float*", "(S, B, Hq, R, Dv) unnormalized output per split",
                    scratch["o_partial"]),
            Operand("ml_partial", "device float*", "(S, B, Hq, R, 2) softmax max (log2) and sum per split",
                    scratch["ml_partial"]),
        ]
    else:
        operands.append(Operand("o", f"device {t}*", "output, laid out like q"))
        if d.return_lse:
            operands.append(Operand("lse", "device float*", "(B, Hq, R) natural-log softmax denominators"))
        if d.sinks:
            operands.append(Operand("sinks", "device const float*", "(Hq,) extra logit per head, no value"))
    fields: tuple[str, ...] = ()
    if d.baked_sizes is None:
        fields = d.size_names
        operands.append(Operand("sizes", f"constant {SIZES_STRUCT}&", "runtime sizes"))
    grid = (GridAxis(_size("R"), d.query_rows), GridAxis(_size("Hq")),
            GridAxis(_size("B", "S") if d.kv_split else _size("B")))
    name = PARTIAL_KERNEL_NAME if d.kv_split else KERNEL_NAME
    return LaunchPlan(name, tuple(operands), grid, 32 * d.simdgroups, fields)


# ---------------------------------------------------------------------------
# Pieces of the kernel body. Each returns a list of lines.


def _head_pointer(name: str, layout: OperandLayout, head: str, t: str, const: bool) -> str:
    terms = [offset("ulong(b)", layout.strides[0]), offset(f"ulong({head})", layout.strides[1])]
    terms = [x for x in terms if x] or ["0"]
    qualifier = "device const" if const else "device"
    return f"{qualifier} {t}* {name}_head = {name} + ({' + '.join(terms)});"


def _index(row: str, row_stride, col: str) -> str:
    """Element index of (row, col) inside a head: row * stride + col."""
    part = offset(row, row_stride)
    return f"{part} + {col}" if part else col


def _geometry(d: KernelDescriptor) -> list[str]:
    t = MSL_TYPES[d.dtype]
    if d.kv_split:
        batch = ["const uint b = group.z / S;", "const uint split = group.z % S;  // which share of the keys"]
    else:
        batch = ["const uint b = group.z;"]
    lines = [
        "// This simdgroup's 8 query rows, of one (batch, query head), and the kv head they read.",
        *batch,
        "const uint h = group.y;",
        f"const uint h_kv = h / {d.gqa_ratio};" if d.gqa_ratio > 1 else "const uint h_kv = h;",
        f"const uint q_first = group.x * {d.query_rows} + simd_index * 8;",
        "// The lane's place in every 8x8 tile: row tr, columns tc and tc + 1.",
        "const uint tr = (lane / 16) * 4 + (lane / 2) % 4;",
        "const uint tc = ((lane / 4) & 2) * 2 + (lane % 2) * 2;",
        "const uint row = q_first + tr;",
        "const uint row_read = min(row, R - 1);  // rows past R compute on a valid row and are never stored",
        "",
        _head_pointer("q", d.q, "h", t, True),
        _head_pointer("k", d.k, "h_kv", t, True),
        _head_pointer("v", d.v, "h_kv", t, True),
    ]
    if not d.kv_split:
        lines.append(_head_pointer("o", d.o, "h", t, False))
    if d.mask != "none":
        m = d.mask_layout.strides
        terms = [x for x in (offset("ulong(b)", m[0]), offset("ulong(h)", m[1]), offset("ulong(row_read)", m[2])) if x]
        lines.append(f"device const {MSL_TYPES[d.mask_dtype]}* mask_row = mask + ({' + '.join(terms) or '0'});")
    return lines


def _window_sides(d: KernelDescriptor) -> tuple[int | None, int | None]:
    """The bounded sides of the window, (left, right), None where unbounded."""
    if d.window is None:
        return None, None
    return tuple(None if side == -1 else side for side in d.window)  # type: ignore[return-value]


def _uses_diagonal(d: KernelDescriptor) -> bool:
    return d.causal == "lower_right" or _window_sides(d) != (None, None)


def _key_range(d: KernelDescriptor) -> list[str]:
    lines = ["", "// Keys any of these rows may see: [key_begin, key_end). Whole blocks outside are never visited."]
    if _uses_diagonal(d):
        lines.append("const int diagonal = int(C) - int(R);  // key j lines up with query j - diagonal (lower right)")
    left, right = _window_sides(d)
    if d.causal != "none" or right is not None:
        lines.append("const int row_last = int(min(q_first + 7, R - 1));")
    lines += ["int key_begin = 0;", "int key_end = q_first < R ? int(C) : 0;"]
    if d.causal == "lower_right":
        lines.append("key_end = min(key_end, row_last + diagonal + 1);  // causal, lower right")
    elif d.causal == "upper_left":
        lines.append("key_end = min(key_end, row_last + 1);  // causal, upper left")
    if left is not None:
        lines.append(f"key_begin = max(key_begin, int(q_first) + diagonal - {left});  // window, left")
    if right is not None:
        lines.append(f"key_end = min(key_end, row_last + diagonal + {right + 1});  // window, right")
    if d.kv_split:
        lines += ["key_begin = max(key_begin, int(split * Cs));  // this split's keys",
                  "key_end = min(key_end, int((split + 1) * Cs));"]
    return lines


def _load_q_tile(d: KernelDescriptor, target: str, tile: str) -> list[str]:
    """Q rows x head dims [tile * 8, tile * 8 + 8): zero past D."""
    src = _index("row_read", d.q.strides[2], "col")
    lines = [f"const uint col = {tile} * 8 + tc;"]
    for e in (0, 1):
        value = f"float(q_head[{src}{' + 1' if e else ''}])"
        if d.head_dim % 8:
            value = f"col{' + 1' if e else ''} < {d.head_dim} ? {value} : 0.0f"
        lines.append(f"{target}.thread_elements()[{e}] = {value};")
    return lines


def _q_in_registers(d: KernelDescriptor) -> list[str]:
    if not d.cache_q:
        return []
    body = _load_q_tile(d, "q_tile[i]", "i")
    return (["", f"// Q: 8 rows x {d.head_dim}, held in registers as 8x8 tiles.",
              f"simdgroup_float8x8 q_tile[{_tiles(d.head_dim)}];"]
            + loop(f"ushort i = 0; i < {_tiles(d.head_dim)}; ++i", body))


def _init_state(d: KernelDescriptor) -> list[str]:
    dv_tiles = _tiles(d.value_dim)
    lines = ["", "// Online softmax state of the lane's row (log2 domain) and its output accumulator."]
    if d.sinks and not d.kv_split:  # a split pass adds the sink when combining
        lines += ["float m = sinks[h] * LOG2E;  // the sink is one more logit, with no value",
                  "float l = 1.0f;"]
    else:
        lines += ["float m = MASKED;", "float l = 0.0f;"]
    lines.append(f"simdgroup_float8x8 o_tile[{dv_tiles}];")
    lines += loop(f"ushort t = 0; t < {dv_tiles}; ++t",
                  ["o_tile[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);"])
    return lines


def _allowed_expression(d: KernelDescriptor) -> list[str]:
    """Conditions for key `key` of query `row` (ints), beyond the mask. `key < key_end` keeps
    keys past C, and past a split's end (owned by the next split), out of the last tile."""
    terms = ["key < key_end"]
    if d.causal == "lower_right":
        terms.append("key <= int(row) + diagonal")
    elif d.causal == "upper_left":
        terms.append("key <= int(row)")
    left, right = _window_sides(d)
    if left is not None:
        terms.append(f"key >= int(row) + diagonal - {left}")
    if right is not None:
        terms.append(f"key <= int(row) + diagonal + {right}")
    return terms


def _bias(d: KernelDescriptor, key_tiles: int) -> list[str]:
    """s[i] = additive term (log2 domain) for allowed keys, MASKED for removed ones."""
    body = ["const int key = kb + j * 8 + int(tc) + e;",
            f"bool allowed = {' && '.join(_allowed_expression(d))};"]
    value = "0.0f"
    if d.mask != "none":
        body.append(f"const {MSL_TYPES[d.mask_dtype]} mask_value = "
                    f"mask_row[{offset('uint(min(key, int(C) - 1))', d.mask_layout.strides[3]) or '0'}];")
        if d.mask == "bool":
            body.append("allowed = allowed && mask_value != 0;")
        else:
            body.append(f"allowed = allowed && float(mask_value) > {MASKED_BELOW};")
            value = "float(mask_value) * LOG2E"
    body.append(f"s[j * 2 + e] = allowed ? {value} : MASKED;")
    lines = ["// Which of the lane's keys are allowed, and the additive mask (log2 domain).",
             f"float s[{2 * key_tiles}];"]
    lines += loop(f"int j = 0; j < {key_tiles}; ++j", loop("int e = 0; e < 2; ++e", body))
    if d.mask != "none":
        lines += ["bool lane_sees_key = false;"]
        lines += loop(f"ushort i = 0; i < {2 * key_tiles}; ++i", ["lane_sees_key = lane_sees_key || s[i] > MASKED;"])
        lines += ["if (simd_max(uint(lane_sees_key)) == 0u) {",
                  "  continue;  // the mask removes this whole block for these rows",
                  "}"]
    return lines


def _scores(d: KernelDescriptor, key_tiles: int) -> list[str]:
    """p_tile[j] = Q K^T for the tiles that hold visible keys."""
    k_index = [_index(f"key{e}", d.k.strides[2], "dim") for e in (0, 1)]
    load_k = ["const uint dim = i * 8 + tr;"]
    for e in (0, 1):
        load_k.append(f"const uint key{e} = uint(min(kb + j * 8 + int(tc) + {e}, int(C) - 1));")
    for e in (0, 1):
        value = f"float(k_head[{k_index[e]}])"
        if d.head_dim % 8:
            value = f"dim < {d.head_dim} ? {value} : 0.0f"
        load_k.append(f"k_tile.thread_elements()[{e}] = {value};")
    per_tile = ["simdgroup_float8x8 k_tile;  // K^T: rows are head dims, columns are keys"] + load_k
    q_tile = "q_tile[i]" if d.cache_q else "q_i"
    per_tile.append(f"simdgroup_multiply_accumulate(p_tile[j], {q_tile}, k_tile, p_tile[j]);")
    inner = loop(f"int j = 0; j < {key_tiles}; ++j", ["if (j < tiles) {"] + indent(per_tile) + ["}"])
    if not d.cache_q:
        inner = ["simdgroup_float8x8 q_i;  // re-read: Q does not stay in registers at this head dimension"] \
            + _load_q_tile(d, "q_i", "i") + inner
    lines = ["", "// S = Q K^T, 8x8 tiles; tiles past key_end stay 0 and are masked below.",
             f"simdgroup_float8x8 p_tile[{key_tiles}];  // scores, then probabilities"]
    lines += loop(f"int j = 0; j < {key_tiles}; ++j", ["p_tile[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);"])
    lines += loop(f"ushort i = 0; i < {_tiles(d.head_dim)}; ++i", inner)
    return lines


def _softmax(d: KernelDescriptor, key_tiles: int) -> list[str]:
    lines = ["", "// Online softmax: new running max, rescale, probabilities.", "float block_max = MASKED;"]
    lines += loop(f"int j = 0; j < {key_tiles}; ++j", loop("int e = 0; e < 2; ++e", [
        "const int i = j * 2 + e;",
        f"s[i] = s[i] > MASKED ? p_tile[j].thread_elements()[e] * {float_literal(d.scale_log2e)} + s[i] : MASKED;",
        "block_max = max(block_max, s[i]);",
    ]))
    lines += [
        "block_max = max(block_max, simd_shuffle_xor(block_max, 1));",
        "block_max = max(block_max, simd_shuffle_xor(block_max, 8));",
        "const float m_new = max(m, block_max);",
        "const float correction = exp2(m - m_new);  // 1 when the max holds, 0 when m was MASKED",
        "m = m_new;",
        "float block_sum = 0.0f;",
    ]
    lines += loop(f"int j = 0; j < {key_tiles}; ++j", loop("int e = 0; e < 2; ++e", [
        "const float p = s[j * 2 + e] > MASKED ? exp2(s[j * 2 + e] - m) : 0.0f;",
        "p_tile[j].thread_elements()[e] = p;",
        "block_sum += p;",
    ]))
    lines += [
        "block_sum += simd_shuffle_xor(block_sum, 1);",
        "block_sum += simd_shuffle_xor(block_sum, 8);",
        "l = l * correction + block_sum;",
    ]
    lines += loop(f"ushort t = 0; t < {_tiles(d.value_dim)}; ++t", [
        "o_tile[t].thread_elements()[0] *= correction;",
        "o_tile[t].thread_elements()[1] *= correction;",
    ])
    return lines


def _accumulate(d: KernelDescriptor, key_tiles: int) -> list[str]:
    """O += P V for the tiles that hold visible keys."""
    load_v = ["simdgroup_float8x8 v_tile;  // rows are keys, columns are value dims", "const uint col = t * 8 + tc;"]
    for e in (0, 1):
        value = f"float(v_head[{_index('key', d.v.strides[2], 'col')}{' + 1' if e else ''}])"
        if d.value_dim % 8:
            value = f"col{' + 1' if e else ''} < {d.value_dim} ? {value} : 0.0f"
        load_v.append(f"v_tile.thread_elements()[{e}] = {value};")
    load_v.append("simdgroup_multiply_accumulate(o_tile[t], p_tile[j], v_tile, o_tile[t]);")
    per_tile = ["const uint key = uint(min(kb + j * 8 + int(tr), int(C) - 1));"]
    per_tile += loop(f"ushort t = 0; t < {_tiles(d.value_dim)}; ++t", load_v)
    return (["", "// O += P V."]
            + loop(f"int j = 0; j < {key_tiles}; ++j", ["if (j < tiles) {"] + indent(per_tile) + ["}"]))


def _key_loop(d: KernelDescriptor) -> list[str]:
    key_tiles = d.key_block // 8
    body = [f"const int tiles = min({key_tiles}, (key_end - kb + 7) / 8);  // 8-key tiles holding keys < key_end"]
    body += _bias(d, key_tiles) + _scores(d, key_tiles) + _softmax(d, key_tiles) + _accumulate(d, key_tiles)
    return ["", f"for (int kb = key_begin; kb < key_end; kb += {d.key_block}) {{"] + indent(body) + ["}"]


def _partial_epilogue(d: KernelDescriptor) -> list[str]:
    """Split-KV: the split's unnormalized O and its (m, l), for attention_combine."""
    store = ["const uint col = t * 8 + tc;"]
    for e in (0, 1):
        col = "col + 1" if e else "col"
        write = f"o_split[{col}] = o_tile[t].thread_elements()[{e}];"
        if d.value_dim % 8:
            write = f"if ({col} < {d.value_dim}) {{ {write} }}"
        store.append(write)
    body = ["const ulong at = ((ulong(split) * B + b) * Hq + h) * R + row;",
            f"device float* o_split = o_partial + at * {d.value_dim};"]
    body += loop(f"ushort t = 0; t < {_tiles(d.value_dim)}; ++t", store)
    body += ["if (tc == 0) {", "  ml_partial[at * 2] = m;", "  ml_partial[at * 2 + 1] = l;", "}"]
    return ["", "// This split's share: O before the division by l, and m, l.", "if (row < R) {"] + indent(body) + ["}"]


def _epilogue(d: KernelDescriptor) -> list[str]:
    if d.kv_split:
        return _partial_epilogue(d)
    t = MSL_TYPES[d.dtype]
    store = ["const uint col = t * 8 + tc;"]
    for e in (0, 1):
        col = "col + 1" if e else "col"
        write = f"o_row[{col}] = {t}(o_tile[t].thread_elements()[{e}] * inv_l);"
        if d.value_dim % 8:
            write = f"if ({col} < {d.value_dim}) {{ {write} }}"
        store.append(write)
    body = [f"device {t}* o_row = o_head + {offset('row', d.o.strides[2])};"]
    body += loop(f"ushort t = 0; t < {_tiles(d.value_dim)}; ++t", store)
    if d.return_lse:
        body += ["if (tc == 0) {",
                 "  lse[(ulong(b) * Hq + h) * R + row] = l > 0.0f ? (m + log2(l)) * LN2 : -INFINITY;",
                 "}"]
    return (["", "// O /= l; a row with nothing in its denominator stores 0 (and lse = -inf).",
             "const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;",
             "if (row < R) {"] + indent(body) + ["}"])


def _summary(d: KernelDescriptor) -> list[str]:
    window = "none" if d.window is None else f"(left {d.window[0]}, right {d.window[1]})"
    mask = d.mask if d.mask == "none" else f"{d.mask} ({d.mask_dtype})"
    lines = [f"{d.dtype}, D = {d.head_dim}, Dv = {d.value_dim}, GQA ratio {d.gqa_ratio}",
             f"causal {d.causal}, window {window}, mask {mask}"]
    if d.kv_split:
        lines.append("split-KV partial pass: one split of S per threadgroup, finished by attention_combine")
    else:
        lines[-1] += f", sinks {'yes' if d.sinks else 'no'}, lse {'yes' if d.return_lse else 'no'}"
    simdgroups = f"{d.simdgroups} simdgroup{'s' if d.simdgroups > 1 else ''}"
    lines.append(f"tiles ({d.family}): {d.query_rows} query rows per threadgroup ({simdgroups}), "
                 f"{d.key_block} keys per block, Q {'in registers' if d.cache_q else 're-read per block'}")
    return lines


@lru_cache(maxsize=256)
def generate(d: KernelDescriptor) -> KernelSource:
    """The MSL source and launch plan of the forward kernel described by `d` (the partial
    kernel of the split-KV pass when d.kv_split)."""
    plan = launch_plan(d)
    body = (_geometry(d) + _key_range(d) + _q_in_registers(d) + _init_state(d) + _key_loop(d) + _epilogue(d))
    declarations = constants(d.size_names, d.baked_sizes, "\n".join(body))
    lines = (header(plan.kernel_name, _summary(d), plan) + sizes_struct(plan) + signature(plan, BUILTINS)
             + ["{"] + indent(declarations + [""] + body) + ["}"])
    return KernelSource("\n".join(lines) + "\n", plan)
