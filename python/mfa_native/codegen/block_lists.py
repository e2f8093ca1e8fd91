"""Kernels that prepare block lists (FlexAttention's BlockMask) on the device.

block_mask_classify, block_mask_kv_lists, block_mask_q_lists: BlockMask.from_mask's
pass. The first classifies every (query block, key block) pair by its allowed pairs
(none, some, all); the others write the lists in FlexAttention's order.

attention_transpose_lists: from the kv lists (per query block, its key blocks), the
transposed lists the dK/dV kernel walks (per key block, its query blocks), as counts,
starts and entries. One thread per (batch|1, head|1) list pair counts, takes the prefix
sum, and scatters in query-block order, so the result, and every gradient summed in its
order, is the same on every run (no atomics).
"""

from __future__ import annotations

from functools import lru_cache

from . import operands
from .blocks import MASKED_BELOW, allowed_terms
from .descriptor import BackwardDescriptor, KernelDescriptor
from .kernel_source import KernelSource, assemble
from .msl import BUILTINS_THREAD, indent, offset
from .plan import GridAxis, LaunchPlan
from .sizes import Extent

TRANSPOSE_KERNEL_NAME = "attention_transpose_lists"
THREADS = 32


def _pairs(d: BackwardDescriptor) -> Extent:
    """The list pairs, (B|1) * (Hq|1)."""
    f = d.blocks
    return Extent(1, (() if f.batch_broadcast else ("B",)) + (() if f.head_broadcast else ("Hq",)))


def transpose_plan(d: BackwardDescriptor) -> LaunchPlan:
    ops = operands.reads(d, *operands.KEY_LISTS) + operands.writes(d, *operands.BUILT_QUERY_LISTS) + operands.sizes(d)
    grid = (GridAxis(_pairs(d), THREADS), GridAxis(Extent(1)), GridAxis(Extent(1)))
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
    pairs = " * ".join(_pairs(d).sizes) or "1"
    body = [f"const uint pair = group.x * {THREADS} + lane;  // (batch|1, head|1) list pair",
            f"if (pair < {pairs}) {{"]
    body += indent(["{  // partial blocks"] + indent(_transpose("kv", "q", "Wp")) + ["}"])
    if d.blocks.full:
        body += indent(["{  // full blocks"] + indent(_transpose("full_kv", "full_q", "Wf")) + ["}"])
    body.append("}")
    summary = [f"transposed block lists: per {d.blocks.k_block}-key block its {d.blocks.q_block}-query blocks, "
               "in query-block order"]
    return assemble(transpose_plan(d), summary=summary, builtins=BUILTINS_THREAD, body=body)


# ---------------------------------------------------------------------------
# BlockMask.from_mask: classify every (query block, key block) pair, then order the lists.

CLASSIFY_KERNEL_NAME = "block_mask_classify"
ROWS_KERNEL_NAME = "block_mask_kv_lists"
COLUMNS_KERNEL_NAME = "block_mask_q_lists"


def classify_plan(d: KernelDescriptor) -> LaunchPlan:
    ops = operands.reads(d, "mask") + operands.writes(d, "block_class") + operands.sizes(d)
    grid = (GridAxis(Extent(1, ("NK",))), GridAxis(Extent(1, ("NQ",))), GridAxis(Extent(1, ("B", "Hq"))))
    return LaunchPlan(CLASSIFY_KERNEL_NAME, tuple(ops), grid, THREADS, d.sizes)


