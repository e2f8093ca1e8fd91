"""sparse_topk_stream: the indexer's scores and a running top-k, block by block; no score is
stored. One threadgroup of STREAM_THREADS threads per (split, query row, batch) walks the
split's candidate keys in blocks of BLOCK_KEYS (each simdgroup scores SIMD_KEYS of them,
topk_scores.py) and keeps the best L = min(K, C) entries seen so far, sorted, in threadgroup
memory (L <= TOPK_LIMIT). Per block:

1. the block's (score, key) entries go to threadgroup memory, keys past the split's
   candidates as padding;
2. if no entry comes before the running list's last (the common case once the list holds
   good entries), the block is done;
3. else the block is sorted (bitonic) and merged into the list in place: each thread takes
   its entries of both runs to registers with their places in the merged run (topk_order),
   a barrier, and the entries whose place is below L are written there.

At the end the list (padding where the split had fewer than L candidates) is the split's run
in `run_scores` / `run_keys`, (B, R, S, L); sparse_topk_merge merges the S runs of a row.
Device memory written: S * B * R * L entries, whatever C is.
"""

from __future__ import annotations

from functools import lru_cache

from ..kernel.msl import BARRIER, BUILTINS_LANE, MSL_TYPES, indent, loop
from ..kernel.plan import GridAxis, LaunchPlan, Operand
from ..kernel.sizes import SIZES_OPERAND, Extent
from ..kernel.source import KernelSource, assemble
from .topk_order import PAD_KEY, PAD_SCORE, Entry, Run, before, bitonic_sort, count_before
from .topk_scores import head_scores, score_slots

KERNEL_NAME = "sparse_topk_stream"
TOPK_LIMIT = 2048        # the running list's capacity: L = min(topk, C) must fit (16 KiB of threadgroup memory)
STREAM_THREADS = 256     # 8 simdgroups
SIMD_KEYS = 32           # keys each simdgroup scores per block
BLOCK_KEYS = STREAM_THREADS // 32 * SIMD_KEYS   # 256: one entry per thread
BUILTINS = [BUILTINS_LANE[0], "ushort simd_index [[simdgroup_index_in_threadgroup]]", BUILTINS_LANE[1]]
LIST, BLOCK = Run("list_scores", "list_keys"), Run("block_scores", "block_keys")
RUNS = Extent(1, ("B", "R", "S", "L"))


def candidates(causal: bool) -> str:
    """Row r's candidate count: keys 0 .. candidates - 1 (c <= r + C - R with causal)."""
    return "min(C, uint(max(0, int(r) + int(C) - int(R) + 1)))" if causal else "C"


def stream_plan(d) -> LaunchPlan:
    t = MSL_TYPES[d.dtype]
    ops = (Operand("q", f"device const {t}*", "indexer queries"), Operand("k", f"device const {t}*", "indexer keys"),
           Operand("weights", "device const float*", "(B, Hi, R) head weights"),
           Operand("run_scores", "device float*", "(B, R, S, L) each split's best scores, best first", RUNS),
           Operand("run_keys", "device int*", "their keys (padding: 2**31 - 1)", RUNS),
           Operand(SIZES_OPERAND, f"constant {d.sizes.struct}&", "runtime sizes"))
    grid = (GridAxis(Extent(1, ("S",))), GridAxis(Extent(1, ("R",))), GridAxis(Extent(1, ("B",))))
    return LaunchPlan(KERNEL_NAME, ops, grid, STREAM_THREADS, d.sizes)


def _enters() -> list[str]:
    """Step 2: `enters`, whether some block entry comes before the list's last (uniform)."""
    mine, last = BLOCK.at("member"), LIST.at("L - 1")
    return [f"const bool some_enter = simd_any({before(mine, last)});",
            "if (lane == 0) {",
            "  block_enters[simd_index] = some_enter ? 1u : 0u;",
            "}",
            BARRIER + "  // every simdgroup's verdict is in",
            "uint enters = 0;"] + loop(f"ushort g = 0; g < {STREAM_THREADS // 32}; ++g",
                                       ["enters |= block_enters[g];"])


