"""K/V rows staged in threadgroup memory: each step, every thread of the threadgroup loads a
share of the step's key rows into `k_stage` (and `v_stage`), each row read from device
memory once, and every simdgroup's products read the stage. The kernels whose rows are the
query heads of one kv head use it (sparse-indexed attention, packed-heads attention), so a
K/V byte is read once per kv head however many query heads read it.

How a row is loaded is its storage's (stored.py): plain elements are copied in the
problem's dtype; a quantized group of `group_size` values is decoded once, its scale and
bias read once (nothing writes a dequantized copy to device memory). A slot that names no
key stores 0 and reads nothing.

At large head dimension (the tile table's stage_apart) K and V take turns in one buffer
(`apart`): K's rows are staged for S = Q K^T, then V's rows, over them, for O += P V, so a
step's stage is max(D, Dv) wide instead of D + Dv (`phases` says which tensors each fill
loads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..kernel.layouts import OperandLayout
from ..kernel.msl import MSL_TYPES
from .stored import PLAIN

BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


@dataclass(frozen=True)
class StagedTensor:
    """One tensor a stage holds: `name` (k or v; its MSL pointer is `{name}_head`, and
    `{name}_scales_head` / `{name}_biases_head` for affine fields), its feature width, its
    layout and its storage (stored.py)."""

    name: str
    width: int
    layout: OperandLayout
    storage: object = PLAIN
    shared: bool = False   # takes turns with the other tensors in one buffer, SHARED_STAGE

    @property
    def stage(self) -> str:
        return SHARED_STAGE if self.shared else f"{self.name}_stage"


SHARED_STAGE = "kv_stage"


def apart(tensors: list[StagedTensor]) -> list[StagedTensor]:
    """The tensors, taking turns in one buffer (SHARED_STAGE) rather than each in its own."""
    return [replace(t, shared=True) for t in tensors]


def phases(tensors: list[StagedTensor]) -> list[list[StagedTensor]]:
    """The fills of one step: one for all tensors, or one per tensor when they take turns."""
    return [[t] for t in tensors] if any(t.shared for t in tensors) else [tensors]


def declare(tensors: list[StagedTensor], rows: int, dtype: str, threads: str) -> list[str]:
    """The threadgroup arrays of the staged rows, and `member` and `threads`: the thread's
    place in the threadgroup and its size. Reads simd_index, lane."""
    lines = [f"threadgroup {MSL_TYPES[dtype]} {t.stage}[{rows * t.width}];  // the step's {t.name.upper()} rows, "
             "shared by every simdgroup" for t in tensors if not t.shared]
    shared = [t for t in tensors if t.shared]
    if shared:
        names = " then ".join(t.name.upper() for t in shared)
        lines.append(f"threadgroup {MSL_TYPES[dtype]} {SHARED_STAGE}[{rows * max(t.width for t in shared)}];  "
                     f"// the step's {names} rows in turn, shared by every simdgroup")
    return lines + ["const uint member = simd_index * 32 + lane;  // this thread's place in the threadgroup",
                    f"const uint threads = {threads};"]


def fill(tensors: list[StagedTensor], rows: int, dtype: str, key: str, valid: str) -> list[str]:
    """Loads stage rows 0..rows-1 of every tensor: row `slot` holds key `key` (an expression of
    `slot`) when `valid` (an expression of `slot` and `key`), else 0. Barriers before (the last
    step's readers are done) and after. Reads member, threads and the tensors' pointers."""
    lines = [BARRIER + "  // the previous step's stage is read"]
    for t in tensors:
        lines += t.storage.stage(t.name, t.stage, t.width, t.layout, rows, dtype, key, valid)
    return lines + [BARRIER + "  // the stage is filled"]
