"""BlockMask.from_mask on the device: block_mask_classify, block_mask_kv_lists,
block_mask_q_lists. The first classifies every (query block, key block) pair by its allowed
pairs (none, some, all); the others write the lists in FlexAttention's order."""

from __future__ import annotations

from functools import lru_cache

from ...runtime.passes import PassDescription
from ...runtime.templates import evaluate
from ..attention import operands
from ..attention.descriptor import KernelDescriptor, describe, sizes_of
from ..attention.masking import MASKED_BELOW, allowed_terms
from ..attention.passes import valid_for
from ..attention.problem import AttentionProblem
from ..kernel.msl import BUILTINS_THREAD, offset
from ..kernel.passes import TensorSpec, build_template
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from ..kernel.tables import CPU_FAMILY

THREADS = 32

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
    f, rules = d.keys, d.rules
    allowed = " && ".join(allowed_terms(rules, "row", "key", "true"))
    body = ["const uint j = group.x;  // key block", "const uint i = group.y;  // query block",
            "const uint b = group.z / Hq;", "const uint h = group.z % Hq;"]
    if rules.uses_diagonal:
        body.append("const int diagonal = int(C) - int(R);")
    body += [f"const uint rows = min({f.q_block}u, R - i * {f.q_block});",
             f"const uint cols = min({f.k_block}u, C - j * {f.k_block});",
             "uint any_allowed = 0;", "uint all_allowed = 1;",
             "for (ulong p = lane; p < ulong(rows) * cols; p += 32) {  // a block's pairs may pass 2**32",
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


def block_mask_pass(problem: AttentionProblem, *, family: str = CPU_FAMILY) -> PassDescription:
    """BlockMask.from_mask on the device: the problem's masking rules (causal, window, mask),
    its block sizes (problem.keys, BlockLists), its batch and query heads; q, k and v play no part.
    Outputs the eight lists of a BlockMask, in FlexAttention's order."""
    p = problem
    d = describe(p, family=family)
    B, Hq, R, C, NQ, NK = (Extent(1, (name,)) for name in ("B", "Hq", "R", "C", "NQ", "NK"))
    inputs = {"mask": TensorSpec(p.mask_dtype, (B, Hq, R, C), d.rules.mask_layout.strides)} if p.mask != "none" else {}
    outputs = {}
    for prefix, blocks, width in (("kv", NQ, NK), ("q", NK, NQ)):
        for full in ("", "full_"):
            outputs[f"{full}{prefix}_num_blocks"] = TensorSpec("int32", (B, Hq, blocks))
            outputs[f"{full}{prefix}_indices"] = TensorSpec("int32", (B, Hq, blocks, width))
    kernels = (generate_classify(d), generate_kv_lists(d), generate_q_lists(d))
    sizes = sizes_of(p)
    given = tuple(name for name in sizes if name not in dict(d.keys.derived))
    template = build_template("block_mask_from_mask", kernels, sizes=given, inputs=inputs,
                              outputs=outputs, derived=d.keys.derived, valid_for=valid_for(p, family))
    return evaluate(template, sizes)
