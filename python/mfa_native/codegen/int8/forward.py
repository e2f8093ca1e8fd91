"""MSL for int8 attention's attention kernel: the dense forward kernel (attention_forward.py)
with integer products.

It reads what the quantizers stored (int8_quantize.py): Q and K as int8 with a scale per row,
with smooth_k each row's shift q . mean(k), with pv="int8" V as int8 with a scale and mean
per channel. One threadgroup holds `query_rows` query rows of one (batch, query head), each
simdgroup 8 of them, walking the keys in blocks of exactly P_BLOCK, aligned from key 0 (the
visible range's first block starts at a multiple of P_BLOCK). Per block:

  1. allowed keys and the additive mask (masking.bias_over_keys);
  2. S = Q K^T in exact integers (int8_products), then the logits S * q_scale * k_scale,
     times scale * log2(e), through the score transforms (softcap, ALiBi), plus the mask;
     with smooth_k the row's shift q . mean(k) is left out here (it is the same for every
     key of the row, see _shift), unless a score transform needs the true score
     (_shift_in_scores);
  3. pv="float": the dense kernel's online softmax and O += P V (V in its dtype, P float32);
     pv="int8": P quantized against the block's own maximum logit, round(127 * exp2(s -
     block_max)) in 0..127, its integers summed into the denominator, the block's P V in
     exact integers (int8_products), and both scaled into the running l and O by
     exp2(block_max - m) / 127 (the usual online-softmax rescale keeps m the running max).

The finish is the dense kernel's (`Normalized`: O / l, lse, the sink's initial state); with
pv="int8", O first gets V's scale per channel and its mean times the real keys' mass (l
without the sink's share). The results are those of the unshifted logits: with smooth_k
the sink enters less the row's shift and m gets the shift back before lse is stored (or,
with a score transform, each score carries the shift).
"""

from __future__ import annotations

from functools import lru_cache

from ..attention import operands
from ..attention.forward import BUILTINS, Normalized
from ..attention.forward import summary as dense_summary
from ..attention.masking import bias_over_keys, key_range, mask_row_pointer
from ..attention.rows import query_rows_geometry, row_index, threadgroup_span
from ..attention.scores import Element, buffers, element, setup
from ..attention.softmax import logits, online_softmax
from ..kernel.msl import MSL_TYPES, float_literal, loop
from ..kernel.accumulators import Accumulator
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.products import TENSOR_OPS, RowsView, ThreadgroupProducts, device_rows
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from ..kernel.tiles import HeadTensor, Positions, accumulate, block_loop, head_pointer, tiles, zeroed
from . import operands as int8_operands
from .attended import flag_operands, key_flags, limits_keys
from .problem import Int8Descriptor
from .products import INT8_MAX, INT8_TILE, P_BLOCK, int8_products

KERNEL_NAME = "int8_attention_forward"
KEY_TILES = P_BLOCK // 8


def _keys_mass(x: Int8Descriptor) -> str:
    """pv="int8": the running sum of the real keys' P (V's mean comes back with it); l itself
    without sinks."""
    return "l_keys" if x.attention.sinks else "l"


def launch_plan(x: Int8Descriptor) -> LaunchPlan:
    d = x.attention
    queries = ("q_int8", "q_scale") + (("q_shift",) if x.smooth_k else ())
    values = ("v_int8", "v_scale", "v_mean") if x.pv == "int8" else ()
    flags = flag_operands(x) if x.pv == "float" else []
    ops = (int8_operands.reads(x, *queries, "k_int8", "k_scale", *values) + flags
           + operands.reads(d, *(("v",) if x.pv == "float" else ()), "mask", *buffers(d.scores))
           + Normalized.results(d) + operands.sizes(d))
    grid = (GridAxis(Extent(1, ("R",)), d.query_rows), GridAxis(Extent(1, ("Hq",))), GridAxis(Normalized.grid_z))
    return LaunchPlan(KERNEL_NAME, tuple(ops), grid, 32 * d.simdgroups, d.sizes)


def _int8_tensor(x: Int8Descriptor, name: str) -> HeadTensor:
    width = x.attention.value_dim if name == "v_int8" else x.attention.head_dim
    return HeadTensor.of(name, int8_operands.layout(name, x), width)


