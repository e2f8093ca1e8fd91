"""The MSL of quantized storage formats (the formats themselves: mfa_native/quant_formats.py):
the code that decodes one group of values (`decode_group`) and that encodes one
(`encode_group`).

The encoder computes in float32 whatever the input dtype, as its origins do (MLX's CPU
quantizer; ggml's `quantize_row_q8_0_ref`, `_q4_0_ref`, `_q4_1_ref`, `_q5_0_ref` and
`_q5_1_ref`, which the `gguf` package mirrors), and divides with `precise::divide`, so Metal's rounding is IEEE's too.
A group holding NaN or +-inf has a NaN scale (affine: scale and bias) and integers 0.
"""

from __future__ import annotations

from ...quant_formats import AFFINE_EPS, GGUF_BLOCK, QuantFormat
from ..kernel.msl import float_literal, indent


def decode_group(f: QuantFormat, *, data: str, scale: str, bias: str | None, target: str, cast: str) -> list[str]:
    """MSL that stores the group's `group_size` values, converted to `cast`, at `target[0..]`.
    `data` points at the group's first element of `data` (a `device const uint*` for affine,
    `device const uchar*` for GGUF); `scale` and `bias` are the affine group's scale and bias
    (floats; GGUF reads its scale from the block). Every byte of the group is read once."""
    if f.affine:
        mask = f"{(1 << f.bits) - 1}u"
        return ["{  // a little-endian bit stream: each word read once, values may straddle words",
                "  ulong stream = 0;",
                "  uint held = 0;   // bits in stream",
                "  uint word = 0;",
                f"  for (uint i = 0; i < {f.group_size}u; ++i) {{",
                f"    if (held < {f.bits}u) {{",
                f"      stream |= ulong({data}[word++]) << held;",
                "      held += 32u;",
                "    }",
                f"    const float value = float(uint(stream) & {mask});",
                f"    stream >>= {f.bits}u;",
                f"    held -= {f.bits}u;",
                f"    {target}[i] = {cast}({scale} * value + {bias});",
                "  }",
                "}"]
    def half_at(byte: int) -> str:
        return f"float(as_type<half>(ushort(uint({data}[{byte}]) | (uint({data}[{byte + 1}]) << 8))))"

    head = [f"  const float d = {half_at(0)};"] + ([f"  const float m = {half_at(2)};"] if f.minimum else [])
    if f.name == "q8_0":
        body = [f"  {target}[i] = {cast}(d * float(as_type<char>({data}[2 + i])));"]
        count = GGUF_BLOCK
    else:
        high_bits, nibbles = f.block_layout
        if f.bits == 5:
            head.append("  const uint fifth = " + " | ".join(f"(uint({data}[{high_bits + b}]) << {8 * b})"
                                                             for b in range(4)) + ";   // bit i: value i's fifth bit")
        count = GGUF_BLOCK // 2
        fifth = {"i": " | (((fifth >> i) & 1u) << 4)", "i + 16": " | (((fifth >> (i + 16u)) & 1u) << 4)"}
        body = [f"  const uint packed = {data}[{nibbles} + i];"]
        for index, nibble in (("i", "packed & 15u"), ("i + 16", "packed >> 4")):
            q = f"({nibble}{fifth[index] if f.bits == 5 else ''})"
            value = f"d * float{q} + m" if f.minimum else f"d * (float{q} - {float(1 << (f.bits - 1))}f)"
            body.append(f"  {target}[{index}] = {cast}({value});")
    return (["{  // a GGUF block: float16 d (little-endian bytes), then the quantized values"] + head +
            [f"  for (uint i = 0; i < {count}u; ++i) {{"] + ["  " + line for line in body] + ["  }", "}"])


