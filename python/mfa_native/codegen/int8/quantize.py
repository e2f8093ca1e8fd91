"""MSL for int8 attention's quantizers: the kernels of its pass that run before the attention
kernel, turning q, k and v into int8 values and float32 scales (and means) in device memory.

- `int8_attended_keys` (a masking rule; attended.py): which keys some query may attend;
- `int8_key_mean` (smooth_k): k's mean over the attended keys, per (batch, kv head, channel);
- `int8_quantize_k`: k (minus that mean) as int8, one scale per row or per K_TILE_ROWS rows;
- `int8_quantize_q`: q as int8, one scale per row or per Q_TILE_ROWS rows, and with smooth_k
  each row's shift q . mean(k), from the float q;
- `int8_quantize_v` (pv="int8"): v's mean per channel, and v minus it as int8 with one
  scale per channel.

A scale is absmax / 127 over the values it covers (float32, IEEE division), a value
quantize_int8(x, scale) = clamp(rint(x / scale), -127, 127) of the exact quotient (its float32
rounding may cross a half-way point: fma decides). Scales are stored per row, the
rows of a tile sharing one value. A NaN makes its absmax (max_nan), so its scale, NaN: it
reaches every logit (or, for v, every output channel) that the scale covers. Means are
compensated sums divided by C, kept as two floats (mean and mean_low) that add up to the
mean to float64's precision, so a centered value is the float32 of the exact x - mean, as a
float64 emulation has it (a float32 mean would move every centered value of a channel
with a large mean by up to half its ulp, enough to flip integers).

Every statistic of K and V (means, scales) covers the attended keys only; a key no query
attends is stored as integers 0 (with none attended, the means are 0).

Row quantizers: one simdgroup per scale, its lanes over the features of the scale's rows.
Column kernels: one thread per channel, walking the keys in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..attention import operands
from ..kernel.layouts import OperandLayout
from ..kernel.msl import BUILTINS_LANE, MSL_TYPES, float_literal, indent, loop
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from ..kernel.tiles import head_pointer, index
from . import operands as int8_operands
from .attended import attended, flag_operands, generate_attended, key_flags, limits_keys
from .problem import Int8Descriptor
from .products import INT8_MAX

KEY_MEAN_KERNEL = "int8_key_mean"
QUANTIZE_Q_KERNEL = "int8_quantize_q"
QUANTIZE_K_KERNEL = "int8_quantize_k"
QUANTIZE_V_KERNEL = "int8_quantize_v"
SIMD_WIDTH = 32


def _reduce_lanes(name: str, op: str) -> list[str]:
    """`name` = op over the 32 lanes of the simdgroup (shuffles, so NaN stays with max_nan)."""
    return [f"{name} = {op}({name}, simd_shuffle_xor({name}, {m}));" for m in (1, 2, 4, 8, 16)]


@dataclass(frozen=True)
class _RowSource:
    """What a row quantizer reads: tensor `name` of (batch, head) rows of `length`, `rows`
    per scale; with `centered`, k's mean (k_mean and k_mean_low) is subtracted first; with
    `kept` (a condition on row `first + r`), the rows where it is false count as 0."""

    name: str
    layout: OperandLayout
    heads: str
    length: str
    rows: int
    centered: bool
    kept: str | None


def _value(raw: str, mean: tuple[str, str] | None, kept: str | None) -> tuple[list[str], str, str]:
    """(lines defining it, hi, lo): the value `raw` as two floats, its mean (the expressions of
    its two parts) subtracted exactly (minus_mean) when given, else (raw, 0); both 0 where
    `kept`, if given, is false (a key no query attends: its values reach no statistic)."""
    if mean is None:
        return ([], raw, "0.0f") if kept is None else ([f"const float value = {kept} ? {raw} : 0.0f;"], "value", "0.0f")
    value = f"minus_mean({raw}, {mean[0]}, {mean[1]})"
    value = value if kept is None else f"{kept} ? {value} : float2(0.0f)"
    return [f"const float2 value = {value};"], "value.x", "value.y"


def _row_plan(x: Int8Descriptor, kernel: str, src: _RowSource, results: tuple[str, ...]) -> LaunchPlan:
    d = x.attention
    mean = int8_operands.reads(x, "k_mean", "k_mean_low") if x.smooth_k else []
    flags = flag_operands(x) if src.kept else []
    ops = operands.reads(d, src.name) + flags + mean + int8_operands.writes(x, *results) + operands.sizes(d)
    grid = (GridAxis(Extent(1, (src.length,)), src.rows), GridAxis(Extent(1, (src.heads,))),
            GridAxis(Extent(1, ("B",))))
    return LaunchPlan(kernel, tuple(ops), grid, SIMD_WIDTH, d.sizes)


def _row_quantizer(x: Int8Descriptor, kernel: str, src: _RowSource, ints: str, scales: str,
                   shift: str | None) -> KernelSource:
    """The row quantizer of `src` into `ints` and `scales`; `shift` (q with smooth_k) also
    stores each row's q . k_mean there."""
    d = x.attention
    t, width, n = MSL_TYPES[d.dtype], d.head_dim, src.name
    kv_head = f"h / {d.gqa_ratio}" if src.heads == "Hq" and d.gqa_ratio > 1 else "h"
    raw = f"float({n}_head[{index('first + r', src.layout.strides[2], 'c')}])"
    decl, hi, lo = _value(raw, ("mean[c]", "mean_low[c]") if src.centered else None, src.kept)
    value = f"{hi} + {lo}" if src.centered else hi
    body = [f"// Rows [first, first + rows) of (batch b, head h): {src.rows} per scale, aligned from row 0.",
            "const uint b = group.z;", "const uint h = group.y;",
            f"const uint first = group.x * {src.rows};",
            f"const uint rows = min({src.rows}u, {src.length} - first);",
            head_pointer(n, src.layout, "h", t, True)]
    if x.smooth_k:
        body += [f"device const float* mean = k_mean + (ulong(b) * Hkv + {kv_head}) * {width};",
                 f"device const float* mean_low = k_mean_low + (ulong(b) * Hkv + {kv_head}) * {width};"]
    body += key_flags(x, "h") if src.kept else []
    body += [f"const ulong row_at = (ulong(b) * {src.heads} + h) * {src.length} + first;  // of the first row",
             "", "// absmax over the rows' values: the scale."]
    per_value = loop(f"uint c = lane; c < {width}; c += {SIMD_WIDTH}",
                     decl + [f"absmax = max_nan(absmax, abs({value}));"], unroll=False)
    body += ["float absmax = 0.0f;"] + loop("uint r = 0; r < rows; ++r", per_value, unroll=False)
    body += _reduce_lanes("absmax", "max_nan")
    body += [f"const float scale = precise::divide(absmax, {float_literal(INT8_MAX)});  // NaN when a value is: it carries on",
             "", "// The values as int8, and the scale once per row."]
    quantize = loop(f"uint c = lane; c < {width}; c += {SIMD_WIDTH}",
                    decl + [f"{ints}[(row_at + r) * {width} + c] = quantize_int8({hi}, {lo}, scale);"], unroll=False)
    body += loop("uint r = 0; r < rows; ++r", quantize, unroll=False)
    body += loop(f"uint r = lane; r < rows; r += {SIMD_WIDTH}", [f"{scales}[row_at + r] = scale;"], unroll=False)
    if shift is not None:
        dot = ["float dot = 0.0f;"]
        dot += loop(f"uint c = lane; c < {width}; c += {SIMD_WIDTH}", [f"dot += {raw} * mean[c];"], unroll=False)
        dot += ["dot = simd_sum(dot);", "if (lane == 0) {", f"  {shift}[row_at + r] = dot;", "}"]
        body += ["", "// smooth_k: each row's logits shift by scale * q . mean(k), from the float q."]
        body += loop("uint r = 0; r < rows; ++r", dot, unroll=False)
    results = (ints, scales) + ((shift,) if shift else ())
    plan = _row_plan(x, kernel, src, results)
    what = f"{src.rows} rows" if src.rows > 1 else "row"
    summary = [f"int8 quantizer of {n}: {d.dtype}, D = {width}, one scale per {what}"
               + (", minus k's mean" if src.centered else "") + (", and q . mean(k)" if shift else "")]
    return assemble(plan, summary=summary, builtins=BUILTINS_LANE, body=body)