def _products(x: Int8Descriptor) -> ThreadgroupProducts | None:
    """With tensor ops (the descriptor's products), the integer products of the whole threadgroup:
    int8 operands, exact int32 sums (None: simdgroup matrices of half tiles, int8_products)."""
    d = x.attention
    return ThreadgroupProducts(d.simdgroups, P_BLOCK, "char", "int") if d.products == TENSOR_OPS else None


def _rows(x: Int8Descriptor, name: str, first: str, rows: str) -> tuple[list[str], RowsView]:
    """The lines that define `{name}_rows` (`rows` rows of int8 tensor `name` from row `first`,
    in place) and its view."""
    return device_rows(f"{name}_rows", head=f"{name}_int8_head", element="char", first=first, rows=rows,
                       layout=int8_operands.layout(f"{name}_int8", x), width=_int8_tensor(x, f"{name}_int8").width)


def _q_rows(x: Int8Descriptor) -> tuple[list[str], RowsView]:
    """The threadgroup's Q rows in place (tensor ops)."""
    first = "q_first - simd_index * 8"
    return _rows(x, "q", first, f"clamp(int(R) - int({first}), 0, {x.attention.query_rows})")


def _step_rows(x: Int8Descriptor, name: str, end: str) -> tuple[list[str], RowsView]:
    """The step's rows of int8 K or V (`name`): from key kb, at most a block, below `end`."""
    return _rows(x, name, "kb", f"min(int({end}) - kb, {P_BLOCK})")


def _geometry(x: Int8Descriptor) -> list[str]:
    d = x.attention
    lines = query_rows_geometry(d.query_rows, d.gqa_ratio, Normalized.batch) + [
        "",
        head_pointer("q_int8", int8_operands.layout("q_int8", x), "h", "char", True),
        head_pointer("k_int8", int8_operands.layout("k_int8", x), "h_kv", "char", True),
        head_pointer("v_int8", int8_operands.layout("v_int8", x), "h_kv", "char", True) if x.pv == "int8"
        else head_pointer("v", d.v, "h_kv", MSL_TYPES[d.dtype], True),
        f"const float row_scale = q_scale[{row_index('row_read')}];",
    ]
    if x.smooth_k:
        lines.append(f"const float row_shift = q_shift[{row_index('row_read')}];  // q . mean(k)")
    lines.append("device const float* key_scales = k_scale + (ulong(b) * Hkv + h_kv) * C;")
    lines += key_flags(x, "h_kv") if x.pv == "float" else []
    if d.rules.mask != "none":
        lines.append(mask_row_pointer(d.rules))
    return lines


def _q_tiles(x: Int8Descriptor) -> list[str]:
    """The simdgroup's 8 rows of Q as int8 tiles, in registers (half the space of float tiles);
    with tensor ops, the products' memory and the threadgroup's Q rows in place."""
    products = _products(x)
    if products is not None:
        return products.declare() + _q_rows(x)[0]
    count = tiles(x.attention.head_dim)
    load = _int8_tensor(x, "q_int8").load_rows("q_tile[i]", "row_read", "i")
    return (["", f"// Q: 8 rows x {x.attention.head_dim} int8 values, held in registers.",
             f"{INT8_TILE} q_tile[{count}];"] + loop(f"ushort i = 0; i < {count}; ++i", load))


def _scores(x: Int8Descriptor, end: str) -> list[str]:
    """p_tile = the logits' scores of the block: exact integer Q K^T, then times the rows' and
    keys' scales, plus the row's shift with smooth_k. Reads q_tile, kb, `end`."""
    k = _int8_tensor(x, "k_int8")
    lines = ["", "// S = Q K^T in exact integers: int8 tiles, float32 sums below 2**24."]
    lines += zeroed("p_tile", KEY_TILES, "integer scores, then scores, then probabilities")
    products = _products(x)
    if products is not None:
        declared, keys = _step_rows(x, "k", end)
        lines += declared + products.scores("p_tile", lhs=_q_rows(x)[1], rhs=keys, count=KEY_TILES)
    else:
        lines += int8_products("p_tile", left="q_tile", inner=tiles(x.attention.head_dim), outer=KEY_TILES,
                               visible="o < tiles", load_right=lambda tile: k.load_transposed(
                                   tile, "key", "kb + o * 8", Positions(end), "i"))
    shifted = _shift_in_scores(x)
    lines += ["", "// The scores, dequantized" + (" (without the row's shift q . mean(k): see _shift)."
                                               if x.smooth_k and not shifted else ".")]
    lines += loop(f"int j = 0; j < {KEY_TILES}; ++j", loop("int e = 0; e < 2; ++e", [
        f"const float key_scale = key_scales[min(kb + j * 8 + int(tc) + e, {end} - 1)];",
        "p_tile[j].thread_elements()[e] = p_tile[j].thread_elements()[e] * (row_scale * key_scale)"
        + (" + row_shift;  // the true score, for the score transforms (softcap is not shift-invariant)"
           if shifted else ";"),
    ]))
    return lines


