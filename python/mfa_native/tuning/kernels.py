"""The kernels a direction's tile row configures, the columns each reads, and the row made of
each kernel's fastest columns: the tuner times every dispatch on its own (profile(): GPU
timestamps per dispatch on Metal, wall time on the cpu backend), so the dQ kernel's columns
are chosen by the dQ kernel's time and the dK/dV kernel's by the dK/dV kernel's."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

from ..codegen.attention.backward import DKDV_KERNEL_NAME, DQ_KERNEL_NAME
from ..codegen.kernel.table_columns import BACKWARD_KERNEL_COLUMNS, FORWARD_COLUMNS

# Per direction, its kernels and the columns each reads (the forward's kernels read them all).
KERNEL_COLUMNS: dict[str, dict[str, tuple[str, ...]]] = {
    "forward": {"forward": tuple(FORWARD_COLUMNS)},
    "backward": BACKWARD_KERNEL_COLUMNS,
}
_BACKWARD_ENTRIES = {DQ_KERNEL_NAME: "dq", DKDV_KERNEL_NAME: "dkdv"}


def kernel_of(direction: str, entry: str) -> str:
    """Which of KERNEL_COLUMNS[direction] a dispatch of the kernel `entry` is."""
    if direction == "forward":
        return "forward"
    if entry not in _BACKWARD_ENTRIES:
        raise ValueError(f"kernel {entry!r} is none of the backward's tuned kernels ({', '.join(_BACKWARD_ENTRIES)})")
    return _BACKWARD_ENTRIES[entry]


def seconds_by_kernel(direction: str, records) -> dict[str, float]:
    """The profiled dispatches' seconds (profiling.DispatchRecord), summed per kernel. Raises
    RuntimeError when a dispatch has no time (a Metal device that cannot sample timestamps)."""
    seconds = dict.fromkeys(KERNEL_COLUMNS[direction], 0.0)
    for record in records:
        if record.seconds is None:
            raise RuntimeError(f"the device reported no time for a dispatch of {record.kernel!r} "
                               "(on Metal: no timestamp sampling at stage boundaries); the tuner times each kernel")
        seconds[kernel_of(direction, record.kernel)] += record.seconds
    return seconds


def _shared_columns(direction: str) -> list[str]:
    """The columns more than one kernel reads (the backward's tiles16)."""
    kernels = KERNEL_COLUMNS[direction].values()
    names = dict.fromkeys(name for columns in kernels for name in columns)
    return [name for name in names if sum(name in columns for columns in kernels) > 1]


def fastest_per_kernel(direction: str, timed: dict) -> object:
    """The row whose every kernel's columns come from the candidate fastest in that kernel
    (`timed`: row -> seconds by kernel). Columns several kernels read are chosen together:
    for each of their value combinations among the candidates, each kernel's fastest candidate
    with it; of those, the combination with the least total time."""
    kernels = KERNEL_COLUMNS[direction]
    shared = _shared_columns(direction)
    by_shared = defaultdict(list)
    for row in timed:
        by_shared[tuple(getattr(row, name) for name in shared)].append(row)
    best, best_seconds = None, math.inf
    for rows in by_shared.values():
        fastest = {kernel: min(rows, key=lambda row: timed[row][kernel]) for kernel in kernels}
        seconds = sum(timed[fastest[kernel]][kernel] for kernel in kernels)
        if seconds < best_seconds:
            best_seconds = seconds
            best = replace(rows[0], **{name: getattr(fastest[kernel], name)
                                       for kernel, columns in kernels.items() for name in columns})
    return best