@lru_cache(maxsize=32)
def generate_classify(d: KernelDescriptor) -> KernelSource:
    """One simdgroup per (batch, head, query block, key block): 0 when no pair of the block is
    allowed, 2 when every pair that exists (edge blocks are cut by R and C) is, else 1."""
    f, rules = d.blocks, d.rules
    allowed = " && ".join(allowed_terms(rules, "row", "key", "true"))
    body = ["const uint j = group.x;  // key block", "const uint i = group.y;  // query block",
            "const uint b = group.z / Hq;", "const uint h = group.z % Hq;"]
    if rules.uses_diagonal:
        body.append("const int diagonal = int(C) - int(R);")
    body += [f"const uint rows = min({f.q_block}u, R - i * {f.q_block});",
             f"const uint cols = min({f.k_block}u, C - j * {f.k_block});",
             "uint any_allowed = 0;", "uint all_allowed = 1;",
             "for (uint p = lane; p < rows * cols; p += 32) {",
             f"  const int row = int(i * {f.q_block} + p / cols);",
             f"  const int key = int(j * {f.k_block} + p % cols);",
             f"  bool allowed = {allowed};"]
    if rules.mask != "none":
        m = rules.mask_layout.strides
        at = " + ".join(x for x in (offset("ulong(b)", m[0]), offset("ulong(h)", m[1]), offset("ulong(row)", m[2]),
                                    offset("ulong(key)", m[3])) if x) or "0"
        test = "mask[at] != 0" if rules.mask == "bool" else f"float(mask[at]) > {MASKED_BELOW}"
        body += [f"  const ulong at = {at};", f"  allowed = allowed && {test};"]
    body += ["  any_allowed |= uint(allowed);", "  all_allowed &= uint(allowed);", "}",
             "any_allowed = simd_max(any_allowed);", "all_allowed = simd_min(all_allowed);",
             "if (lane == 0) {",
             "  block_class[((ulong(b) * Hq + h) * NQ + i) * NK + j] = any_allowed ? (all_allowed ? 2 : 1) : 0;",
             "}"]
    summary = [f"block classes for BlockMask.from_mask: {f.q_block}x{f.k_block} blocks, causal {rules.causal}, "
               f"window {rules.window}, mask {rules.mask}"]
    return assemble(classify_plan(d), summary=summary, builtins=BUILTINS_THREAD, body=body)


def _lists_plan(d: KernelDescriptor, name: str, prefix: str, rows: str) -> LaunchPlan:
    lists = (f"{prefix}_num_blocks", f"{prefix}_indices", f"full_{prefix}_num_blocks", f"full_{prefix}_indices")
    ops = operands.reads(d, "block_class") + operands.writes(d, *lists) + operands.sizes(d)
    grid = (GridAxis(Extent(1, ("B", "Hq", rows)), THREADS), GridAxis(Extent(1)), GridAxis(Extent(1)))
    return LaunchPlan(name, tuple(ops), grid, THREADS, d.sizes)


def _ordered(prefix: str, rows: str, width: str, klass: str) -> list[str]:
    """Per list row t, the blocks of class 1 (partial) and 2 (full) first, then the others,
    each in ascending order, as FlexAttention orders them; `klass` indexes block_class."""
    lines = [f"const uint t = group.x * {THREADS} + lane;  // (batch, head, block) of this list row",
             f"if (t < B * Hq * {rows}) {{",
             f"  device int* partial = {prefix}_indices + ulong(t) * {width};",
             f"  device int* full = full_{prefix}_indices + ulong(t) * {width};",
             "  int partial_count = 0;", "  int full_count = 0;",
             f"  for (uint e = 0; e < {width}; ++e) {{",
             f"    const int c = block_class[{klass}];",
             "    if (c == 1) { partial[partial_count++] = int(e); }",
             "    if (c == 2) { full[full_count++] = int(e); }",
             "  }",
             f"  {prefix}_num_blocks[t] = partial_count;", f"  full_{prefix}_num_blocks[t] = full_count;",
             "  int partial_rest = partial_count;", "  int full_rest = full_count;",
             f"  for (uint e = 0; e < {width}; ++e) {{  // then the blocks not listed, as the padding",
             f"    const int c = block_class[{klass}];",
             "    if (c != 1) { partial[partial_rest++] = int(e); }",
             "    if (c != 2) { full[full_rest++] = int(e); }",
             "  }",
             "}"]
    return lines


@lru_cache(maxsize=32)
def generate_kv_lists(d: KernelDescriptor) -> KernelSource:
    """Per (batch, head, query block): its partial and full key blocks."""
    body = _ordered("kv", "NQ", "NK", "ulong(t) * NK + e")
    return assemble(_lists_plan(d, ROWS_KERNEL_NAME, "kv", "NQ"), summary=["kv lists from block classes"],
                    builtins=BUILTINS_THREAD, body=body)


@lru_cache(maxsize=32)
def generate_q_lists(d: KernelDescriptor) -> KernelSource:
    """Per (batch, head, key block): its partial and full query blocks."""
    body = _ordered("q", "NK", "NQ", "(ulong(t / NK) * NQ + e) * NK + t % NK")
    return assemble(_lists_plan(d, COLUMNS_KERNEL_NAME, "q", "NK"), summary=["q lists from block classes"],
                    builtins=BUILTINS_THREAD, body=body)