def _shift_in_scores(x: Int8Descriptor) -> bool:
    """smooth_k with score transforms: the row's shift joins each score before the chain, which
    must see the true score (softcap's c * tanh(s / c) of s + shift is not that of s, plus shift)."""
    return x.smooth_k and bool(x.attention.scores)


def _shift(x: Int8Descriptor, sign: str) -> list[str]:
    """smooth_k: the logits are those of the unshifted scores, S + q . mean(k), but the shift is
    the same for every key of a row, so the softmax and P's quantization blocks run without it
    (float32 logits then round at their own size, not the shift's) and only what competes with
    the keys or leaves the kernel carries it: the sink enters less the shift (`sign` "-"), and m
    gets it back before lse is stored ("+"). A MASKED m (no key, no sink) stays MASKED. Nothing
    when the scores carry the shift (_shift_in_scores)."""
    if not x.smooth_k or _shift_in_scores(x):
        return []
    shift = f"row_shift * {x.attention.scale_log2e}"
    if sign == "-":
        return [f"m -= {shift};  // the sink, against the keys' logits without the row's shift"] if x.attention.sinks \
            else []
    return ["", f"m += {shift};  // lse of the unshifted logits"]


def _float_values(x: Int8Descriptor, end: str) -> list[str]:
    """pv="float": the dense kernel's online softmax and O += P V, V's rows of keys no query
    attends read as 0 (their P is 0, and a NaN there must not make 0 * NaN)."""
    d = x.attention
    lines = online_softmax(d, KEY_TILES, at=_element(x)) + ["", "// O += P V."]
    kept = "key_attended" if limits_keys(x) else None
    return lines + accumulate("o_tile", weights="p_tile", count=KEY_TILES, rhs=HeadTensor.of("v", d.v, d.value_dim),
                              rhs_tile="v_tile", rhs_comment="rows are keys, columns are value dims", position="key",
                              first="kb", positions=Positions(end, kept=kept))


def _int8_values(x: Int8Descriptor, end: str) -> list[str]:
    """pv="int8": P quantized against the block's maximum, its integers as the denominator's
    share, the block's P V in exact integers, both scaled into l and O."""
    d = x.attention
    mass = _keys_mass(x)
    lines = ["", "// P against the block's own maximum logit: integers 0..127, the maximum itself 127.",
             "float block_max = MASKED;"]
    lines += logits(d, KEY_TILES, "p_tile", ["block_max = max_nan(block_max, s[i]);"], at=_element(x))
    lines += ["block_max = max_nan(block_max, simd_shuffle_xor(block_max, 1));",
              "block_max = max_nan(block_max, simd_shuffle_xor(block_max, 8));",
              f"{INT8_TILE} p_int8[{KEY_TILES}];",
              "float block_sum = 0.0f;  // of the block's integers: they make the denominator"]
    lines += loop(f"int j = 0; j < {KEY_TILES}; ++j", loop("int e = 0; e < 2; ++e", [
        "const float s_e = s[j * 2 + e];",
        f"const float p = s_e != MASKED ? rint({float_literal(INT8_MAX)} * exp2(s_e - block_max)) : 0.0f;",
        "p_int8[j].thread_elements()[e] = p;",
        "block_sum += p;",
    ]))
    lines += [
        "block_sum += simd_shuffle_xor(block_sum, 1);",
        "block_sum += simd_shuffle_xor(block_sum, 8);",
        "const float m_new = max_nan(m, block_max);  // a NaN logit makes the row NaN",
        "const float correction = exp2(m - m_new);",
        f"const float unit = exp2(block_max - m_new) * {float_literal(1.0 / INT8_MAX)};  // of one integer of P",
        "m = m_new;",
        "l = l * correction + unit * block_sum;",
    ]
    if mass != "l":
        lines.append(f"{mass} = {mass} * correction + unit * block_sum;")
    v = _int8_tensor(x, "v_int8")
    lines += ["", "// This block's P V in exact integers (64 * 127 * 127 < 2**24), then scaled into O."]
    lines += zeroed("pv_int", tiles(d.value_dim), "integer P V of this block")
    products = _products(x)
    if products is not None:
        declared, values = _step_rows(x, "v", end)
        lines += declared + products.weighted_sum("pv_int", weights="p_int8", count=KEY_TILES, rhs=values,
                                       accumulator=Accumulator("pv_int", d.value_dim))
    else:
        lines += int8_products("pv_int", left="p_int8", inner=KEY_TILES, outer=tiles(d.value_dim),
                               visible="i < tiles", load_right=lambda tile: Positions(end).declare(
                                   "key", "kb + i * 8 + int(tr)") + v.load_rows(tile, "key", "o"))
    lines += loop(f"ushort t = 0; t < {tiles(d.value_dim)}; ++t", [
        f"o_tile[t].thread_elements()[{e}] = o_tile[t].thread_elements()[{e}] * correction"
        f" + unit * pv_int[t].thread_elements()[{e}];" for e in (0, 1)])
    return lines