@lru_cache(maxsize=64)
def generate_quantize_q(x: Int8Descriptor) -> KernelSource:
    src = _RowSource("q", x.attention.q, "Hq", "R", x.q_rows_per_scale, centered=False, kept=None)
    return _row_quantizer(x, QUANTIZE_Q_KERNEL, src, "q_int8", "q_scale", "q_shift" if x.smooth_k else None)


@lru_cache(maxsize=64)
def generate_quantize_k(x: Int8Descriptor) -> KernelSource:
    src = _RowSource("k", x.attention.k, "Hkv", "C", x.k_rows_per_scale, centered=x.smooth_k,
                     kept=attended(x, "first + r"))
    return _row_quantizer(x, QUANTIZE_K_KERNEL, src, "k_int8", "k_scale", None)


def _mean(kept: str | None) -> list[str]:
    """mean and mean_low from sum and lost: over the C keys, or over the kept_keys that `kept`
    counted (0 when there is none)."""
    if kept is None:
        n = "float(C)"
        return [f"const float mean = precise::divide(sum + lost, {n});",
                f"const float mean_low = precise::divide(fma(-mean, {n}, sum) + lost, {n});  // what it missed"]
    n = "float(kept_keys)"
    return [f"const float mean = kept_keys > 0 ? precise::divide(sum + lost, {n}) : 0.0f;  // no attended key: 0",
            f"const float mean_low = kept_keys > 0 ? precise::divide(fma(-mean, {n}, sum) + lost, {n}) : 0.0f;"]


