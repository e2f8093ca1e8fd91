"""The lightning indexer's scores of a block of keys, as MSL lines (one simdgroup):

    score[c] = sum_h weights[b, h, r] * relu(q[b, h, r] . k[b, 0, c]),  in float32.

The indexer heads are the rows of the 8x8 tiles (Q of 8 heads times K^T of 8 keys), so every
key row is read once per 8 heads; the weighted sum over heads is a sum over tile rows (lanes
differing in bits 1, 2 and 4), in one fixed order, so a score does not depend on the kernel's
geometry. Heads past Hi add exactly 0 (not 0 times their product, which could be NaN).

precision="int8": every q row (head, query) and every key row is quantized per token as the
int8 attention's quantizers do (scale = absmax / 127, `quantize_int8`: the integer nearest
the exact quotient), in registers: nothing quantized is stored. The tiles then hold integers,
whose products float32 sums exactly while Di * 127**2 < 2**24 (`check_exact`), and a head's
product is dequantized as float(q . k) * q_scale * k_scale before relu and its weight.
"""

from __future__ import annotations

from ..kernel.msl import MSL_TYPES, float_literal, indent, loop
from ..kernel.tiles import HeadTensor, Positions, element_offset, lane_layout, tiles, zeroed


PRECISIONS = ("float", "int8")
INT8_MAX = 127


def check_exact(head_dim: int) -> None:
    """int8 scores are exact integers only while every partial sum stays below 2**24."""
    if head_dim * INT8_MAX ** 2 >= 2 ** 24:
        raise ValueError(f"precision='int8' needs Di * 127**2 < 2**24 (Di <= 1040), got Di = {head_dim}")


def _scale(name: str, masks: tuple[int, ...]) -> list[str]:
    """`name` (a lane's absmax) reduced over the lanes differing in `masks`, then / 127."""
    return ([f"{name} = max_nan({name}, simd_shuffle_xor({name}, {m}));" for m in masks]
            + [f"{name} = precise::divide({name}, {float_literal(INT8_MAX)});  // the token's scale"])


def _quantized(tile: str, scale) -> list[str]:
    """The lane's two elements of `tile` as int8 values (in float), element e by `scale(e)`."""
    return [f"{tile}.thread_elements()[{e}] = float(quantize_int8({tile}.thread_elements()[{e}], 0.0f, {scale(e)}));"
            for e in (0, 1)]