def _element(x: Int8Descriptor) -> Element:
    """Where the lane's element of the block lies, for the score transforms (ALiBi)."""
    return element(x.attention, "int(row)", "kb + j * 8 + int(tc) + e")


def _restore_values(x: Int8Descriptor) -> list[str]:
    """pv="int8": O = v_scale * O + v_mean * (the real keys' mass), per channel."""
    d = x.attention
    width = d.value_dim
    body = ["const uint col = t * 8 + tc;"]
    for e in (0, 1):
        c = f"min(col + {e}, {width - 1}u)"
        body.append(f"o_tile[t].thread_elements()[{e}] = o_tile[t].thread_elements()[{e}] * value_scales[{c}]"
                    f" + value_means[{c}] * {_keys_mass(x)};")
    return (["", "// V's scale per channel, and its mean with the real keys' mass (not the sink's).",
             f"device const float* value_scales = v_scale + (ulong(b) * Hkv + h_kv) * {width};",
             f"device const float* value_means = v_mean + (ulong(b) * Hkv + h_kv) * {width};"]
            + loop(f"ushort t = 0; t < {tiles(width)}; ++t", body))


def _key_steps(x: Int8Descriptor, end: str) -> list[str]:
    d = x.attention
    # A block a mask removes for the simdgroup's rows is skipped by it, unless the threadgroup's
    # tensor ops need every simdgroup at each product.
    body = bias_over_keys(d.rules, KEY_TILES, end, skip_here=_products(x) is None) + _scores(x, end)
    body += _int8_values(x, end) if x.pv == "int8" else _float_values(x, end)
    return block_loop("kb", "key_begin", end, P_BLOCK, body)


def _summary(x: Int8Descriptor) -> list[str]:
    d = x.attention
    dense = dense_summary(d, Normalized)   # the dense kernel's: sizes, then the masking rules, then tiles
    return [f"int8 attention, smooth_k {'yes' if x.smooth_k else 'no'}, pv {x.pv}: {dense[0]}", dense[1],
            f"tiles ({d.gpu_family}): {d.query_rows} query rows per threadgroup, blocks of {P_BLOCK} keys from key 0"
            + ("; integer products: Metal 4 tensor ops (matmul2d, int32 sums)" if _products(x) else "")]


@lru_cache(maxsize=128)
def generate_int8(x: Int8Descriptor) -> KernelSource:
    """The MSL source and launch plan of int8 attention's attention kernel."""
    d = x.attention
    align = [f"key_begin = key_begin / {P_BLOCK} * {P_BLOCK};  // P's blocks are aligned from key 0"]
    state = ["", "// Online softmax state of the lane's row (log2 domain) and its output accumulator."]
    state += Normalized.initial_state(d) + _shift(x, "-")
    if x.pv == "int8" and _keys_mass(x) != "l":
        state.append("float l_keys = 0.0f;  // l without the sink's share")
    state += zeroed("o_tile", tiles(d.value_dim), "O, unnormalized")
    finish = (_restore_values(x) if x.pv == "int8" else []) + _shift(x, "+") + Normalized.store(d)
    keys = key_range(d.rules, **threadgroup_span("q_first", d.query_rows, "R", _products(x) is not None))
    body = _geometry(x) + keys + align + _q_tiles(x) + state + setup(d) + _key_steps(x, "key_end") + finish
    return assemble(launch_plan(x), summary=_summary(x), builtins=BUILTINS, body=body)
