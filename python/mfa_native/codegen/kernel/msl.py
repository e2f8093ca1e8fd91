"""Small MSL text helpers shared by the generators."""

from __future__ import annotations

import math
import re

import numpy as np

from ...runtime.arrays import MSL_ELEMENTS
from .sizes import Extent, RuntimeSizes

# Element types in device memory, by numpy dtype name.
MSL_TYPES = MSL_ELEMENTS

# Builtin parameters of kernels that are not one simdgroup per 8 rows: the threadgroup, and
# the thread's index in the threadgroup or in its simdgroup.
BUILTINS_THREAD = ["uint3 group [[threadgroup_position_in_grid]]", "ushort lane [[thread_index_in_threadgroup]]"]
BUILTINS_LANE = ["uint3 group [[threadgroup_position_in_grid]]", "ushort lane [[thread_index_in_simdgroup]]"]

# Every thread of the threadgroup waits here, and its threadgroup memory writes are seen after.
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"

# Loops over register tiles must unroll, or the tiles spill out of registers.
UNROLL = "#pragma clang loop unroll(full)"


def float_literal(value: float) -> str:
    """A float32 literal with a suffix, printed with full (round-trip) precision: 0.125f, 1.0f, 1e-08f."""
    if not math.isfinite(value):
        raise ValueError(f"cannot print {value} as an MSL float literal")
    text = str(np.float32(value))
    if not any(c in text for c in ".e"):
        text += ".0"
    return text + "f"


def extent(e: Extent) -> str:
    """An element count as an expression: '64', 'R * 64', 'Hq * R * 64'."""
    parts = list(e.sizes)
    if e.factor != 1 or not parts:
        parts.append(str(e.factor))
    return " * ".join(parts)


def offset(index: str, e: Extent) -> str | None:
    """`index * e` as an expression; None when the stride is 0 (a broadcast axis)."""
    if e.factor == 0:
        return None
    if e == Extent(1):
        return index
    return f"{index} * {extent(e)}"


def ranks_before(*, score: str, key: str, other_score: str, other_key: str) -> str:
    """An MSL bool: (other_score, other_key) comes before (score, key) in descending-score
    order, torch.topk's: NaN above every number, the lower key first among equal scores and
    among NaNs. A total order (every pair compares one way), so ranks are a permutation."""
    nan, other_nan = f"isnan({score})", f"isnan({other_score})"
    return (f"({other_nan} ? (!{nan} || {other_key} < {key}) : "
            f"(!{nan} && ({other_score} > {score} || ({other_score} == {score} && {other_key} < {key}))))")


def indent(lines: list[str], levels: int = 1) -> list[str]:
    pad = "  " * levels
    return [pad + line if line else line for line in lines]


def loop(header: str, body: list[str], unroll: bool = True) -> list[str]:
    """`for (header) { body }`, unrolled by default (register tiles)."""
    return ([UNROLL] if unroll else []) + [f"for ({header}) {{"] + indent(body) + ["}"]


# ---------------------------------------------------------------------------
# Kernel scaffolding: sizes struct, signature, constants, header comment.

NAMED_CONSTANTS = {
    "MASKED": ("-1.0e38f", "logit of a removed key: finite, below any real logit"),
    "LOG2E": (float_literal(math.log2(math.e)), "log2(e)"),
    "LN2": (float_literal(math.log(2.0)), "ln(2)"),
}


