"""Progress bars for long work (precompile, selftest, tune, bundle, emit --report, bench): tqdm's, on
standard error, with an ETA, shown only on a terminal and never when the caller asks for quiet."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from tqdm import tqdm

Report = Callable[[int, int, str], None]   # (done, total, what is being done)


def bar(total: int, description: str, *, unit: str, quiet: bool = False) -> tqdm:
    """A bar counting `total` `unit`s with an ETA; a silent one when `quiet` or when standard
    error is not a terminal (tqdm's disable=None)."""
    return tqdm(total=total, desc=description, unit=unit, disable=True if quiet else None, leave=False,
                dynamic_ncols=True)


@contextmanager
def reporting(description: str, *, unit: str, quiet: bool = False) -> Iterator[Report]:
    """A Report driving one bar, made at its first call (which gives the total, so the bar has
    its ETA from the start): for work that says how far it is as report(done, total, label)."""
    shown: list[tqdm] = []

    def report(done: int, total: int, label: str) -> None:
        if not shown:
            shown.append(bar(total, description, unit=unit, quiet=quiet))
        shown[0].total = total
        shown[0].set_postfix_str(label[:60], refresh=False)
        shown[0].update(done - shown[0].n)

    try:
        yield report
    finally:
        for made in shown:
            made.close()


def silent(done: int, total: int, label: str) -> None:
    """The Report of work nobody watches."""
