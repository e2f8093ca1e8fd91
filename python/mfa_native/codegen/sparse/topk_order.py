"""Sorted runs of (score, key) entries in the indexer's order, as MSL lines: the pieces the
streaming top-k (topk_stream.py) and the merge of its splits (topk_merge.py) share.

The order is `ranks_before`'s (kernel/msl.py): descending score, NaN above every number, the
lower key first among equal scores and among NaNs. Every run is sorted best first. An empty
slot holds the padding entry (PAD_SCORE, PAD_KEY): -inf with a key above every real key, so
it comes after every real entry (a real -inf score included) and sorts, merges and pads with
no special case; the outputs write it as key -1, score -inf.

Two runs merge without a second buffer: an entry's place in the merged run is its index in
its own run plus the number of entries of each other run that come before it, found by a
binary search (`count_before`). Padding entries are the only equal pairs (real keys are
distinct), so a tie goes to the earlier run (`ties_first`) and the places are a permutation.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel.msl import indent, loop, ranks_before

PAD_SCORE = "-INFINITY"
PAD_KEY = "2147483647"   # above every key: C < 2**31


@dataclass(frozen=True)
class Entry:
    """An (score, key) pair of MSL expressions."""

    score: str
    key: str


@dataclass(frozen=True)
class Run:
    """A run held in two arrays (threadgroup or device memory), from element `first`."""

    scores: str
    keys: str
    first: str = "0"

    def at(self, i: str) -> Entry:
        where = i if self.first == "0" else f"{self.first} + {i}"
        return Entry(f"{self.scores}[{where}]", f"{self.keys}[{where}]")


def before(a: Entry, b: Entry) -> str:
    """An MSL bool: entry `a` comes before entry `b` (strictly)."""
    return ranks_before(score=b.score, key=b.key, other_score=a.score, other_key=a.key)


def count_before(result: str, *, run: Run, length: str, capacity: int, entry: Entry,
                 ties_first: bool | str) -> list[str]:
    """Defines `uint result`: how many of the sorted `run`'s first `length` (<= capacity)
    entries come before `entry`, counting an equal entry too when `ties_first` (True, False or
    an MSL bool: `run` is the earlier run). Those entries are a prefix: binary lifting over the
    bits of `capacity`, a loop of fixed count."""
    bits = capacity.bit_length()   # counts up to 2**bits - 1 >= capacity
    probe = run.at("probe")
    not_after, ahead = f"!({before(entry, probe)})", before(probe, entry)
    precedes = not_after if ties_first is True else ahead if ties_first is False else \
        f"({ties_first} ? {not_after} : {ahead})"
    return [f"uint {result} = 0;"] + loop(f"uint bit = 0; bit < {bits}; ++bit", [
        f"const uint step = 1u << ({bits - 1} - bit);",
        f"const uint probe = {result} + step - 1;",
        f"if (probe < {length} && {precedes}) {{",
        f"  {result} += step;",
        "}"])


def bitonic_sort(*, run: Run, size: int, member: str, barrier: str) -> list[str]:
    """Sorts the `size` (a power of two) entries of a threadgroup `run` best first: bitonic
    stages of size / 2 compare-exchanges each, one per thread `member` < size / 2, a barrier
    after every stage. Every thread of the threadgroup must run it (the barriers)."""
    levels = size.bit_length() - 1
    lo, hi = run.at("lo"), run.at("hi")
    exchange = [
        "const uint lo = (member / stride) * 2 * stride + member % stride;",
        "const uint hi = lo + stride;",
        f"const float lo_score = {lo.score};", f"const int lo_key = {lo.key};",
        f"const float hi_score = {hi.score};", f"const int hi_key = {hi.key};",
        "const bool best_first = (lo & width) == 0;  // this pair's half sorts best first",
        f"const bool hi_wins = {before(Entry('hi_score', 'hi_key'), Entry('lo_score', 'lo_key'))};",
        f"const bool lo_wins = {before(Entry('lo_score', 'lo_key'), Entry('hi_score', 'hi_key'))};",
        "if (best_first ? hi_wins : lo_wins) {",
        f"  {lo.score} = hi_score;", f"  {lo.key} = hi_key;",
        f"  {hi.score} = lo_score;", f"  {hi.key} = lo_key;",
        "}"]
    stage = ["const uint width = 1u << level;  // the bitonic sequences being merged",
             "const uint stride = width >> (pass + 1);",
             f"if ({member} < {size // 2}) {{"] + indent(exchange) + ["}", barrier]
    return loop(f"uint level = 1; level < {levels + 1}; ++level",
                loop("uint pass = 0; pass < level; ++pass", stage, unroll=False), unroll=False)
