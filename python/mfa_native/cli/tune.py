"""Tune the tile tables on this device: `tune` times candidate rows (Metal) and writes the winners; `tune --check` verifies every candidate.

On Metal, `tune` times each candidate of a problem set per kernel (warm, best of 5: GPU
timestamps sampled around each dispatch, so the backward's dQ and dK/dV kernels are timed
apart), checks its result against the float64 reference before it may win, takes each kernel's
columns from the candidate fastest in that kernel (the row they make is checked too), and
writes the winning rows to the device's tuned table (codegen/kernel/tuned.py:
`<cache>/tuning/<device model>.json`), which later calls on that device use
(MFA_NATIVE_TUNING=off: the built-in rows; `info` shows the table). On the cpu backend,
timing would be cpu times, not a GPU's: `tune` refuses (exit 2) and writes nothing;
`tune --check` runs every candidate of a covering design once at small sizes and verifies it.
Both show a progress bar with an ETA on a terminal (not with --quiet).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ..codegen.kernel import tuned
from ..codegen.kernel.tables import DIRECTION_ROWS
from ..progress import reporting
from ..runtime.devices import resolve_device, tuning_facts
from ..tuning import problems, sweep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="run every candidate once at small sizes and verify it (any device); writes nothing")
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--directions", nargs="+", choices=list(DIRECTION_ROWS), default=list(DIRECTION_ROWS))
    parser.add_argument("--dtypes", nargs="+", choices=list(problems.DTYPES), default=list(problems.DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256],
                        help="timing: head dims of the problem set (D = Dv; default 64 128 256)")
    parser.add_argument("--q-len", type=int, default=1024, help="timing: R and C of the problem set")
    parser.add_argument("--heads", type=int, default=8, help="timing: query and kv heads")
    parser.add_argument("--repeats", type=int, default=5, help="timing: best of this many warm runs")
    parser.add_argument("--dry-run", action="store_true", help="timing: print the winners, write no table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _check(args, device, rng) -> int:
    family = tuning_facts(device).family
    failed = []
    for direction in args.directions:
        space = sweep.check_space(direction, family, device, dtypes=args.dtypes)
        with reporting(f"tune --check {direction}", unit="candidate", quiet=args.quiet) as report:
            results = sweep.check(space, device, rng, report)
        for result in results:
            if not result.outcome.passed:
                failed.append(result)
        print(f"{direction}: {len(space)} candidates checked")
    for result in failed:
        print(f"FAILED {result.problem.describe()} {result.row}: relative L2 {result.outcome.error:.3g}")
    print("every candidate matches the reference" if not failed else f"{len(failed)} candidates failed")
    return 1 if failed else 0


def _tune(args, device, rng) -> int:
    if device.kind != "metal":
        print("tune: timing on the cpu backend measures cpu time, not a GPU's, so no table is written; "
              "run `tune --check` here, or `tune` on a Mac", file=sys.stderr)
        return 2
    family = tuning_facts(device).family
    chosen = problems.problem_set(args.directions, args.dtypes, tuple(args.head_dims), args.q_len, args.q_len,
                                  args.heads)
    with reporting("tune", unit="run", quiet=args.quiet) as report:
        winners = sweep.tune(chosen, device, rng, args.repeats, report)
    print(f"winners on {device.name} ({family}), summed best-of-{args.repeats} GPU times per range and kernel:")
    print(sweep.winners_table(winners))
    if not args.dry_run:
        path = tuned.write(family, device.name, sweep.rows_by_direction(winners))
        print(f"tuned table written: {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    for name in ("repeats", "q_len", "heads"):
        if getattr(args, name) < 1:
            print(f"tune: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    device = resolve_device(args.device)
    rng = np.random.default_rng(args.seed)
    return (_check if args.check else _tune)(args, device, rng)
