"""sparse_topk_merge: a row's S sorted runs (sparse_topk_stream's splits) merged into its top
K, padded. One threadgroup of MERGE_THREADS threads per (query row, batch); each thread takes
entries of the runs and computes its place in the merged order: its index in its own run plus,
for every other run, the number of that run's entries before it (topk_order.count_before,
ties to the earlier run: only padding entries are equal). The places are a permutation of
0 .. S * L - 1; an entry placed below K is written there (padding as -1, -inf), and the
slots S * L .. K - 1 (topk above C) are padding. Every output slot is written once, and with
one split this is the copy of its run: one mechanism for every S.
"""

from __future__ import annotations

from functools import lru_cache

from ..kernel.msl import BUILTINS_THREAD, indent, loop
from ..kernel.plan import GridAxis, LaunchPlan, Operand
from ..kernel.sizes import SIZES_OPERAND, Extent
from ..kernel.source import KernelSource, assemble
from .topk_order import PAD_KEY, Entry, Run, count_before
from .topk_stream import RUNS, TOPK_LIMIT

KERNEL_NAME = "sparse_topk_merge"
MERGE_THREADS = 256


def merge_plan(d) -> LaunchPlan:
    ops = (Operand("run_scores", "device const float*", "(B, R, S, L) each split's best scores", RUNS),
           Operand("run_keys", "device const int*", "their keys", RUNS),
           Operand("indices", "device int*", "the kept keys of each row, best first, -1 as padding"),
           Operand("topk_scores", "device float*", "their scores, -inf as padding"),
           Operand(SIZES_OPERAND, f"constant {d.sizes.struct}&", "runtime sizes"))
    grid = (GridAxis(Extent(1, ("R",))), GridAxis(Extent(1, ("B",))), GridAxis(Extent(1)))
    return LaunchPlan(KERNEL_NAME, ops, grid, MERGE_THREADS, d.sizes)


@lru_cache(maxsize=32)
def generate_merge(d) -> KernelSource:
    """The merge kernel of descriptor `d` (topk.TopkDescriptor)."""
    runs = Run("run_scores", "run_keys", first="other_first")
    out = "(ulong(b) * R + r) * K"  # both layouts: the size-1 head axis makes (B, 1, R, K) and (B, R, 1, K) alike
    per_entry = ["const uint own = e / L;  // its run", "const uint index = e - own * L;",
                 "const float score = run_scores[rows + e];", "const int key = run_keys[rows + e];",
                 "uint place = index;"]
    per_entry += loop("uint other = 0; other < S; ++other", [
        "if (other != own) {",
        "  const ulong other_first = rows + ulong(other) * L;",
        *indent(count_before("ahead", run=runs, length="L", capacity=TOPK_LIMIT, entry=Entry("score", "key"),
                             ties_first="other < own")),  # equal entries (padding only): the earlier run's first
        "  place += ahead;",
        "}"], unroll=False)
    per_entry += ["if (place < K) {",
                  f"  indices[{out} + place] = key == {PAD_KEY} ? -1 : key;",
                  f"  topk_scores[{out} + place] = score;  // padding's score is -inf",
                  "}"]
    body = ["const uint r = group.x;", "const uint b = group.y;", "const ulong rows = (ulong(b) * R + r) * S * L;",
            "const uint entries = S * L;"]
    body += loop(f"uint e = lane; e < entries; e += {MERGE_THREADS}", per_entry, unroll=False)
    body += loop(f"uint slot = entries + lane; slot < K; slot += {MERGE_THREADS}", [
        f"indices[{out} + slot] = -1;", f"topk_scores[{out} + slot] = -INFINITY;"], unroll=False)
    summary = [f"merge of the indexer's split runs into the top K of each row, padded (L <= {TOPK_LIMIT})"]
    return assemble(merge_plan(d), summary=summary, builtins=BUILTINS_THREAD, body=body)
