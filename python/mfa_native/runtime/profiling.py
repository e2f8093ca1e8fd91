"""`mfa_native.profile()`: see the work each dispatch issued."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator


@dataclass(frozen=True)
class DispatchRecord:
    """One dispatch: its kernel, threadgroups, simdgroup 8x8x8 multiply-accumulates
    (None where the backend cannot count them) and seconds."""

    kernel: str
    threadgroups: int
    simdgroup_matrix_ops: int | None
    seconds: float | None


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


_lock = threading.Lock()
_active: list[Profile] = []


@contextmanager
def profile() -> Iterator[Profile]:
    """Record every dispatch made inside the block (from any thread).

    >>> with mfa_native.profile() as p:
    ...     mfa_native.attention(q, k, v, causal=True)
    >>> p.records[0].simdgroup_matrix_ops
    """
    recording = Profile()
    with _lock:
        _active.append(recording)
    try:
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
    entry = DispatchRecord(stats.kernel, stats.threadgroups, stats.simdgroup_matrix_ops, stats.seconds)
    with _lock:
        for recording in _active:
            recording.records.append(entry)
