"""The first message of every context-parallel call: each rank's descriptor, all-gathered, so that
every rank raises the same error (its own argument error, or the first fact the ranks disagree
on) instead of some ranks waiting forever for the others."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Descriptor:
    """What a rank tells the others: its own sizes (which may differ between ranks), the facts every
    rank must share, or why its arguments are wrong (exception type name and message)."""

    own: tuple = ()
    shared: tuple[tuple[str, Any], ...] = ()
    error: tuple[str, str] | None = None


def described(describe: Callable[[], Descriptor]) -> Descriptor:
    """describe(), or the TypeError or ValueError it raised as a Descriptor's error."""
    try:
        return describe()
    except (TypeError, ValueError) as error:
        return Descriptor(error=(type(error).__name__, str(error)))


def agree(name: str, descriptors: list[Descriptor]) -> None:
    """Raises, identically on every rank (each has the same descriptors), the first rank's own
    argument error, or a ValueError naming the first fact the ranks disagree on."""
    for rank, descriptor in enumerate(descriptors):
        if descriptor.error is not None:
            kind, message = descriptor.error
            raise (TypeError if kind == "TypeError" else ValueError)(f"{name}: rank {rank}: {message}")
    for index, (fact, _) in enumerate(descriptors[0].shared):
        values = [descriptor.shared[index][1] for descriptor in descriptors]
        if any(value != values[0] for value in values):
            listed = ", ".join(f"rank {rank} has {value!r}" for rank, value in enumerate(values))
            raise ValueError(f"{name}: the ranks disagree on {fact}: {listed}")
