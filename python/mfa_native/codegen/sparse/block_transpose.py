"""attention_transpose_lists: from the kv lists (per query block, its key blocks), the
transposed lists the dK/dV kernel walks (per key block, its query blocks), as counts,
starts and entries. One thread per (batch|1, head|1) list pair counts, takes the prefix
sum, and scatters in query-block order, so the result, and every gradient summed in its
order, is the same on every run (no atomics).
"""

from __future__ import annotations

from functools import lru_cache

from ..attention import operands
from ..attention.descriptor import BackwardDescriptor
from ..kernel.msl import BUILTINS_THREAD, indent
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble

TRANSPOSE_KERNEL_NAME = "attention_transpose_lists"
THREADS = 32
# The transposed lists it builds (block_visits.BUILT_QUERY_LISTS).
BUILT_QUERY_LISTS = ("q_counts", "q_starts", "q_entries", "full_q_counts", "full_q_starts", "full_q_entries")


def transpose_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = operands.reads(d, *d.keys.key_lists) + operands.writes(d, *BUILT_QUERY_LISTS) + operands.sizes(d)
    grid = (GridAxis(d.keys.pairs(), THREADS), GridAxis(Extent(1)), GridAxis(Extent(1)))
    return LaunchPlan(TRANSPOSE_KERNEL_NAME, tuple(ops), grid, THREADS, d.sizes)


def _transpose(source: str, target: str, width: str) -> list[str]:
    """target_{counts, starts, entries} of list pair `pair` from source_{num_blocks, indices}."""
    return [
        f"device const int* num = {source}_num_blocks + ulong(pair) * NQ;",
        f"device const int* listed = {source}_indices + ulong(pair) * NQ * {width};",
        f"device int* counts = {target}_counts + ulong(pair) * NK;",
        f"device int* starts = {target}_starts + ulong(pair) * NK;",
        f"device int* entries = {target}_entries + ulong(pair) * NQ * {width};",
        "for (uint j = 0; j < NK; ++j) {",
        "  counts[j] = 0;",
        "}",
        "for (uint i = 0; i < NQ; ++i) {",
        "  for (int n = 0; n < num[i]; ++n) {",
        f"    counts[listed[i * {width} + n]] += 1;",
        "  }",
        "}",
        "int start = 0;",
        "for (uint j = 0; j < NK; ++j) {",
        "  starts[j] = start;",
        "  start += counts[j];",
        "  counts[j] = 0;  // counts again while scattering",
        "}",
        "for (uint i = 0; i < NQ; ++i) {",
        "  for (int n = 0; n < num[i]; ++n) {",
        f"    const int j = listed[i * {width} + n];",
        "    entries[starts[j] + counts[j]] = int(i);",
        "    counts[j] += 1;",
        "  }",
        "}",
    ]


@lru_cache(maxsize=32)
def generate_transpose(d: BackwardDescriptor) -> KernelSource:
    """The kernel that builds the transposed lists of `d`'s block mask."""
    pairs = " * ".join(d.keys.pairs().sizes) or "1"
    body = [f"const uint pair = group.x * {THREADS} + lane;  // (batch|1, head|1) list pair",
            f"if (pair < {pairs}) {{"]
    body += indent(["{  // partial blocks"] + indent(_transpose("kv", "q", "Wp")) + ["}"])
    if d.keys.full:
        body += indent(["{  // full blocks"] + indent(_transpose("full_kv", "full_q", "Wf")) + ["}"])
    body.append("}")
    summary = [f"transposed block lists: per {d.keys.k_block}-key block its {d.keys.q_block}-query blocks, "
               "in query-block order"]
    return assemble(transpose_plan(d), summary=summary, builtins=BUILTINS_THREAD, body=body)