def _merge() -> list[str]:
    """Step 3 after the sort: both runs' entries to registers with their merged places, a
    barrier, then the entries placed below L are written (the list's run is the earlier one)."""
    per_list = TOPK_LIMIT // STREAM_THREADS
    lines = [f"float mine_score = {BLOCK.at('member').score};", f"int mine_key = {BLOCK.at('member').key};"]
    lines += count_before("mine_before", run=LIST, length="L", capacity=TOPK_LIMIT,
                          entry=Entry("mine_score", "mine_key"), ties_first=True)
    lines += [f"float kept_score[{per_list}];", f"int kept_key[{per_list}];", f"uint kept_place[{per_list}];"]
    lines += loop(f"ushort t = 0; t < {per_list}; ++t", [
        f"const uint i = member + t * {STREAM_THREADS};",
        f"kept_score[t] = i < L ? {LIST.at('i').score} : {PAD_SCORE};",
        f"kept_key[t] = i < L ? {LIST.at('i').key} : {PAD_KEY};",
        *count_before("moved", run=BLOCK, length=str(BLOCK_KEYS), capacity=BLOCK_KEYS,
                      entry=Entry("kept_score[t]", "kept_key[t]"), ties_first=False),
        "kept_place[t] = i + moved;"])
    lines += [BARRIER + "  // every place is known: the writes may begin",
              "const uint mine_place = member + mine_before;",
              "if (mine_place < L) {",
              f"  {LIST.at('mine_place').score} = mine_score;", f"  {LIST.at('mine_place').key} = mine_key;",
              "}"]
    lines += loop(f"ushort t = 0; t < {per_list}; ++t", [
        f"const uint i = member + t * {STREAM_THREADS};",
        "if (i < L && kept_place[t] < L && kept_place[t] != i) {",
        f"  {LIST.at('kept_place[t]').score} = kept_score[t];", f"  {LIST.at('kept_place[t]').key} = kept_key[t];",
        "}"])
    return lines


@lru_cache(maxsize=32)
def generate_stream(d) -> KernelSource:
    """The streaming kernel of descriptor `d` (topk.TopkDescriptor)."""
    body = ["const uint split = group.x;", "const uint r = group.y;", "const uint b = group.z;",
            "const uint member = simd_index * 32 + lane;  // this thread's place in the threadgroup",
            "const uint key_begin = split * Cs;",
            f"const uint key_end = min({candidates(d.causal)}, key_begin + Cs);  // this split's candidates",
            f"threadgroup float list_scores[{TOPK_LIMIT}];  // the best L entries so far, best first",
            f"threadgroup int list_keys[{TOPK_LIMIT}];",
            f"threadgroup float block_scores[{BLOCK_KEYS}];  // the block's entries",
            f"threadgroup int block_keys[{BLOCK_KEYS}];",
            f"threadgroup uint block_enters[{STREAM_THREADS // 32}];  // per simdgroup: some entry of it enters"]
    body += loop(f"uint i = member; i < L; i += {STREAM_THREADS}", [
        f"{LIST.at('i').score} = {PAD_SCORE};", f"{LIST.at('i').key} = {PAD_KEY};"], unroll=False)
    slot = f"simd_index * {SIMD_KEYS} + slot"
    entries = score_slots(SIMD_KEYS, [
        "const uint key = simd_first + slot;",
        "const bool candidate = key < key_end;",
        f"{BLOCK.at(slot).score} = candidate ? score : {PAD_SCORE};",
        f"{BLOCK.at(slot).key} = candidate ? int(key) : {PAD_KEY};"])
    block = [BARRIER + "  // the last block's merge (or the list's padding) is written",
             f"const uint simd_first = block_first + simd_index * {SIMD_KEYS};",
             *head_scores(d, keys=SIMD_KEYS, first="simd_first", end="key_end"), *entries,
             BARRIER + "  // the block's entries are in", *_enters(),
             "if (enters != 0) {  // uniform: every thread read the same flags"]
    block += indent(bitonic_sort(run=BLOCK, size=BLOCK_KEYS, member="member", barrier=BARRIER) + _merge()) + ["}"]
    body += ["", f"// The split's candidates, {BLOCK_KEYS} keys a block."]
    body += loop(f"uint block_first = key_begin; block_first < key_end; block_first += {BLOCK_KEYS}", block,
                 unroll=False)
    body += [BARRIER + "  // the list is final", "const ulong run = ((ulong(b) * R + r) * S + split) * L;"]
    body += loop(f"uint i = member; i < L; i += {STREAM_THREADS}", [
        f"run_scores[run + i] = {LIST.at('i').score};", f"run_keys[run + i] = {LIST.at('i').key};"], unroll=False)
    summary = [f"indexer scores and running top-k: {d.dtype}, Di = {d.head_dim}, {BLOCK_KEYS} keys a block, "
               f"L <= {TOPK_LIMIT}{', causal candidates' if d.causal else ''}"]
    return assemble(stream_plan(d), summary=summary, builtins=BUILTINS, body=body)
