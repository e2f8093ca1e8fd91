"""`quantize`'s pass: float rows into a quantized format's fields, one thread per group.

The rows are x's leading axes flattened (x is contiguous), so group g of the whole tensor
reads values [g * group_size, (g + 1) * group_size) and writes its own slice of every
output: data elements [g * width, (g + 1) * width) (width: the format's group_bytes in
data's elements), and affine scales[g] and biases[g]. What a group computes is
formats.encode_group's; here is only where it reads and writes. The total number of
groups is the one runtime size, so a new shape reuses the kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ...runtime.passes import PassDescription
from ...runtime.templates import PassTemplate, evaluate
from ..kernel import passes
from ..kernel.msl import BUILTINS_THREAD, MSL_TYPES
from ..kernel.plan import GridAxis, LaunchPlan, Operand
from ..kernel.sizes import SIZES_OPERAND, Extent, RuntimeSizes
from ..kernel.source import KernelSource, assemble
from .formats import QuantFormat, encode_group

KERNEL_NAME = "quantize"
THREADS = 64   # groups per threadgroup
SIZES = RuntimeSizes("QuantizeSizes", (("groups", "groups in x: rows * D / group_size"),))


@dataclass(frozen=True)
class QuantizeDescriptor:
    dtype: str          # x's (and affine scales' and biases') numpy dtype name
    format: QuantFormat


def group_width(f: QuantFormat) -> int:
    """Elements of `data` per group: uint32 words (affine) or bytes (a GGUF block)."""
    return f.group_bytes // 4 if f.affine else f.group_bytes


def plan(d: QuantizeDescriptor) -> LaunchPlan:
    t, f = MSL_TYPES[d.dtype], d.format
    ops = [Operand("x", f"device const {t}*", "(rows, D) floats, contiguous"),
           Operand("data", f"device {MSL_TYPES[f.data_dtype]}*",
                   "(rows, D * bits / 32) words" if f.affine else f"(rows, D / 32 * {f.group_bytes}) bytes: blocks")]
    if f.affine:
        ops += [Operand("scales", f"device {t}*", "(rows, D / group_size)"),
                Operand("biases", f"device {t}*", "(rows, D / group_size)")]
    ops.append(Operand(SIZES_OPERAND, f"constant {SIZES.struct}&", "runtime sizes"))
    grid = (GridAxis(Extent(1, ("groups",)), THREADS), GridAxis(Extent(1)), GridAxis(Extent(1)))
    return LaunchPlan(KERNEL_NAME, tuple(ops), grid, THREADS, SIZES)


@lru_cache(maxsize=64)
def generate(d: QuantizeDescriptor) -> KernelSource:
    t, f = MSL_TYPES[d.dtype], d.format
    body = [f"const ulong g = ulong(group.x) * {THREADS} + lane;  // this thread's group",
            "if (g >= groups) {",
            "  return;",
            "}",
            f"device const {t}* values = x + g * {f.group_size};",
            f"device {MSL_TYPES[f.data_dtype]}* out = data + g * {group_width(f)};"]
    body += encode_group(f, values="values", data="out", scale="scales[g]" if f.affine else None,
                         bias="biases[g]" if f.affine else None, store=t)
    summary = [f"quantize: {d.dtype} rows to {f.describe()}, one thread per group, in float32"]
    return assemble(plan(d), summary=summary, builtins=BUILTINS_THREAD, body=body)


def quantize_pass(d: QuantizeDescriptor, shape: tuple[int, ...]) -> PassDescription:
    """The pass quantizing a contiguous x of `shape` (the last axis a multiple of the group
    size); outputs data, and affine scales and biases, shaped shape[:-1] + (their width,)."""
    groups = math.prod(shape) // d.format.group_size
    template = _template(d, tuple(shape[:-1]), shape[-1], (f"groups == {groups}",))  # x's shape is in the template
    return evaluate(template, {"groups": groups})


def quantize_template(d: QuantizeDescriptor) -> PassTemplate:
    """The pass as a template for every shape (what a bundle entry holds): x seen as its
    groups, (groups, group_size), data (groups, the group's width), affine scales and biases
    (groups, 1), `groups` the one runtime size; the kernel is quantize_pass's."""
    return _template(d, (Extent(1, ("groups",)),), d.format.group_size)


def _template(d: QuantizeDescriptor, rows: tuple, features: int, guards: tuple[str, ...] = ()) -> PassTemplate:
    """The quantize pass over x of shape rows + (features,), contiguous."""
    f = d.format
    outputs = {"data": passes.TensorSpec(f.data_dtype, (*rows, f.data_width(features)))}
    if f.affine:
        groups = (*rows, f.groups(features))
        outputs.update(scales=passes.TensorSpec(d.dtype, groups), biases=passes.TensorSpec(d.dtype, groups))
    shape = (*rows, features)
    inputs = {"x": passes.TensorSpec(d.dtype, shape, passes.contiguous(shape))}
    return passes.build_template("quantize", (generate(d),), sizes=("groups",), inputs=inputs, outputs=outputs,
                                 guards=guards, valid_for=dict(dtype=d.dtype, format=f.describe()))
