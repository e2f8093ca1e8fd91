"""Quantized storage formats as values: the table of formats a QuantizedTensor may hold and
the facts a kernel reading or writing one depends on (bits, groups, bytes). The MSL that
decodes and encodes a group is codegen's (codegen/storage/formats.py).

A quantized tensor stores its last axis (D values per row) in groups:

- "affine" (MLX's `mx.quantize`): `data` uint32, the values packed as a little-endian bit
  stream, `bits` each (value i of a row in bits [i * bits, (i + 1) * bits)); one scale and
  one bias per `group_size` values, in the logical float dtype; value = scale * q + bias.
- "q8_0" (GGUF): blocks of 32 values, 34 bytes each: a float16 scale d, then 32 int8 q;
  value = d * q.
- "q4_0" (GGUF): blocks of 32 values, 18 bytes each: a float16 scale d, then 16 bytes whose
  low nibbles are values 0..15 and high nibbles values 16..31; value = d * (nibble - 8).
- "q4_1" (GGUF): 20 bytes: float16 d and m (the block's minimum), then q4_0's nibbles;
  value = d * nibble + m.
- "q5_0" (GGUF): 22 bytes: float16 d, a little-endian uint32 whose bit i is the fifth bit of
  value i, then q4_0's nibbles as the low four bits; value = d * (q - 16).
- "q5_1" (GGUF): 24 bytes: float16 d and m, the fifth bits, the nibbles; value = d * q + m.

GGUF's `data` is the raw blocks (uint8); their scales live inside the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# format -> (bits, bytes per 32-value block, whether a minimum m follows d: value = d * q + m)
GGUF_BLOCKS = {"q8_0": (8, 34, False), "q4_0": (4, 18, False), "q4_1": (4, 20, True), "q5_0": (5, 22, False),
               "q5_1": (5, 24, True)}
GGUF_BLOCK = 32
AFFINE_EPS = 1e-7   # MLX's least |scale| (a constant group still gets a nonzero one)
FORMATS = ("affine", *GGUF_BLOCKS)


@dataclass(frozen=True)
class QuantFormat:
    """One storage format: its name, bits per value and values per group (scale)."""

    name: str
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.name == "affine":
            if self.bits not in AFFINE_BITS:
                raise ValueError(f"bits must be one of {AFFINE_BITS} for the affine format, got {self.bits}")
            if self.group_size not in AFFINE_GROUP_SIZES:
                raise ValueError(f"group_size must be one of {AFFINE_GROUP_SIZES} for the affine format, "
                                 f"got {self.group_size}")
        elif self.name in GGUF_BLOCKS:
            bits = GGUF_BLOCKS[self.name][0]
            if (self.bits, self.group_size) != (bits, GGUF_BLOCK):
                raise ValueError(f"{self.name} has bits={bits} and group_size={GGUF_BLOCK}, "
                                 f"got bits={self.bits}, group_size={self.group_size}")
        else:
            raise ValueError(f"format must be one of {FORMATS}, got {self.name!r}")

    @classmethod
    def of(cls, name: str, bits: int | None = None, group_size: int | None = None) -> QuantFormat:
        """The format `name`; GGUF's fix bits and group size (None takes them)."""
        if name in GGUF_BLOCKS:
            bits = GGUF_BLOCKS[name][0] if bits is None else bits
            group_size = GGUF_BLOCK if group_size is None else group_size
        return cls(name, 8 if bits is None else bits, 64 if group_size is None else group_size)

    @property
    def affine(self) -> bool:
        return self.name == "affine"

    @property
    def data_dtype(self) -> str:
        """numpy dtype name of `data`'s elements."""
        return "uint32" if self.affine else "uint8"

    def data_width(self, features: int) -> int:
        """`data` elements per row of `features` values."""
        self.check_width(features)
        if self.affine:
            return features * self.bits // 32
        return features // GGUF_BLOCK * GGUF_BLOCKS[self.name][1]

    def groups(self, features: int) -> int:
        self.check_width(features)
        return features // self.group_size

    def check_width(self, features: int) -> None:
        if features % self.group_size:
            raise ValueError(f"the quantized axis ({features}) must be a multiple of the group size "
                             f"({self.group_size}) of format {self.name!r}")

    @property
    def minimum(self) -> bool:
        """A GGUF block whose float16 minimum m follows d (q4_1, q5_1): value = d * q + m."""
        return not self.affine and GGUF_BLOCKS[self.name][2]

    @property
    def block_layout(self) -> tuple[int, int]:
        """Where a 4- or 5-bit GGUF block's fifth bits (a uint32; q5_*) and its nibbles start, in
        bytes: after d, and m where the format has one."""
        high_bits = 2 + 2 * self.minimum
        return high_bits, high_bits + 4 * (self.bits == 5)

    @property
    def group_bytes(self) -> int:
        """Bytes of one group in `data` (without an affine group's scale and bias)."""
        return self.group_size * self.bits // 8 if self.affine else GGUF_BLOCKS[self.name][1]

    def describe(self) -> str:
        return f"{self.name} {self.bits}-bit, groups of {self.group_size}" if self.affine else self.name


@dataclass(frozen=True)
class Float8Format:
    """A float8 storage dtype (an fp8 K/V cache, one byte a value, times a descale factor):
    its numpy (ml_dtypes) and torch name, exponent and mantissa bits, exponent bias, and the
    code of largest magnitude quantizing gives: e4m3fn has no inf (its 0x7f is NaN) and
    saturates at 448 (0x7e), as torch's `.to(torch.float8_e4m3fn)` does; e5m2 overflows to
    inf (0x7c), IEEE's way."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    largest_code: int


FLOAT8_FORMATS = {f.name: f for f in (Float8Format("float8_e4m3fn", 4, 3, 7, 0x7E),
                                      Float8Format("float8_e5m2", 5, 2, 15, 0x7C))}
