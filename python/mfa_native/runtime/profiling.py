"""`mfa_native.profile()`: see the work each dispatch issued."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .. import _core


class DispatchRecord:
    """One dispatch: its kernel, threadgroups, simdgroup 8x8x8 multiply-accumulates,
    seconds (the cpu backend: its wall time; Metal: GPU timestamps sampled around it), and
    the device bytes it read and wrote per kernel argument name (for generated kernels the
    operand names, e.g. "q", "o"). A field is None where the backend cannot count it
    (traffic: the cpu backend counts it exactly, Metal not).

    bytes_read and bytes_written count accesses, not distinct bytes: each load or store
    through a device or constant pointer adds the size of its element, so an element read
    n times counts n times (dense attention's k, read by every simdgroup of every query
    head, shows as a multiple of k.nbytes). They are the traffic the kernel issues, before
    any cache, not the size of what it touches.

    It keeps the core's DispatchStats and reads its fields when asked, so recording a
    dispatch costs the warm path almost nothing."""

    __slots__ = ("_stats",)

    def __init__(self, stats) -> None:
        self._stats = stats

    @property
    def kernel(self) -> str:
        return self._stats.kernel

    @property
    def threadgroups(self) -> int:
        return self._stats.threadgroups

    @property
    def simdgroup_matrix_ops(self) -> int | None:
        return self._stats.simdgroup_matrix_ops

    @property
    def seconds(self) -> float | None:
        return self._stats.seconds

    @property
    def bytes_read(self) -> dict[str, int] | None:
        """Bytes loaded per pointer argument name, every access counted (not distinct bytes)."""
        return self._stats.bytes_read

    @property
    def bytes_written(self) -> dict[str, int] | None:
        """Bytes stored per pointer argument name, every access counted (not distinct bytes)."""
        return self._stats.bytes_written

    def __repr__(self) -> str:
        return (f"DispatchRecord(kernel={self.kernel!r}, threadgroups={self.threadgroups}, "
                f"simdgroup_matrix_ops={self.simdgroup_matrix_ops}, seconds={self.seconds})")


def _summed(counts: Iterable[dict[str, int] | None]) -> dict[str, int]:
    total: dict[str, int] = {}
    for by_name in counts:
        for name, count in (by_name or {}).items():
            total[name] = total.get(name, 0) + count
    return total


@dataclass
class Profile:
    """The dispatches recorded while a `profile()` block was active."""

    records: list[DispatchRecord] = field(default_factory=list)

    @property
    def simdgroup_matrix_ops(self) -> int:
        """Total multiply-accumulates of the recorded dispatches that counted them."""
        return sum(r.simdgroup_matrix_ops or 0 for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds or 0.0 for r in self.records)

    @property
    def bytes_read(self) -> dict[str, int]:
        """Device bytes read per argument name, summed over the records that counted them;
        accesses, not distinct bytes (see DispatchRecord)."""
        return _summed(r.bytes_read for r in self.records)

    @property
    def bytes_written(self) -> dict[str, int]:
        """Device bytes written per argument name, summed over the records that counted them;
        accesses, not distinct bytes (see DispatchRecord)."""
        return _summed(r.bytes_written for r in self.records)


_lock = threading.Lock()
_active: list[Profile] = []


@contextmanager
def profile() -> Iterator[Profile]:
    """Record every dispatch made inside the block (from any thread), each with its seconds:
    while a block is active, Metal gives every dispatch of a batch its own compute encoder and
    samples GPU timestamps around it (outside, only a batch of one dispatch has its time).

    >>> with mfa_native.profile() as p:
    ...     mfa_native.attention(q, k, v, causal=True)
    >>> p.records[0].simdgroup_matrix_ops
    >>> p.bytes_read["k"]   # every load of k counted: a multiple of k.nbytes (cpu backend)
    """
    recording = Profile()
    with _lock:
        _active.append(recording)
    try:
        with _core.DispatchTiming():
            yield recording
    finally:
        with _lock:
            _active.remove(recording)


def recording() -> bool:
    """Whether some profile() block is active (cheap: the warm path asks on every call)."""
    return bool(_active)


def record(stats) -> None:
    """Called by the dispatch path with each finished dispatch's stats."""
    if not _active:
        return
    entry = DispatchRecord(stats)
    with _lock:
        for recording in _active:
            recording.records.append(entry)