# Helper functions a body may call, emitted ahead of the kernel when it does.
NAMED_FUNCTIONS = {
    "max_nan": ["// max that keeps a NaN (MSL's max may return the other argument).",
                "inline float max_nan(float a, float b) {",
                "  return (isnan(a) || a >= b) ? a : b;",
                "}"],
    "quantize_int8": ["// The integer nearest (x + x_low) / scale (halfway to even), clamped to +-127: that of the",
                      "// exact quotient, not of its float32 rounding t. t is within 1e-4 of the exact quotient, so",
                      "// the answer is floor(t) or floor(t) + 1, and the side of b = floor(t) + 0.5 the exact",
                      "// quotient lies on is the sign of x + x_low - b * scale, which fma gives exactly. A scale",
                      "// that is 0, infinite or NaN stores 0 (the scale itself carries the NaN on).",
                      "inline char quantize_int8(float x, float x_low, float scale) {",
                      "  if (!(scale > 0.0f && isfinite(scale))) {",
                      "    return 0;",
                      "  }",
                      "  const float t = precise::divide(x + x_low, scale);",
                      "  if (!(abs(t) < 256.0f)) {",
                      "    return char(clamp(t, -127.0f, 127.0f));",
                      "  }",
                      "  const float b = floor(t) + 0.5f;",
                      "  const float r = fma(-b, scale, x) + x_low;",
                      "  const float n = r > 0.0f ? b + 0.5f : (r < 0.0f ? b - 0.5f : rint(b));",
                      "  return char(clamp(n, -127.0f, 127.0f));",
                      "}"],
    "minus_mean": ["// x - (mean + mean_low) as two floats (the difference, rounded, and what it missed), whose",
                   "// sum is the exact difference to float64's precision (Knuth's TwoSum, then mean_low).",
                   "inline float2 minus_mean(float x, float mean, float mean_low) {",
                   "  const float hi = x - mean;",
                   "  const float back = hi - x;",
                   "  const float lo = (x - (hi - back)) + (-mean - back);",
                   "  return float2(hi, lo - mean_low);",
                   "}"],
}


def functions(body: str) -> list[str]:
    """The NAMED_FUNCTIONS that `body` calls."""
    lines = []
    for name, text in NAMED_FUNCTIONS.items():
        if re.search(rf"\b{name}\(", body):
            lines += text + [""]
    return lines


def sizes_struct(sizes: RuntimeSizes) -> list[str]:
    """The runtime-size struct a kernel binds (nothing when sizes are baked)."""
    if not sizes.fields:
        return []
    docs = dict(sizes.docs)
    fields = [f"  uint {name};  // {docs[name]}" for name in sizes.fields]
    return [f"struct {sizes.struct} {{"] + fields + ["};", ""]


def signature(plan, builtins: list[str]) -> list[str]:
    """`kernel void name(...)` with one [[buffer(i)]] parameter per plan operand, then the
    builtins; it declares the plan's threads per threadgroup as its maximum, so Metal's
    compiler fits its registers to the launch (a 512-thread packed-heads kernel included)."""
    params = [f"{o.msl_type} {o.name} [[buffer({i})]]" for i, o in enumerate(plan.operands)] + builtins
    return ([f"[[max_total_threads_per_threadgroup({plan.threads_per_threadgroup})]]",
             f"kernel void {plan.kernel_name}("] + [f"    {p}," for p in params[:-1]] + [f"    {params[-1]})"])


def constants(sizes: RuntimeSizes, body: str) -> list[str]:
    """Declarations of the sizes (runtime or baked) and named constants that `body` uses."""
    lines = []
    baked = dict(sizes.baked) if sizes.baked is not None else None
    for name, doc in sizes.docs:
        if re.search(rf"\b{name}\b", body):
            value = f"{baked[name]}u" if baked is not None else f"sizes.{name}"
            lines.append(f"const uint {name} = {value};  // {doc}")
    for name, (value, doc) in NAMED_CONSTANTS.items():
        if re.search(rf"\b{name}\b", body):
            lines.append(f"const float {name} = {value};  // {doc}")
    return lines


def header(plan, summary: list[str], includes: list[str] = ()) -> list[str]:
    """The comment that opens a generated kernel: what it computes, how to launch and bind it,
    then its includes (metal_stdlib and `includes`)."""
    lines = [f"// {plan.kernel_name}: generated by mfa_native.codegen, do not edit."] + [f"//   {s}" for s in summary]
    lines.append(f"// Launch: {plan.describe_grid()}.")
    lines.append("// Buffers:")
    lines += [f"//   [[buffer({i})]] {o.name}: {o.purpose}" for i, o in enumerate(plan.operands)]
    return lines + [f"#include <{name}>" for name in ("metal_stdlib", *includes)] + ["using namespace metal;", ""]
