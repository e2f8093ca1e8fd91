"""The sweeps: `check` runs every candidate of a covering design once at small sizes and
verifies it; `tune` times each problem group's candidates per kernel and, among those right on
every problem of the group (the built-in row always competes), takes each kernel's columns from
the candidate fastest in that kernel (kernels.fastest_per_kernel), checks that row in turn, and
keeps it (else the fastest whole candidate)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, fields

import numpy as np

from ..codegen.kernel.tables import DIRECTION_ROWS, built_in_row
from ..progress import Report, silent
from ..runtime.devices import Device, tuning_facts
from . import trial
from .candidates import columns, covering
from .kernels import fastest_per_kernel
from .problems import DTYPES, TuningProblem

# (D, Dv) pairs `check` covers: 8 to 576, odd values, D != Dv, MLA's 576/512.
CHECK_HEAD_DIMS = ((8, 8), (13, 29), (64, 64), (97, 80), (128, 128), (161, 200), (256, 256), (333, 301),
                   (576, 512), (512, 576))


@dataclass(frozen=True)
class Checked:
    """One candidate's check: its row, the problem it ran, and the outcome."""

    problem: TuningProblem
    row: object
    outcome: trial.Outcome


def check_space(direction: str, family: str, device: Device, head_dims=CHECK_HEAD_DIMS, dtypes=DTYPES,
                q_len: int = 19, kv_len: int = 37) -> list[tuple[TuningProblem, object]]:
    """A covering design over the row's columns, the dtypes, the head dims and the kv heads (1:
    GQA 2, the packed-heads forward for short R; 2: per head): every value of each and every
    pair of values of any two occurs; each design is one (problem, row). A row
    that does not fit the device at its head dims runs at the first pair (in order) where it fits."""
    row_type = DIRECTION_ROWS[direction]
    factors = {**columns(row_type), "dtype": tuple(dtypes), "dims": tuple(head_dims), "kv_heads": (1, 2)}
    space = []
    for design in covering(factors):
        choice = {name: design[name] for name in columns(row_type)}
        order = [design["dims"]] + [d for d in head_dims if d != design["dims"]]
        for head_dim, value_dim in order:
            problem = TuningProblem(direction, design["dtype"], head_dim, value_dim, q_len=q_len, kv_len=kv_len,
                                    q_heads=2, kv_heads=design["kv_heads"], causal=head_dim % 2 == 1)
            row = row_type(max_head_dim=trial.range_end(problem, family), **choice)
            if trial.fits(problem, row, device):
                space.append((problem, row))
                break
    return space


def each_value(space: list[tuple[TuningProblem, object]]) -> list[tuple[TuningProblem, object]]:
    """A few designs of `space` in which every value of every column, every dtype and every
    (D, Dv) pair of the space still occurs at least once (not every pair of them: that is the
    whole space's promise). Greedy: each design taken is the one adding the most unseen values."""
    def values(design):
        problem, row = design
        return ({(f.name, getattr(row, f.name)) for f in fields(row) if f.name != "max_head_dim"}
                | {("dtype", problem.dtype), ("dims", (problem.head_dim, problem.value_dim))})

    unseen = set().union(*(values(d) for d in space))
    chosen = []
    while unseen:
        best = max(space, key=lambda d: len(values(d) & unseen))
        chosen.append(best)
        unseen -= values(best)
    return chosen


def check(space, device: Device, rng: np.random.Generator, report: Report = silent) -> list[Checked]:
    """Run every (problem, row) of `space` once and verify it."""
    results = []
    for index, (problem, row) in enumerate(space):
        report(index, len(space), problem.describe())
        results.append(Checked(problem, row, trial.run(problem, row, device, rng)))
    report(len(space), len(space), "checked")
    return results


@dataclass(frozen=True)
class Winner:
    """A group's (direction, dtype, range) chosen row, its summed best times per kernel, and the built-in's."""

    direction: str
    dtype: str
    row: object
    seconds: dict[str, float]
    built_in_seconds: dict[str, float] | None


