"""How k or v is stored: the storage facet's cases (their bases: facet.py).

- `PLAIN`: elements of the problem's dtype at the tensor's own strides: the facet's defaults.
- `QuantizedStorage` (a QuantizedTensor, as far as a kernel depends on it): MLX's affine
  format or GGUF's blocks, read as stored and decoded on chip, and packing heads. Its
  kernel-side facts are a `QuantFacts`: its fields (an affine tensor's scales and biases),
  their pointers and layouts, and the stage that decodes a step's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..kernel.layouts import OperandLayout, Strides
from ..kernel.msl import MSL_TYPES, offset
from ..kernel.sizes import Extent
from ..kernel.tiles import head_pointer
from ...quant_formats import QuantFormat
from .facet import STORAGES, Storage, StorageFacts
from .formats import decode_group

FIELDS = ("scales", "biases")   # an affine tensor's fields besides its data


@STORAGES.register
@dataclass(frozen=True)
class Plain(Storage, StorageFacts):
    """The operand's elements, of the problem's dtype, at its own strides."""

    def describe(self, width: int, field: Callable) -> Plain:
        return self


PLAIN = Plain()


@STORAGES.register
@dataclass(frozen=True)
class QuantizedStorage(Storage):
    """A quantized k or v: its format, the dtype of its affine scales and biases, and the
    element strides of each field in logical (batch, head, sequence, -) order; the last axis
    of every field is contiguous."""

    format: QuantFormat
    data_strides: Strides
    scale_dtype: str | None = None        # affine only
    scale_strides: Strides | None = None
    bias_strides: Strides | None = None

    packs_heads = True

    def describe(self, width: int, field: Callable[[int, Strides], OperandLayout]) -> QuantFacts:
        f = self.format
        scales = biases = None
        if f.affine:
            groups = f.groups(width)
            scales, biases = field(groups, self.scale_strides), field(groups, self.bias_strides)
        return QuantFacts(f, self.scale_dtype, field(f.data_width(width), self.data_strides), scales, biases)


@dataclass(frozen=True)
class QuantFacts(StorageFacts):
    """What kernels reading a quantized k or v depend on: its format, the dtype of its affine
    scales and biases, and the layouts of its fields (logical (batch, kv head, key, -) order,
    in elements of each field)."""

    format: QuantFormat
    scale_dtype: str | None
    data: OperandLayout
    scales: OperandLayout | None
    biases: OperandLayout | None

    def catalog(self, name: str) -> dict[str, tuple[str, str]]:
        """An affine tensor's scales and biases, one per group."""
        return {f"{name}_{field}": ("scale", f"affine {field} of the quantized {name}, one per group")
                for field in FIELDS} if self.format.affine else {}

    def element(self, buffer: str, dtype: str) -> str:
        return MSL_TYPES[self.scale_dtype if buffer.endswith(FIELDS) else self.format.data_dtype]

    def purpose(self, purpose: str) -> str:
        return f"{purpose}, stored {self.format.describe()}"

    def inputs(self, name: str, shape: tuple, layout: OperandLayout, dtype: str, spec: Callable) -> dict:
        """The data, and an affine tensor's scales and biases: rows of `shape`'s first three axes
        (the features, shape[3], an int)."""
        f, rows, width = self.format, shape[:3], shape[3].factor
        inputs = {name: spec(f.data_dtype, (*rows, Extent(f.data_width(width))), self.data.strides)}
        if f.affine:
            for field in FIELDS:
                inputs[f"{name}_{field}"] = spec(self.scale_dtype, (*rows, Extent(f.groups(width))),
                                                 getattr(self, field).strides)
        return inputs

    def pointers(self, name: str, layout: OperandLayout, head: str, dtype: str, const: bool = True) -> list[str]:
        """`{name}_head` (the data) and an affine tensor's `{name}_scales_head`, `{name}_biases_head`
        (writable unless `const`)."""
        lines = [head_pointer(name, self.data, head, MSL_TYPES[self.format.data_dtype], const)]
        if self.format.affine:
            lines += [head_pointer(f"{name}_{field}", getattr(self, field), head, MSL_TYPES[self.scale_dtype], const)
                      for field in FIELDS]
        return lines

    def layout(self, buffer: str, layout: OperandLayout) -> OperandLayout:
        """The layout of one of its buffers (`fields`): the data's, or an affine field's."""
        return getattr(self, buffer.rsplit("_", 1)[1]) if buffer.endswith(FIELDS) else self.data

    def stage(self, name: str, stage: str, width: int, layout: OperandLayout, rows: int, dtype: str, key: str,
              valid: str) -> list[str]:
        """One work item per (row, group): the group's data, scale and bias read once, decoded."""
        f, groups, size = self.format, self.format.groups(width), self.format.group_size
        per_group = f.group_bytes // 4 if f.affine else f.group_bytes  # data elements (words or bytes)
        data = f"{name}_head + ({offset('ulong(key)', self.data.strides[2])} + group * {per_group})"
        body = [f"device const {MSL_TYPES[f.data_dtype]}* group_data = {data};"]
        scale = bias = None
        if f.affine:
            for value, field in zip(("scale", "bias"), FIELDS):
                at = offset("ulong(key)", getattr(self, field).strides[2])
                body.append(f"const float {value} = float({name}_{field}_head[{at} + group]);")
            scale, bias = "scale", "bias"
        body += decode_group(f, data="group_data", scale=scale, bias=bias, target="staged", cast=MSL_TYPES[dtype])
        return [f"for (uint e = member; e < {rows * groups}u; e += threads) {{  // a ({rows} rows) x ({groups} groups) share",
                f"  const int slot = int(e / {groups});",
                f"  const uint group = e % {groups};",
                f"  const int key = {key};",
                f"  threadgroup {MSL_TYPES[dtype]}* staged = {stage} + slot * {width} + group * {size};",
                f"  if ({valid}) {{"] \
            + ["    " + line for line in body] \
            + ["  } else {",
               f"    for (uint i = 0; i < {size}u; ++i) {{ staged[i] = {MSL_TYPES[dtype]}(0); }}",
               "  }",
               "}"]
