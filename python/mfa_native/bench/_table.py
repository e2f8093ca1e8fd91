"""Plain-text tables for benchmark output, printed row by row as the rows are measured, under a
progress bar with an ETA (progress.bar: on standard error, only on a terminal, none with the
--quiet that every benchmark's parser takes)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Iterable, Sequence

from .. import progress


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The option parser of `bench NAME`: its docstring as the description, and --quiet."""
    made = argparse.ArgumentParser(prog=f"python -m mfa_native bench {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    made.add_argument("--quiet", action="store_true", help="no progress bar")
    return made


@dataclass(frozen=True)
class Table:
    """A table measured while it is printed: iterating `rows` measures and yields them one by one,
    `count` of them (the progress bar's total). Its header is printed before any cell is known,
    so each column is as wide as its header or its entry of `widths` (the widest cell the
    benchmark expects, from the names it knows and its numbers' formats), whichever is wider."""

    headers: Sequence[str]
    rows: Iterable[Sequence[object]]
    count: int
    title: str | None = None
    widths: Sequence[int] = ()

    def columns(self) -> list[int]:
        hints = [*self.widths, *[0] * (len(self.headers) - len(self.widths))]
        return [max(len(header), hint) for header, hint in zip(self.headers, hints)]


def line(cells: Sequence[object], widths: Sequence[int]) -> str:
    """One line of right-aligned cells, two spaces apart."""
    return "  ".join(str(cell).rjust(width) for cell, width in zip(cells, widths))


def show(name: str, tables: Sequence[Table], *, quiet: bool = False) -> None:
    """Print `tables` (a blank line between two): title, header and rule, then each row as soon as
    it is measured, flushed (a pipe gets it too), while a bar counts the rows of all of them."""
    with progress.bar(sum(table.count for table in tables), f"bench {name}", unit="row", quiet=quiet) as shown:
        def write(text: str) -> None:
            with shown.external_write_mode(file=sys.stdout):   # the bar steps aside on a terminal
                print(text, flush=True)

        for number, table in enumerate(tables):
            if number:
                write("")
            if table.title is not None:
                write(table.title)
            widths = table.columns()
            write(line(table.headers, widths))
            write("  ".join("-" * width for width in widths))
            for row in table.rows:
                write(line(row, widths))
                shown.update()
