"""attention_backward_dsinks (with sinks only): dsinks = the sum of the rows' -p_sink D that
the dQ kernel stored (sink_grad), in a fixed order."""

from __future__ import annotations

from functools import lru_cache

from ..kernel.msl import BUILTINS_LANE
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from . import operands
from .descriptor import BackwardDescriptor
from .rows import row_index

DSINKS_KERNEL_NAME = "attention_backward_dsinks"


def dsinks_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = operands.reads(d, "sink_grad") + operands.writes(d, "dsinks") + operands.sizes(d)
    grid = (GridAxis(Extent(1, ("Hq",))), GridAxis(Extent(1)), GridAxis(Extent(1)))
    return LaunchPlan(DSINKS_KERNEL_NAME, tuple(ops), grid, 32, d.sizes)


@lru_cache(maxsize=32)
def generate_dsinks(d: BackwardDescriptor) -> KernelSource:
    """dsinks[h] = the sum of every row's -p_sink D over batch and rows: one simdgroup per
    head, each lane summing rows lane, lane + 32, ... in order, then simd_sum. The order is
    fixed, so two runs give the same bits."""
    body = [
        "const uint h = group.x;",
        "float total = 0.0f;",
        "for (uint b = 0; b < B; ++b) {",
        "  for (uint row = lane; row < R; row += 32) {",
        f"    total += sink_grad[{row_index('row')}];",
        "  }",
        "}",
        "total = simd_sum(total);",
        "if (lane == 0) {",
        "  dsinks[h] = total;",
        "}",
    ]
    plan = dsinks_plan(d)
    summary = ["dsinks = sum over batch and rows of each row's -p_sink D, one simdgroup per head"]
    return assemble(plan, summary=summary, builtins=BUILTINS_LANE, body=body)
