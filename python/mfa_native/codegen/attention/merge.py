"""attention_merge: attention over a union of disjoint key sets, from the parts' outputs and
lse (`merge_attention`), on the device. The split-KV combine's arithmetic (combine.py), on
normalized parts: part i is the output o_i (the parts' dtype, the problem's layout) and its
natural-log lse_i, which is the log2-domain max m_i = lse_i log2(e) of a split whose sum is
1, or, at -inf, a split that saw no key.

One thread per output element (row, value column):
  top = max over parts with lse_i != -inf of m_i, NaN if any lse_i is NaN (max_nan)
  w_i = exp2(m_i - top),  denominator = sum_i w_i
  O = sum_i w_i o_i / denominator,  lse = (top + log2(denominator)) ln 2
A row whose every part has lse -inf gets O = 0 and lse = -inf; a NaN lse makes its row NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ...runtime.templates import PassTemplate
from ..kernel.layouts import OperandLayout, contiguous_strides, memory_order, operand_layout, physical
from ..kernel.msl import BUILTINS_THREAD, MSL_TYPES, offset
from ..kernel.passes import TensorSpec, build_template
from ..kernel.plan import GridAxis, LaunchPlan, Operand
from ..kernel.sizes import SIZES_OPERAND, Extent, RuntimeSizes
from ..kernel.source import KernelSource, assemble
from .rows import row_index

KERNEL_NAME = "attention_merge"
COLUMNS_PER_THREADGROUP = 32
SIZES = RuntimeSizes("MergeSizes", (("B", "batch"), ("Hq", "query heads"), ("R", "query length")))
B, Hq, R = (Extent(1, (name,)) for name in ("B", "Hq", "R"))


@dataclass(frozen=True)
class MergeDescriptor:
    dtype: str           # the parts' (and the output's) dtype
    value_dim: int       # Dv
    parts: int
    layout: str          # "bhsd" or "bshd": the parts' and the output's
    o: OperandLayout     # every part's (contiguous in the layout) and the output's


def describe_merge(*, dtype: str, value_dim: int, parts: int, layout: str) -> MergeDescriptor:
    shape = (1, 1, 1, value_dim)   # dense strides stay symbolic: every size is a runtime value
    o = operand_layout(shape, (B, Hq, R, Extent(value_dim)), contiguous_strides(layout, shape), memory_order(layout),
                       None)
    return MergeDescriptor(dtype, value_dim, parts, layout, o)


def part(i: int) -> str:
    return f"part{i}"


def part_lse(i: int) -> str:
    return f"part{i}_lse"


def plan(d: MergeDescriptor) -> LaunchPlan:
    t = MSL_TYPES[d.dtype]
    ops = [Operand(part(i), f"device const {t}*", f"part {i}'s output") for i in range(d.parts)]
    ops += [Operand(part_lse(i), "device const float*", f"part {i}'s lse, (B, Hq, R)") for i in range(d.parts)]
    ops += [Operand("o", f"device {t}*", "the merged output"), Operand("lse", "device float*", "the merged lse"),
            Operand(SIZES_OPERAND, f"constant {SIZES.struct}&", "runtime sizes")]
    grid = (GridAxis(Extent(d.value_dim), COLUMNS_PER_THREADGROUP), GridAxis(R), GridAxis(Extent(1, ("B", "Hq"))))
    return LaunchPlan(KERNEL_NAME, tuple(ops), grid, COLUMNS_PER_THREADGROUP, SIZES)


@lru_cache(maxsize=32)
def generate_merge(d: MergeDescriptor) -> KernelSource:
    t, n = MSL_TYPES[d.dtype], d.parts
    at = " + ".join(x for x in (offset("ulong(b)", d.o.strides[0]), offset("ulong(h)", d.o.strides[1]),
                                offset("ulong(row)", d.o.strides[2])) if x)
    body = [f"const uint col = group.x * {COLUMNS_PER_THREADGROUP} + lane;", "const uint row = group.y;",
            "const uint b = group.z / Hq;", "const uint h = group.z % Hq;",
            f"const ulong row_at = {row_index('row')};", f"const ulong at = {at} + min(col, {d.value_dim - 1}u);",
            f"device const float* lses[{n}] = {{{', '.join(part_lse(i) for i in range(n))}}};",
            f"device const {t}* parts[{n}] = {{{', '.join(part(i) for i in range(n))}}};",
            "", "// The largest log2-domain lse among parts that saw a key; NaN if any lse is.",
            "float top = MASKED;",
            f"for (uint i = 0; i < {n}; ++i) {{",
            "  const float value = lses[i][row_at];",
            "  if (value != -INFINITY) {",
            "    top = max_nan(top, value * LOG2E);",
            "  }",
            "}",
            "float denominator = 0.0f;", "float sum = 0.0f;",
            f"for (uint i = 0; i < {n}; ++i) {{",
            "  const float value = lses[i][row_at];",
            "  const float weight = value != -INFINITY ? exp2(value * LOG2E - top) : 0.0f;",
            "  denominator += weight;",
            "  sum += weight * float(parts[i][at]);",
            "}",
            "",
            f"if (col < {d.value_dim}) {{",
            f"  o[at] = {t}(denominator != 0.0f ? sum / denominator : 0.0f);",
            "}",
            "if (col == 0) {",
            "  lse[row_at] = denominator != 0.0f ? (top + log2(denominator)) * LN2 : -INFINITY;",
            "}"]
    summary = [f"merge of {n} attention parts: {d.dtype}, Dv = {d.value_dim}, layout {d.layout}"]
    return assemble(plan(d), summary=summary, builtins=BUILTINS_THREAD, body=body)


def merge_template(d: MergeDescriptor) -> PassTemplate:
    """The merge's pass: the parts and their lse in, the merged output and lse out."""
    shape = physical((B, Hq, R, Extent(d.value_dim)), d.layout)
    strides = physical(d.o.strides, d.layout)
    rows = (B, Hq, R)
    row_strides = (Extent(1, ("Hq", "R")), R, Extent(1))
    inputs = {part(i): TensorSpec(d.dtype, shape, strides) for i in range(d.parts)}
    inputs.update({part_lse(i): TensorSpec("float32", rows, row_strides) for i in range(d.parts)})
    outputs = {"o": TensorSpec(d.dtype, shape), "lse": TensorSpec("float32", rows)}
    return build_template("merge_attention", (generate_merge(d),), sizes=("B", "Hq", "R"), inputs=inputs,
                          outputs=outputs, valid_for=dict(dtype=d.dtype, value_dim=d.value_dim, parts=d.parts,
                                                          layout=d.layout))
