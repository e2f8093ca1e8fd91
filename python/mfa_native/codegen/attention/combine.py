"""MSL that merges the splits of a split-KV pass (see split.py) into the output.

One thread per output element (row, value column). With m_s, l_s the log2-domain
max and sum of split s and O_s its unnormalized output:
  top = max(m_s over splits with l_s != 0, sink), NaN if any is NaN
  w_s = exp2(m_s - top),  denominator = sum_s w_s l_s (+ exp2(sink - top))
  O = sum_s w_s O_s / denominator,  lse = (top + log2(denominator)) ln 2
All arithmetic stays finite (removed rows keep the finite MASKED max, and an
empty denominator stores 0 and lse = -inf), as fast math requires.
"""

from __future__ import annotations

from functools import lru_cache

from ..kernel.msl import BUILTINS_THREAD, MSL_TYPES, offset
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from . import invariance, operands
from .descriptor import KernelDescriptor
from .rows import row_index
from .softmax import sink_state, stored_lse

KERNEL_NAME = "attention_combine"
COLUMNS_PER_THREADGROUP = 32


def launch_plan(d: KernelDescriptor) -> LaunchPlan:
    ops = (operands.reads(d, "o_partial", "ml_partial") + operands.writes(d, "o", *(["lse"] if d.return_lse else []))
           + operands.reads(d, "sinks") + operands.sizes(d))
    grid = (GridAxis(Extent(d.value_dim), COLUMNS_PER_THREADGROUP), GridAxis(Extent(1, ("R",))),
            GridAxis(Extent(1, ("B", "Hq"))))
    return LaunchPlan(KERNEL_NAME, tuple(ops), grid, COLUMNS_PER_THREADGROUP, d.sizes)


def _o_offset(d: KernelDescriptor) -> str:
    """The offset of the thread's output row in o."""
    return " + ".join(x for x in (offset("ulong(b)", d.o.strides[0]), offset("ulong(h)", d.o.strides[1]),
                                  offset("ulong(row)", d.o.strides[2])) if x)


def _place(d: KernelDescriptor) -> list[str]:
    """The thread's output element (row, col) of (b, h), and where its splits' parts are."""
    return [f"const uint col = group.x * {COLUMNS_PER_THREADGROUP} + lane;",
            "const uint row = group.y;",
            "const uint b = group.z / Hq;",
            "const uint h = group.z % Hq;",
            f"const ulong first = {row_index('row')};  // split s is at first + s * B * Hq * R",
            "const ulong split_stride = ulong(B) * Hq * R;"]


def _body(d: KernelDescriptor) -> list[str]:
    t = MSL_TYPES[d.dtype]
    lines = [
        *_place(d),
        "",
        "// The largest max among splits that saw a key (and the sink).",
        *(sink_state()[:1] + ["float top = m;"] if d.sinks else ["float top = MASKED;"]),
        "for (uint s = 0; s < S; ++s) {",
        "  const ulong at = first + s * split_stride;",
        "  if (ml_partial[at * 2 + 1] != 0.0f) {  // a split that saw a key (or a NaN)",
        "    top = max_nan(top, ml_partial[at * 2]);",
        "  }",
        "}",
        "float denominator = m != -INFINITY ? exp2(m - top) : 0.0f;  // a -inf sink is none" if d.sinks
        else "float denominator = 0.0f;",
        "float sum = 0.0f;",
        "for (uint s = 0; s < S; ++s) {",
        "  const ulong at = first + s * split_stride;",
        "  const float l = ml_partial[at * 2 + 1];",
        "  const float weight = l != 0.0f ? exp2(ml_partial[at * 2] - top) : 0.0f;",
        "  denominator += weight * l;",
        f"  sum += col < {d.value_dim} ? weight * o_partial[at * {d.value_dim} + col] : 0.0f;",
        "}",
        "",
        f"if (col < {d.value_dim}) {{",
        f"  o[{_o_offset(d)} + col] = {t}(denominator != 0.0f ? sum / denominator : 0.0f);",
        "}",
    ]
    if d.return_lse:
        lines += ["if (col == 0) {",
                  f"  lse[first] = {stored_lse(m='top', denominator='denominator', sinks=d.sinks)};",
                  "}"]
    return lines


def _merged_body(d: KernelDescriptor) -> list[str]:
    """Batch-invariant: the splits merged in order into the initial state, as the one-pass
    kernel merges them (invariance.merge), then its finish: O * (1 / l) and lse."""
    t = MSL_TYPES[d.dtype]
    lines = [*_place(d), "", "// The splits, merged in order into the initial state (the sink, or nothing)."]
    lines += sink_state() if d.sinks else ["float m = MASKED;", "float l = 0.0f;"]
    lines += ["float value = 0.0f;",
              "for (uint s = 0; s < S; ++s) {",
              "  const ulong at = first + s * split_stride;",
              f"  const float part = col < {d.value_dim} ? o_partial[at * {d.value_dim} + col] : 0.0f;"]
    lines += ["  " + line for line in invariance.merge(("m", "l"), ("ml_partial[at * 2]", "ml_partial[at * 2 + 1]"),
                                                       [invariance.merged("value", "part")])]
    lines += ["}", "const float inv_l = l != 0.0f ? 1.0f / l : 0.0f;  // NaN stays NaN",
              f"if (col < {d.value_dim}) {{", f"  o[{_o_offset(d)} + col] = {t}(value * inv_l);", "}"]
    if d.return_lse:
        lines += ["if (col == 0) {", f"  lse[first] = {stored_lse(m='m', denominator='l', sinks=d.sinks)};", "}"]
    return lines


@lru_cache(maxsize=64)
def generate_combine(d: KernelDescriptor) -> KernelSource:
    """The MSL source and launch plan of the kernel that finishes a split-KV pass."""
    summary = [f"{d.dtype} output, Dv = {d.value_dim}, sinks {'yes' if d.sinks else 'no'}, "
               f"lse {'yes' if d.return_lse else 'no'}"]
    if d.split_keys:
        summary.append(f"batch-invariant: the splits of {d.split_keys} keys merged in order, as the one-pass "
                       "kernel does")
    return assemble(launch_plan(d), summary=summary, builtins=BUILTINS_THREAD,
                    body=_merged_body(d) if d.split_keys else _body(d))
