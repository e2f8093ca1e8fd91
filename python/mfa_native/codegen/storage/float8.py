"""A float8 k or v (an fp8 K/V cache): the storage facet's case `Float8Storage`, and the MSL
that decodes a stored byte and encodes a value (the formats: quant_formats.FLOAT8_FORMATS).

The data is one byte a value at the cache's own strides; value = decoded byte * descale,
descale a float32 per (batch, kv head) (`{name}_descale`, flash-attn 3's (B, Hkv), a single
factor bound with stride 0). Metal has no float8 type: a byte is decoded with integer
operations and `as_type` (e5m2 is the upper byte of a float16; e4m3fn's subnormals, its one
NaN code and no inf are spelled out), exactly, and rounded once to the problem's dtype after
the descale product. q's descale, when given, is folded into K's factor (S = q k^T is linear
in both): K's rows are decoded times q_descale * k_descale, a float32 product.

Encoding (the append kernels): x / descale in float32 (`precise::divide`), rounded to the
nearest float8, ties to even, from the float32's bits: e4m3fn saturates at +-448 (+-inf
included) and e5m2 overflows to +-inf, as torch's `.to()` does; NaN is 0x7f with x's sign.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...quant_formats import Float8Format
from ..kernel.layouts import OperandLayout, Strides
from ..kernel.msl import MSL_TYPES, offset
from ..kernel.tiles import head_pointer
from .facet import STORAGES, Storage, StorageFacts

DESCALE = "{}_descale"   # the (B, Hkv) float32 descale buffer of tensor k or v
QUERY_DESCALE = "q_descale"


def decode(f: Float8Format, byte: str, target: str) -> list[str]:
    """MSL defining float `target`: the value of `byte` (a uint expression, one stored byte), exact."""
    if f.exponent_bits == 5:   # e5m2: a float16's sign, exponent and two upper mantissa bits
        return [f"const float {target} = float(as_type<half>(ushort(({byte}) << 8u)));"]
    m, rebias = f.mantissa_bits, (127 - f.bias) << 23
    subnormal_unit = 2.0 ** (1 - f.bias - m)   # exact in float32
    return [f"const uint {target}_bits = {byte};",
            f"const uint {target}_magnitude = {target}_bits & 0x7Fu;",
            f"const float {target}_abs = {target}_magnitude == 0x7Fu ? NAN   // e4m3fn's NaN; it has no inf",
            f"    : {target}_magnitude < {1 << m}u ? float({target}_magnitude) * {subnormal_unit!r}f   // subnormal",
            f"    : as_type<float>(({target}_magnitude << {23 - m}u) + {rebias:#x}u);   // normal: exponent rebiased",
            f"const float {target} = ({target}_bits & 0x80u) != 0u ? -{target}_abs : {target}_abs;"]


def encode(f: Float8Format, value: str, target: str) -> list[str]:
    """MSL defining uint `target`: float `value` rounded to the nearest float8 code, ties to
    even (the subnormal range by `rint` of an exact power-of-two product, the normal range on
    the float32's bits), the largest magnitude `largest_code`, NaN 0x7f; the sign kept."""
    m, shift = f.mantissa_bits, 23 - f.mantissa_bits
    smallest_normal = (128 - f.bias) << 23   # float32 bits of 2^(1 - bias)
    return [f"const uint {target}_bits = as_type<uint>({value});",
            f"const uint {target}_magnitude = {target}_bits & 0x7FFFFFFFu;",
            f"uint {target}_unsigned;",
            f"if ({target}_magnitude > 0x7F800000u) {{",
            f"  {target}_unsigned = 0x7Fu;   // NaN",
            f"}} else if ({target}_magnitude < {smallest_normal:#x}u) {{   // below 2^{1 - f.bias}: multiples of "
            f"2^{1 - f.bias - m}",
            f"  {target}_unsigned = uint(rint(as_type<float>({target}_magnitude) * {float(2 ** (f.bias - 1 + m))!r}f));",
            "} else {   // round the mantissa to nearest even on the bits; a carry moves the exponent up",
            f"  const uint rounded = {target}_magnitude + {(1 << (shift - 1)) - 1}u + "
            f"(({target}_magnitude >> {shift}u) & 1u);",
            f"  {target}_unsigned = min((rounded >> {shift}u) - {(127 - f.bias) << m}u, {f.largest_code:#x}u);"
            "   // exponent rebiased; the largest code caps it",
            "}",
            f"const uint {target} = (({target}_bits >> 24u) & 0x80u) | {target}_unsigned;"]


@STORAGES.register
@dataclass(frozen=True)
class Float8Storage(Storage):
    """A float8 k or v: its format, the element strides of its bytes in logical (batch, head,
    sequence, -) order (the last axis contiguous), those of its descale (batch, kv head), and,
    for k, those of q's descale when one is given (folded into K's factor)."""

    float8: Float8Format
    data_strides: Strides
    descale_strides: tuple[int, int]
    query_descale_strides: tuple[int, int] | None = None

    packs_heads = True

    def describe(self, width: int, field: Callable[[int, Strides], OperandLayout]) -> Float8Facts:
        def factor(strides):
            return None if strides is None else field(1, (*strides, 0, 0))
        return Float8Facts(self.float8, field(width, self.data_strides), factor(self.descale_strides),
                           factor(self.query_descale_strides))


@dataclass(frozen=True)
class Float8Facts(StorageFacts):
    """What kernels reading or appending a float8 k or v depend on: its format and the
    layouts (logical (batch, kv head, key, -) order) of its bytes, its descale and q's."""

    float8: Float8Format
    data: OperandLayout
    descale: OperandLayout
    query_descale: OperandLayout | None

    def catalog(self, name: str) -> dict[str, tuple[str, str]]:
        """Its descale, and for k, q's descale when given."""
        fields = {DESCALE.format(name): ("float", f"(B, Hkv) float32 descale of the float8 {name}")}
        if self.query_descale is not None:
            fields[QUERY_DESCALE] = ("float", "(B, Hkv) float32 descale of q, folded into K's factor")
        return fields

    def written(self, name: str) -> tuple[str, ...]:
        return (name,)

    def element(self, buffer: str, dtype: str) -> str:
        return "float" if buffer.endswith("descale") else "uchar"

    def purpose(self, purpose: str) -> str:
        return f"{purpose}, stored {self.float8.name} (times its descale)"

    def inputs(self, name: str, shape: tuple, layout: OperandLayout, dtype: str, spec: Callable) -> dict:
        """The bytes, and the (B, Hkv) descales at their strides (0 where one factor is shared)."""
        inputs = {name: spec("uint8", shape, self.data.strides)}
        for buffer in self.catalog(name):
            at = self.layout(buffer, layout)
            inputs[buffer] = spec("float32", shape[:2], at.strides[:2], logical=False)
        return inputs

    def pointers(self, name: str, layout: OperandLayout, head: str, dtype: str, const: bool = True) -> list[str]:
        """`{name}_head` (the bytes; writable unless `const`), `{name}_descale_value` (the
        (batch, kv head)'s descale) and `{name}_factor`, what a decoded byte is multiplied by."""
        lines = [head_pointer(name, self.data, head, "uchar", const)]
        factor = [f"{name}_descale_value"]
        for buffer in self.catalog(name):
            lines.append(head_pointer(buffer, self.layout(buffer, layout), head, "float", True))
        lines.append(f"const float {name}_descale_value = {DESCALE.format(name)}_head[0];")
        if QUERY_DESCALE in self.catalog(name):
            factor.append(f"{QUERY_DESCALE}_head[0]")
        return lines + [f"const float {name}_factor = {' * '.join(factor)};   // times each decoded {name} value"]

    def layout(self, buffer: str, layout: OperandLayout) -> OperandLayout:
        if buffer == QUERY_DESCALE:
            return self.query_descale
        return self.descale if buffer.endswith("descale") else self.data

    def stage(self, name: str, stage: str, width: int, layout: OperandLayout, rows: int, dtype: str, key: str,
              valid: str) -> list[str]:
        """One work item per value: its byte read once, decoded, times `{name}_factor`."""
        t = MSL_TYPES[dtype]
        at = offset("ulong(key)", self.data.strides[2]) or "0"
        return ([f"for (uint e = member; e < {rows * width}u; e += threads) {{  // {self.float8.name} bytes, decoded",
                 f"  const int slot = int(e / {width});",
                 f"  const int key = {key};",
                 f"  if ({valid}) {{"]
                + ["    " + line for line in decode(self.float8, f"uint({name}_head[{at} + e % {width}])", "stored")]
                + [f"    {stage}[e] = {t}(stored * {name}_factor);",
                   "  } else {",
                   f"    {stage}[e] = {t}(0);",
                   "  }",
                   "}"])

    def store(self, name: str, value: str, row: str) -> list[str]:
        """MSL storing float `value` / `{name}_descale_value` (float32), encoded, at element
        `row` (an index into `{name}_head`)."""
        return ([f"const float quotient = precise::divide({value}, {name}_descale_value);"]
                + encode(self.float8, "quotient", "code")
                + [f"{name}_head[{row}] = uchar(code);"])
