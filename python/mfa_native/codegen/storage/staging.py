"""K/V rows staged in threadgroup memory: each step, every thread of the threadgroup loads a
share of the step's key rows into `k_stage` (and `v_stage`), each row read from device
memory once, and every simdgroup's products read the stage. The kernels whose rows are the
query heads of one kv head use it (sparse-indexed attention, packed-heads attention), so a
K/V byte is read once per kv head however many query heads read it.

How a row is loaded is its storage's (stored.py): plain elements are copied in the
problem's dtype; a quantized group of `group_size` values is decoded once, its scale and
bias read once (nothing writes a dequantized copy to device memory). A slot that names no
key stores 0 and reads nothing.

The per-head kernels stage their walked blocks the same way where the tile table says so
(stage_kv, stage_q_dout): every simdgroup of the threadgroup reads the block from the stage.
A block a mask removes for every simdgroup is skipped by all of them (`SkipVote`), so no
thread reads it and every thread reaches the same barriers.

At large head dimension (the tile table's stage_apart) K and V take turns in one buffer
(`apart`): K's rows are staged for S = Q K^T, then V's rows, over them, for O += P V, so a
step's stage is max(D, Dv) wide instead of D + Dv (`phases` says which tensors each fill
loads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..kernel.layouts import OperandLayout
from ..kernel.msl import BARRIER, MSL_TYPES, loop
from .facet import StorageFacts
from .stored import PLAIN



@dataclass(frozen=True)
class StagedTensor:
    """One tensor a stage holds: `name` (k or v; its MSL pointer is `{name}_head`, and
    `{name}_scales_head` / `{name}_biases_head` for affine fields), its feature width, its
    layout and its storage (stored.py)."""

    name: str
    width: int
    layout: OperandLayout
    storage: StorageFacts = PLAIN
    shared: bool = False   # takes turns with the other tensors in one buffer, SHARED_STAGE

    @property
    def stage(self) -> str:
        return SHARED_STAGE if self.shared else f"{self.name}_stage"


SHARED_STAGE = "kv_stage"
VOTES = "block_votes"


@dataclass(frozen=True)
class SkipVote:
    """A block the whole threadgroup skips when no simdgroup's `flag` (a uint, uniform in its
    simdgroup) is set: lane 0 of each of the `voters` simdgroups posts its flag before the fill's
    first barrier, every thread reads them all after it, and a skipped block takes the fill's
    second barrier too, so no vote is overwritten before every thread has read it."""

    flag: str
    voters: int

    def post(self) -> list[str]:
        """Lane 0's store of its simdgroup's vote (before the barrier). Reads lane, simd_index."""
        return [f"if (lane == 0) {{ {VOTES}[simd_index] = {self.flag}; }}  // this simdgroup's vote: does it see "
                "the block?"]

    def count(self) -> list[str]:
        """After the barrier: every thread reads the votes and, when none is set, the whole
        threadgroup takes a second barrier and skips the block."""
        return (["uint block_seen_by_any = 0u;"]
                + loop(f"ushort i = 0; i < {self.voters}; ++i", [f"block_seen_by_any |= {VOTES}[i];"])
                + ["if (block_seen_by_any == 0u) {  // the same verdict in every thread",
                   "  " + BARRIER + "  // every thread has read the votes",
                   "  continue;  // the mask removes this block for every simdgroup: none stages or reads it",
                   "}"])


def step_fills(tensors: list[StagedTensor], rows: int, dtype: str, *, start: str, end: str,
               stored_row: Callable[[str], str], voters: int = 0) -> list[list[str]]:
    """The fills of the step whose positions are `start` + slot for stage rows slot < `rows`
    (those at or past `end` store 0): one per phase (`phases`), then an empty one.
    `stored_row(position)` is where a position's row is stored (Positions.row); with `voters`
    (the kernel has a mask), the first fill's first barrier takes their SkipVote on `block_seen`."""
    at = f"min({start} + slot, int({end}) - 1)"   # clamped: a paged position past the end names no page
    vote = SkipVote("block_seen", voters) if voters else None
    fills = [fill(phase, rows, dtype, key=stored_row(at), valid=f"{start} + slot < {end}",
                  vote=vote if i == 0 else None) for i, phase in enumerate(phases(tensors))]
    return fills + [[]]


def apart(tensors: list[StagedTensor]) -> list[StagedTensor]:
    """The tensors, taking turns in one buffer (SHARED_STAGE) rather than each in its own."""
    return [replace(t, shared=True) for t in tensors]


def phases(tensors: list[StagedTensor]) -> list[list[StagedTensor]]:
    """The fills of one step: one for all tensors, or one per tensor when they take turns."""
    return [[t] for t in tensors] if any(t.shared for t in tensors) else [tensors]


def declare(tensors: list[StagedTensor], rows: int, dtype: str, threads: str, voters: int = 0) -> list[str]:
    """The threadgroup arrays of the staged rows (and, for `voters` simdgroups voting on skipped
    blocks, SkipVote's votes), and `member` and `threads`: the thread's place in the threadgroup
    and its size. Reads simd_index, lane."""
    lines = [f"threadgroup uint {VOTES}[{voters}];  // SkipVote: each simdgroup's view of a block"] if voters else []
    lines += [f"threadgroup {MSL_TYPES[dtype]} {t.stage}[{rows * t.width}];  // the step's {t.name.upper()} rows, "
             "shared by every simdgroup" for t in tensors if not t.shared]
    shared = [t for t in tensors if t.shared]
    if shared:
        names = " then ".join(t.name.upper() for t in shared)
        lines.append(f"threadgroup {MSL_TYPES[dtype]} {SHARED_STAGE}[{rows * max(t.width for t in shared)}];  "
                     f"// the step's {names} rows in turn, shared by every simdgroup")
    return lines + ["const uint member = simd_index * 32 + lane;  // this thread's place in the threadgroup",
                    f"const uint threads = {threads};"]


def fill(tensors: list[StagedTensor], rows: int, dtype: str, key: str, valid: str,
         vote: SkipVote | None = None) -> list[str]:
    """Loads stage rows 0..rows-1 of every tensor: row `slot` holds key `key` (an expression of
    `slot`) when `valid` (an expression of `slot` and `key`), else 0. Barriers before (the last
    step's readers are done) and after; with a `vote`, the first barrier also collects the
    simdgroups' votes and the threadgroup skips the block (`continue`) when none sees it.
    Reads member, threads and the tensors' pointers."""
    lines = (vote.post() if vote else []) + [BARRIER + "  // the previous step's stage is read"]
    lines += vote.count() if vote else []
    for t in tensors:
        lines += t.storage.stage(t.name, t.stage, t.width, t.layout, rows, dtype, key, valid)
    return lines + [BARRIER + "  // the stage is filled"]