def _candidates(direction: str, dtype: str, range_end: int, family: str) -> list:
    row_type = DIRECTION_ROWS[direction]
    built_in = built_in_row(direction, family, dtype, range_end)
    rows = [built_in] + [row_type(max_head_dim=range_end, **design) for design in covering(columns(row_type))]
    return list(dict.fromkeys(rows))


def _timed(group: list[TuningProblem], row, device: Device, rng: np.random.Generator,
           repeats: int) -> dict[str, float] | None:
    """`row`'s best seconds per kernel summed over `group`, or None when it does not fit the
    device or is wrong on one of the problems."""
    if not all(trial.fits(p, row, device) for p in group):
        return None
    outcomes = [trial.run(p, row, device, rng, repeats) for p in group]
    if not all(o.passed for o in outcomes):
        return None
    return {kernel: sum(o.seconds[kernel] for o in outcomes) for kernel in outcomes[0].seconds}


def tune(problems: list[TuningProblem], device: Device, rng: np.random.Generator, repeats: int = 5,
         report: Report = silent) -> list[Winner]:
    """Time every candidate of each (direction, dtype, range) group on the group's problems (repeats >= 1)."""
    family = tuning_facts(device).family
    groups: dict[tuple[str, str, int], list[TuningProblem]] = defaultdict(list)
    for problem in problems:
        groups[(problem.direction, problem.dtype, trial.range_end(problem, family))].append(problem)
    work = [(key, row) for key in groups for row in _candidates(*key, family)]
    timed: dict[tuple[str, str, int], dict] = defaultdict(dict)
    for index, (key, row) in enumerate(work):
        report(index, len(work), f"{key[0]} {key[1]} <= {key[2]}: {row}")
        seconds = _timed(groups[key], row, device, rng, repeats)
        if seconds is not None:
            timed[key][row] = seconds
    report(len(work), len(work), "timed")
    winners = []
    for (direction, dtype, end), rows in timed.items():
        combined = fastest_per_kernel(direction, rows)
        if combined not in rows:   # made of several candidates' kernels: checked (and timed) as a whole
            seconds = _timed(groups[(direction, dtype, end)], combined, device, rng, repeats)
            if seconds is not None:
                rows[combined] = seconds
        best = combined if combined in rows else min(rows, key=lambda row: sum(rows[row].values()))
        built_in = rows.get(built_in_row(direction, family, dtype, end))
        winners.append(Winner(direction, dtype, best, rows[best], built_in))
    return winners


def rows_by_direction(winners: list[Winner]) -> dict[str, dict[str, list]]:
    """The winners as table rows per direction and dtype, in range order (tuned.write's form)."""
    rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for winner in sorted(winners, key=lambda w: w.row.max_head_dim):
        rows[winner.direction][winner.dtype].append(winner.row)
    return {direction: dict(by_dtype) for direction, by_dtype in rows.items()}


def _milliseconds(seconds: dict[str, float]) -> str:
    """Total ms, and with several kernels each one's: "3.100 ms (dq 1.000 + dkdv 2.100)"."""
    total = f"{sum(seconds.values()) * 1e3:.3f} ms"
    if len(seconds) == 1:
        return total
    return total + " (" + " + ".join(f"{kernel} {s * 1e3:.3f}" for kernel, s in seconds.items()) + ")"


def winners_table(winners: list[Winner]) -> str:
    """One line per winner: direction, dtype, range, its time (per kernel) and the built-in row's, its columns."""
    lines = []
    for w in sorted(winners, key=lambda w: (w.direction, w.dtype, w.row.max_head_dim)):
        values = ", ".join(f"{k}={v}" for k, v in vars(w.row).items() if k != "max_head_dim")
        built = _milliseconds(w.built_in_seconds) if w.built_in_seconds is not None else "did not fit or pass"
        lines.append(f"{w.direction:<9} {w.dtype:<8} <= {w.row.max_head_dim:<4} {_milliseconds(w.seconds)} "
                     f"(built-in {built})  {values}")
    return "\n".join(lines)


