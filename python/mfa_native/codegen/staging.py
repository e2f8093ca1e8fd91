"""K/V rows staged in threadgroup memory: each step, every thread of the threadgroup loads a
share of the step's key rows into `k_stage` (and `v_stage`), each row read from device
memory once, and every simdgroup's products read the stage. The kernels whose rows are the
query heads of one kv head use it (sparse-indexed attention, packed-heads attention), so a
K/V byte is read once per kv head however many query heads read it.

A staged tensor is plain (its elements copied, in the problem's dtype) or quantized (each
group of `group_size` values decoded once, scale and bias read once per group: nothing
writes a dequantized copy to device memory). A slot that names no key stores 0 and reads
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .descriptor import OperandLayout, QuantFacts
from .msl import MSL_TYPES, offset
from .quant_format import decode_group

BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


@dataclass(frozen=True)
class StagedTensor:
    """One tensor a stage holds: `name` (k or v; its MSL pointer is `{name}_head`, and
    `{name}_scales_head` / `{name}_biases_head` for affine fields), its layout (plain) or
    QuantFacts (quantized), and its feature width."""

    name: str
    width: int
    layout: OperandLayout | None = None
    quant: QuantFacts | None = None

    @property
    def stage(self) -> str:
        return f"{self.name}_stage"


def declare(tensors: list[StagedTensor], rows: int, dtype: str, threads: str) -> list[str]:
    """The threadgroup arrays of the staged rows, and `member` and `threads`: the thread's
    place in the threadgroup and its size. Reads simd_index, lane."""
    lines = [f"threadgroup {MSL_TYPES[dtype]} {t.stage}[{rows * t.width}];  // the step's {t.name.upper()} rows, "
             "shared by every simdgroup" for t in tensors]
    return lines + ["const uint member = simd_index * 32 + lane;  // this thread's place in the threadgroup",
                    f"const uint threads = {threads};"]


def fill(tensors: list[StagedTensor], rows: int, dtype: str, key: str, valid: str) -> list[str]:
    """Loads stage rows 0..rows-1 of every tensor: row `slot` holds key `key` (an expression of
    `slot`) when `valid` (an expression of `slot` and `key`), else 0. Barriers before (the last
    step's readers are done) and after. Reads member, threads and the tensors' pointers."""
    lines = [BARRIER + "  // the previous step's stage is read"]
    for t in tensors:
        lines += _quantized(t, rows, dtype, key, valid) if t.quant else _plain(t, rows, dtype, key, valid)
    return lines + [BARRIER + "  // the stage is filled"]


def _plain(t: StagedTensor, rows: int, dtype: str, key: str, valid: str) -> list[str]:
    at = offset("ulong(key)", t.layout.strides[2])
    return [f"for (uint e = member; e < {rows * t.width}u; e += threads) {{",
            f"  const int slot = int(e / {t.width});",
            f"  const int key = {key};",
            f"  {t.stage}[e] = {valid} ? {t.name}_head[{at} + e % {t.width}] : {MSL_TYPES[dtype]}(0);",
            "}"]


def _quantized(t: StagedTensor, rows: int, dtype: str, key: str, valid: str) -> list[str]:
    """One work item per (row, group): the group's data, scale and bias read once, decoded."""
    q = t.quant
    f, groups, size = q.format, q.format.groups(t.width), q.format.group_size
    per_group = f.group_bytes // 4 if f.affine else f.group_bytes  # data elements (words or bytes)
    data = f"{t.name}_head + ({offset('ulong(key)', q.data.strides[2])} + group * {per_group})"
    body = [f"device const {MSL_TYPES[f.data_dtype]}* group_data = {data};"]
    scale = bias = None
    if f.affine:
        for value, field, layout in (("scale", "scales", q.scales), ("bias", "biases", q.biases)):
            at = offset("ulong(key)", layout.strides[2])
            body.append(f"const float {value} = float({t.name}_{field}_head[{at} + group]);")
        scale, bias = "scale", "bias"
    body += decode_group(f, data="group_data", scale=scale, bias=bias, target="staged", cast=MSL_TYPES[dtype])
    return [f"for (uint e = member; e < {rows * groups}u; e += threads) {{  // a ({rows} rows) x ({groups} groups) share",
            f"  const int slot = int(e / {groups});",
            f"  const uint group = e % {groups};",
            f"  const int key = {key};",
            f"  threadgroup {MSL_TYPES[dtype]}* staged = {t.stage} + slot * {t.width} + group * {size};",
            f"  if ({valid}) {{"]  \
        + ["    " + line for line in body] \
        + ["  } else {",
           f"    for (uint i = 0; i < {size}u; ++i) {{ staged[i] = {MSL_TYPES[dtype]}(0); }}",
           "  }",
           "}"]