def _column_kernel(x: Int8Descriptor, kernel: str, name: str, means: tuple[str, ...],
                   quantized: tuple[str, str] | None) -> KernelSource:
    """Per (batch b, kv head h) and channel: the mean of tensor `name` over the attended keys
    (attended.py; all C when no rule removes keys), as float32 `mean` and the rest `mean_low`
    (the two add up to the mean to float64's precision), stored in `means` (mean, and mean_low
    if named); with `quantized` = (ints, scales), also its values minus the mean as int8, one
    scale per channel over the attended keys (the others store 0). Centering with both parts
    makes the centered values the float32 of the exact ones, as a float64 reference has them."""
    d = x.attention
    layout, width = (d.k, d.head_dim) if name == "k" else (d.v, d.value_dim)
    value = f"float({name}_head[{index('j', layout.strides[2], 'c')}])"
    keys = "uint j = 0; j < C; ++j"
    kept = attended(x, "j")
    read, kept_value, _ = _value(value, None, kept)
    inner = [head_pointer(name, layout, "h", MSL_TYPES[d.dtype], True), *key_flags(x, "h"),
             f"const ulong at = (ulong(b) * Hkv + h) * {width} + c;",
             "// The sum over the keys, compensated (Neumaier): the mean is the float32 of the exact",
             "// mean, whatever C, as a float64 reference computes it.",
             "float sum = 0.0f;",
             "float lost = 0.0f;  // what the float32 additions rounded away"]
    inner += ["uint kept_keys = 0;  // the attended keys, which the mean is over"] if kept else []
    inner += loop(keys, read + [f"const float x = {kept_value};", "const float next = sum + x;",
                                "lost += abs(sum) >= abs(x) ? (sum - next) + x : (x - next) + sum;",
                                "sum = next;"] + ([f"kept_keys += uint({kept});"] if kept else []), unroll=False)
    inner += _mean(kept)
    inner += [f"{buffer}[at] = {part};" for buffer, part in zip(means, ("mean", "mean_low"))]
    if quantized is not None:
        ints, scales = quantized
        inner += ["", "// The channel minus its mean: absmax over the keys, then the int8 values.",
                  "float absmax = 0.0f;"]
        decl, hi, lo = _value(value, ("mean", "mean_low"), kept)
        inner += loop(keys, decl + [f"absmax = max_nan(absmax, abs({hi} + {lo}));"], unroll=False)
        inner += [f"const float scale = precise::divide(absmax, {float_literal(INT8_MAX)});", f"{scales}[at] = scale;",
                  f"device char* ints = {ints} + (ulong(b) * Hkv + h) * C * {width};"]
        inner += loop(keys, decl + [f"ints[ulong(j) * {width} + c] = quantize_int8({hi}, {lo}, scale);"],
                      unroll=False)
    body = ["// One channel c of (batch b, kv head h) per thread.", "const uint b = group.z;",
            "const uint h = group.y;", f"const uint c = group.x * {SIMD_WIDTH} + lane;"]
    body += [f"if (c < {width}) {{"] + indent(inner) + ["}"] if width % SIMD_WIDTH else inner
    results = means + (quantized or ())
    ops = operands.reads(d, name) + flag_operands(x) + int8_operands.writes(x, *results) + operands.sizes(d)
    grid = (GridAxis(Extent(width), SIMD_WIDTH), GridAxis(Extent(1, ("Hkv",))), GridAxis(Extent(1, ("B",))))
    plan = LaunchPlan(kernel, tuple(ops), grid, SIMD_WIDTH, d.sizes)
    over = "the attended keys" if kept else "the keys"
    summary = [f"int8 attention: {name}'s mean over {over} per channel" + (
        ", and its values minus the mean as int8, one scale per channel" if quantized else "") + f", {d.dtype}"]
    return assemble(plan, summary=summary, builtins=BUILTINS_LANE, body=body)


@lru_cache(maxsize=64)
def generate_key_mean(x: Int8Descriptor) -> KernelSource:
    return _column_kernel(x, KEY_MEAN_KERNEL, "k", ("k_mean", "k_mean_low"), None)


@lru_cache(maxsize=64)
def generate_quantize_v(x: Int8Descriptor) -> KernelSource:
    return _column_kernel(x, QUANTIZE_V_KERNEL, "v", ("v_mean",), ("v_int8", "v_scale"))


def quantizer_kernels(x: Int8Descriptor) -> tuple[KernelSource, ...]:
    """The quantizers of `x`, in the order they must run (which keys are attended, then the
    means)."""
    return ((generate_attended(x),) if limits_keys(x) else ()) + ((generate_key_mean(x),) if x.smooth_k else ()) \
        + (generate_quantize_k(x), generate_quantize_q(x)) + ((generate_quantize_v(x),) if x.pv == "int8" else ())
