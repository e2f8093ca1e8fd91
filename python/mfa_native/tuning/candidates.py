"""The tuner's candidate space: a row type's choice columns and their domains (tables.DOMAINS),
and a pairwise covering design over them, so a new column with a declared domain joins
without a change here."""

from __future__ import annotations

import itertools
from dataclasses import fields

from ..codegen.kernel.tables import DOMAINS

RANGE_COLUMN = "max_head_dim"   # which head dims a row is for, not a choice


def columns(row_type: type) -> dict[str, tuple]:
    """Every choice column of `row_type` and its domain, in field order."""
    domain = DOMAINS[row_type]
    return {f.name: domain[f.name] for f in fields(row_type) if f.name != RANGE_COLUMN}


def _pairs(choice: dict[str, object]) -> set[tuple]:
    return {((a, choice[a]), (b, choice[b])) for a, b in itertools.combinations(choice, 2)}


def covering(factors: dict[str, tuple]) -> list[dict[str, object]]:
    """A pairwise covering design: assignments of every factor such that each value of each
    factor, and each pair of values of any two factors, occurs in at least one (greedy, fixed order)."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b]}
    if len(names) == 1:
        return [{names[0]: value} for value in factors[names[0]]]
    designs = []
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=lambda pair: (names.index(pair[0][0]), names.index(pair[1][0]),
                                                          str(pair)))
        choice = {a: x, b: y}
        for name in names:
            if name not in choice:
                choice[name] = max(factors[name], key=lambda value: len(
                    _pairs({**choice, name: value}) & uncovered))
        designs.append({name: choice[name] for name in names})
        uncovered -= _pairs(choice)
    return designs
