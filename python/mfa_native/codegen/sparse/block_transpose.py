"""attention_transpose_lists: from the kv lists (per query block, its key blocks), the
transposed lists the dK/dV kernel walks (per key block, its query blocks), as counts,
starts and entries. One thread per (batch|1, head|1) list pair counts, takes the prefix
sum, and scatters in query-block order, so the result, and every gradient summed in its
order, is the same on every run (no atomics). Each key block's entries are ascending (a
query block listing it twice appears twice).

attention_verify_lists: when the caller gives q lists, one thread per (list pair, key block)
compares them with the transpose as multisets (the counted part in any order), and writes
q_lists_differ (bit 1: q lists, bit 2: full_q lists), which the op turns into an error.
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
VERIFY_KERNEL_NAME = "attention_verify_lists"
THREADS = 32
# The transposed lists it builds (block_visits.BUILT_QUERY_LISTS).
BUILT_QUERY_LISTS = ("q_counts", "q_starts", "q_entries", "full_q_counts", "full_q_starts", "full_q_entries")
# The lists a caller may give for the backward, checked against BUILT_QUERY_LISTS.
GIVEN_QUERY_LISTS = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
DIFFER = "q_lists_differ"
# A partial block's mask bits: per query block the number of its list's first bit block, and the
# bits; the transpose gives each entry of q_entries its bit block (BUILT_BITS).
BIT_LISTS = ("kv_bit_blocks", "kv_bits")
BUILT_BITS = "q_bit_blocks"


def transpose_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = (operands.reads(d, "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "kv_bit_blocks")
           + operands.writes(d, *BUILT_QUERY_LISTS, BUILT_BITS) + operands.sizes(d))
    grid = (GridAxis(d.keys.pairs(), THREADS), GridAxis(Extent(1)), GridAxis(Extent(1)))
    return LaunchPlan(TRANSPOSE_KERNEL_NAME, tuple(ops), grid, THREADS, d.sizes)


def _transpose(source: str, target: str, width: str, bits: bool = False) -> list[str]:
    """target_{counts, starts, entries} of list pair `pair` from source_{num_blocks, indices};
    with `bits`, each entry's mask-bit block in q_bit_blocks."""
    scatter = ["    entries[starts[j] + counts[j]] = int(i);"]
    if bits:
        scatter.append(f"    {BUILT_BITS}[ulong(pair) * NQ * {width} + starts[j] + counts[j]] = "
                       "kv_bit_blocks[ulong(pair) * NQ + i] + n;")
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
        *scatter,
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
    body += indent(["{  // partial blocks"] + indent(_transpose("kv", "q", "Wp", d.keys.bits)) + ["}"])
    if d.keys.full:
        body += indent(["{  // full blocks"] + indent(_transpose("full_kv", "full_q", "Wf")) + ["}"])
    body.append("}")
    summary = [f"transposed block lists: per {d.keys.k_block}-key block its {d.keys.q_block}-query blocks, "
               "in query-block order"]
    return assemble(transpose_plan(d), summary=summary, builtins=BUILTINS_THREAD, body=body)


def verify_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = (operands.reads(d, *GIVEN_QUERY_LISTS, *BUILT_QUERY_LISTS) + operands.writes(d, DIFFER)
           + operands.sizes(d))
    grid = (GridAxis(d.keys.pairs().times(Extent(1, ("NK",))), THREADS), GridAxis(Extent(1)), GridAxis(Extent(1)))
    return LaunchPlan(VERIFY_KERNEL_NAME, tuple(ops), grid, THREADS, d.sizes)


def _verify(prefix: str, width: str, built_width: str, bit: int) -> list[str]:
    """Sets bit `bit` of `differ` unless the given `prefix` list of key block t holds the built one's
    query blocks: the same count, and the given entry of rank r (ties in list order) is the
    r-th built entry (the built entries are ascending)."""
    return [
        f"const int count = {prefix}_num_blocks[t];",
        f"device const int* given = {prefix}_indices + ulong(t) * {width};",
        f"device const int* built = {prefix}_entries + ulong(pair) * NQ * {built_width} + {prefix}_starts[t];",
        f"bool same = count == {prefix}_counts[t];",
        "for (int n = 0; same && n < count; ++n) {",
        "  int rank = 0;",
        "  for (int m = 0; m < count; ++m) {",
        "    rank += int(given[m] < given[n] || (given[m] == given[n] && m < n));",
        "  }",
        "  same = built[rank] == given[n];",
        "}",
        f"differ |= same ? 0 : {bit};",
    ]


@lru_cache(maxsize=32)
def generate_verify(d: BackwardDescriptor) -> KernelSource:
    """The kernel that checks the given q lists of `d`'s block mask against the built ones."""
    pairs = " * ".join(d.keys.pairs().sizes) or "1"
    body = [f"const uint t = group.x * {THREADS} + lane;  // (list pair, key block)",
            f"if (t < {pairs} * NK) {{", "  const uint pair = t / NK;", "  int differ = 0;"]
    body += indent(["{  // partial blocks"] + indent(_verify("q", "Wq", "Wp", 1)) + ["}"])
    if d.keys.full:
        body += indent(["{  // full blocks"] + indent(_verify("full_q", "Wqf", "Wf", 2)) + ["}"])
    body += [f"  {DIFFER}[t] = differ;", "}"]
    summary = ["the given q lists against the transposed kv lists, as multisets per key block"]
    return assemble(verify_plan(d), summary=summary, builtins=BUILTINS_THREAD, body=body)