def encode_group(f: QuantFormat, *, values: str, data: str, scale: str | None, bias: str | None,
                 store: str) -> list[str]:
    """MSL that quantizes the group of `group_size` floats at `values[0..]` (a `device const T*`)
    into the group's `data` (its first element, `device uint*` for affine, `device uchar*`
    for GGUF), and, affine, its `scale` and `bias` (lvalues converted with `store`, the
    float dtype's MSL type). Every input value is read twice (a scan, then the codes), every
    output element written once. The inverse of `decode_group`, up to the rounding."""
    n = f"{f.group_size}u"
    if f.affine:
        scan = _scan(values, n, ["w_min = min(w_min, w);", "w_max = max(w_max, w);"],
                     ["float w_min = INFINITY;", "float w_max = -INFINITY;"])
        n_bins = f"{float((1 << f.bits) - 1)}f"
        return (["{  // MLX's affine quantization (mx.quantize), in float32"] + indent(scan + [
            "// The edge (the end of larger magnitude) quantizes to 0 exactly and 0 to an integer:",
            "// the scale's sign points from the edge into the group.",
            "const bool side = abs(w_min) > abs(w_max);",
            f"float scale = max(precise::divide(w_max - w_min, {n_bins}), {float_literal(AFFINE_EPS)});",
            "scale = side ? scale : -scale;",
            "const float edge = side ? w_min : w_max;",
            "const float q0 = rint(precise::divide(edge, scale));   // halfway cases to even, as std::rint",
            "float bias = 0.0f;",
            "if (q0 != 0.0f) {",
            "  scale = precise::divide(edge, q0);",
            "  bias = edge;",
            "}",
            "if (!finite) {",
            "  scale = NAN;",
            "  bias = NAN;",
            "}",
            f"{scale} = {store}(scale);",
            f"{bias} = {store}(bias);",
            "// The codes, as a little-endian bit stream: each word written once when full.",
            "ulong stream = 0;",
            "uint held = 0;   // bits in stream",
            "uint word = 0;",
            f"for (uint i = 0; i < {n}; ++i) {{",
            f"  const float q = rint(precise::divide(float({values}[i]) - bias, scale));",
            f"  stream |= ulong(finite ? uint(clamp(q, 0.0f, {n_bins})) : 0u) << held;",
            f"  held += {f.bits}u;",
            "  if (held >= 32u) {",
            f"    {data}[word++] = uint(stream);",
            "    stream >>= 32;",
            "    held -= 32u;",
            "  }",
            "}"]) + ["}"])
    if f.name == "q8_0":
        scan = _scan(values, n, ["amax = max(amax, abs(w));"], ["float amax = 0.0f;"])
        d = "precise::divide(amax, 127.0f)"
        codes = [f"for (uint i = 0; i < {n}; ++i) {{",
                 f"  const float q = round(float({values}[i]) * id);   // halfway cases away from zero, as roundf",
                 f"  {data}[2 + i] = finite && !isnan(q) ? as_type<uchar>(char(clamp(q, -127.0f, 127.0f))) : uchar(0);",
                 "}"]
    elif f.minimum:   # q4_1, q5_1: codes from the block's minimum up, in 2^bits - 1 steps
        scan = _scan(values, n, ["w_min = min(w_min, w);", "w_max = max(w_max, w);"],
                     ["float w_min = INFINITY;", "float w_max = -INFINITY;"])
        d = f"precise::divide(w_max - w_min, {float((1 << f.bits) - 1)}f)"
        # (x - min) * id >= 0: the max with -1 changes nothing but keeps the + 0.5 apart (below).
        codes = _nibble_codes(f, values, data, lambda v: f"max((float({v}) - w_min) * id, -1.0f) + 0.5f")
    else:             # q4_0, q5_0: d from the first value of largest magnitude, signed; codes around 2^(bits-1)
        scan = _scan(values, n, ["if (amax < abs(w)) {  // the first value of largest magnitude, signed",
                                 "  amax = abs(w);", "  max_value = w;", "}"],
                     ["float amax = 0.0f;", "float max_value = 0.0f;"])
        middle = 1 << (f.bits - 1)
        d = f"precise::divide(max_value, {float(-middle)}f)"
        # |x * id| <= 2^(bits-1): the max with twice that changes nothing but keeps the + middle apart.
        codes = _nibble_codes(f, values, data, lambda v: f"max(float({v}) * id, {float(-2 * middle)}f) + {middle + 0.5}f")
    minimum = (["const ushort m_bits = as_type<ushort>(finite ? half(w_min) : half(NAN));",
                f"{data}[2] = uchar(m_bits & 0xffu);", f"{data}[3] = uchar(m_bits >> 8);"] if f.minimum else [])
    return ([f"{{  // GGUF's {f.name} block (ggml's quantize_row_{f.name}_ref), in float32"] + indent(scan + [
        f"const float d = {d};",
        "const float id = d != 0.0f ? precise::divide(1.0f, d) : 0.0f;",
        "const ushort d_bits = as_type<ushort>(finite ? half(d) : half(NAN));   // float16, little-endian",
        f"{data}[0] = uchar(d_bits & 0xffu);",
        f"{data}[1] = uchar(d_bits >> 8);"] + minimum + codes) + ["}"])


def _nibble_codes(f: QuantFormat, values: str, data: str, level) -> list[str]:
    """The codes of a 4- or 5-bit GGUF block: value v's code is trunc(`level(v)`) (an MSL float,
    x * id rounded to float before the + 0.5 as the reference rounds it: the max in `level`
    keeps a compiler from contracting the two into one fma, which can truncate the other way),
    clamped to [0, 2^bits - 1], 0 for a non-finite block; value i's low four bits in the low
    nibble of byte i, value i + 16's in the high one, and (q5_*) the fifth bits in a uint32."""
    split, top = GGUF_BLOCK // 2, float((1 << f.bits) - 1)
    high_bits, nibbles = f.block_layout
    lines = [f"for (uint i = 0; i < {split}u; ++i) {{  // value i in the low nibble, i + {split} in the high",
             f"  const float low = trunc({level(f'{values}[i]')});",
             f"  const float high = trunc({level(f'{values}[i + {split}]')});",
             f"  const uint low_code = finite && !isnan(low) ? uint(clamp(low, 0.0f, {top}f)) : 0u;",
             f"  const uint high_code = finite && !isnan(high) ? uint(clamp(high, 0.0f, {top}f)) : 0u;",
             f"  {data}[{nibbles} + i] = uchar((low_code & 15u) | ((high_code & 15u) << 4));"]
    if f.bits == 4:
        return lines + ["}"]
    return (["uint fifth = 0u;   // bit i: value i's fifth bit"] + lines +
            ["  fifth |= ((low_code >> 4) << i) | ((high_code >> 4) << (i + 16u));", "}",
             "for (uint b = 0; b < 4u; ++b) {",
             f"  {data}[{high_bits} + b] = uchar(fifth >> (8u * b));   // little-endian",
             "}"])


def _scan(values: str, n: str, update: list[str], start: list[str]) -> list[str]:
    """The first read of the group: `update` folds each value w into the `start` accumulators;
    `finite` says whether every value was."""
    return (start + ["bool finite = true;", f"for (uint i = 0; i < {n}; ++i) {{",
                     f"  const float w = float({values}[i]);", "  finite = finite && isfinite(w);"]
            + indent(update) + ["}"])