def head_scores(d, *, keys: int, first: str, end: str) -> list[str]:
    """Defines `column[keys / 4]`, the scores of keys `first` .. `first + keys - 1` (a multiple
    of 8), summed over the heads: after it, lanes with tr == 0 hold key `first + j * 8 + tc + e`
    in column[j * 2 + e] (`score_slots`). Keys at or past `end` (>= 1) read key end - 1: their
    scores are the caller's to discard. Reads b, r, lane, q, k, weights and Hi; defines tr, tc.
    `d` is the indexer's descriptor (topk.TopkDescriptor)."""
    t, key_tiles = MSL_TYPES[d.dtype], keys // 8
    q = HeadTensor("q_rows", d.q.strides[1], d.head_dim)
    k = HeadTensor("k_rows", d.k.strides[2], d.head_dim)
    body = [*lane_layout(),
            f"device const {t}* q_rows = q + ({element_offset(d.q, ('ulong(b)', 0), ('ulong(r)', 2))});  // row h: head h",
            f"device const {t}* k_rows = k + ({element_offset(d.k, ('ulong(b)', 0))});",
            f"float column[{2 * key_tiles}];  // the lane's two keys of every tile: summed over heads"]
    body += loop(f"ushort j = 0; j < {2 * key_tiles}; ++j", ["column[j] = 0.0f;"])
    int8 = d.precision == "int8"
    load_q = ["simdgroup_float8x8 q_tile;"] + q.load_rows("q_tile", "head_read", "i")
    load_k = ["simdgroup_float8x8 k_tile;"] + k.load_transposed("k_tile", "key", f"int({first}) + j * 8",
                                                                 Positions(end), "i")
    if int8:   # each key's scale: absmax over its features (tile rows: lanes differing in bits 1, 2, 4)
        body += [f"float k_scale[{2 * key_tiles}];"] + loop(f"ushort j = 0; j < {2 * key_tiles}; ++j",
                                                            ["k_scale[j] = 0.0f;"])
        body += loop(f"int j = 0; j < {key_tiles}; ++j", loop(f"ushort i = 0; i < {tiles(d.head_dim)}; ++i", load_k + [
            f"k_scale[j * 2 + {e}] = max_nan(k_scale[j * 2 + {e}], abs(k_tile.thread_elements()[{e}]));"
            for e in (0, 1)]))
        body += loop(f"ushort j = 0; j < {2 * key_tiles}; ++j", _scale("k_scale[j]", (2, 4, 16)))
    per_head_tile = [
        "const uint head = head_tile * 8 + tr;",
        "const uint head_read = min(head, Hi - 1);",
        f"const float weight = weights[{element_offset(d.weights, ('ulong(b)', 0), ('ulong(head_read)', 1), ('ulong(r)', 2))}];",
    ] + zeroed("s_tile", key_tiles, "Q K^T: 8 heads x 8 keys per tile")
    if int8:   # the head row's scale: absmax over its features (lanes differing in bits 0 and 3)
        per_head_tile += ["float q_scale = 0.0f;"] + loop(f"ushort i = 0; i < {tiles(d.head_dim)}; ++i", load_q + [
            f"q_scale = max_nan(q_scale, abs(q_tile.thread_elements()[{e}]));" for e in (0, 1)])
        per_head_tile += _scale("q_scale", (1, 8))
    per_feature = load_q + (_quantized("q_tile", lambda e: "q_scale") if int8 else [])
    per_key_tile = load_k + (_quantized("k_tile", lambda e: f"k_scale[j * 2 + {e}]") if int8 else [])
    per_key_tile.append("simdgroup_multiply_accumulate(s_tile[j], q_tile, k_tile, s_tile[j]);")
    per_feature += loop(f"int j = 0; j < {key_tiles}; ++j", per_key_tile)
    per_head_tile += loop(f"ushort i = 0; i < {tiles(d.head_dim)}; ++i", per_feature)
    per_head_tile += loop(f"int j = 0; j < {key_tiles}; ++j", loop("int e = 0; e < 2; ++e", [
        "const float s = s_tile[j].thread_elements()[e]" + (" * q_scale * k_scale[j * 2 + e];" if int8 else ";"),
        "if (head < Hi) {",
        "  column[j * 2 + e] += weight * (s < 0.0f ? 0.0f : s);  // relu, weighted; NaN stays NaN",
        "}"]))
    body += ["", f"// Scores of {keys} keys, 8 indexer heads at a time."]
    body += loop("uint head_tile = 0; head_tile * 8 < Hi; ++head_tile", per_head_tile, unroll=False)
    body += ["", "// The sum over heads: over the 8 rows of each tile (lanes that differ in bits 1, 2 and 4)."]
    body += loop(f"ushort j = 0; j < {2 * key_tiles}; ++j", [
        "column[j] += simd_shuffle_xor(column[j], 2);", "column[j] += simd_shuffle_xor(column[j], 4);",
        "column[j] += simd_shuffle_xor(column[j], 16);"])
    return body


def score_slots(keys: int, body: list[str]) -> list[str]:
    """`body` once per score a tr == 0 lane holds after `head_scores`: with `slot` (the key's
    place in the block, 0 .. keys - 1) and `score` defined."""
    per_score = ["const uint slot = j * 8 + tc + e;", "const float score = column[j * 2 + e];"] + body
    return ["if (tr == 0) {"] + indent(loop(f"int j = 0; j < {keys // 8}; ++j",
                                            loop("int e = 0; e < 2; ++e", per_score))) + ["}"]
