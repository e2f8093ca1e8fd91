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
    dispatch costs the warm path almost nothing.

    Example:
        ```python
        import numpy as np
        import mfa_native

        q = np.random.default_rng(0).standard_normal((1, 2, 16, 32), dtype=np.float32)
        with mfa_native.profile() as p:
            mfa_native.attention(q, q, q, causal=True, return_lse=True, device="cpu")
        for record in p.records:   # one per kernel the call dispatched
            print(record.kernel, record.threadgroups, record.seconds, record.bytes_written)
        ```
    """

    __slots__ = ("_stats",)

    def __init__(self, stats) -> None:
        self._stats = stats

    @property
    def kernel(self) -> str:
        """The kernel's entry point name."""
        return self._stats.kernel

    @property
    def threadgroups(self) -> int:
        """Threadgroups dispatched (the grid's product)."""
        return self._stats.threadgroups

    @property
    def simdgroup_matrix_ops(self) -> int | None:
        """Simdgroup 8x8x8 multiply-accumulates issued, or None where the backend cannot count them."""
        return self._stats.simdgroup_matrix_ops

    @property
    def seconds(self) -> float | None:
        """The dispatch's time: the cpu backend's wall time; Metal's GPU timestamps (None where
        not sampled)."""
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
    """The dispatches recorded while a `profile()` block was active, and their totals.

    `records` holds a DispatchRecord per dispatch, in order; the properties sum them.

    Example:
        ```python
        import numpy as np
        import mfa_native

        q = np.random.default_rng(0).standard_normal((1, 2, 16, 32), dtype=np.float32)
        with mfa_native.profile() as p:
            mfa_native.attention(q, q, q, causal=True, return_lse=True, device="cpu")
            mfa_native.attention(q, q, q, causal=True, return_lse=True, device="cpu")
        print(len(p.records), p.seconds, p.bytes_read["q"])
        assert p.bytes_written["o"] == 2 * q.nbytes   # each call writes its output once
        ```
    """

    records: list[DispatchRecord] = field(default_factory=list)

    @property
    def simdgroup_matrix_ops(self) -> int:
        """Total multiply-accumulates of the recorded dispatches that counted them."""
        return sum(r.simdgroup_matrix_ops or 0 for r in self.records)

    @property
    def seconds(self) -> float:
        """Total seconds of the recorded dispatches that were timed."""
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
    """Records every dispatch made inside the block (from any thread), each with its seconds.

    While a block is active, Metal gives every dispatch of a batch its own compute encoder and
    samples GPU timestamps around it (outside, only a batch of one dispatch has its time).
    Byte counts are accesses, not distinct bytes (see DispatchRecord). Blocks may nest: each
    records what ran inside it.

    Returns:
        A context manager whose value is the Profile the block fills.

    Example:
        ```python
        import numpy as np
        import mfa_native

        rng = np.random.default_rng(0)
        q = rng.standard_normal((1, 4, 16, 32), dtype=np.float32)
        k, v = (rng.standard_normal((1, 1, 16, 32), dtype=np.float32) for _ in range(2))
        with mfa_native.profile() as p:
            mfa_native.attention(q, k, v, causal=True, device="cpu")
        (record,) = p.records   # one kernel ran
        print(record.kernel, record.threadgroups, record.simdgroup_matrix_ops, record.seconds)
        assert p.bytes_read["k"] >= k.nbytes and p.bytes_written["o"] == q.nbytes
        ```
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
