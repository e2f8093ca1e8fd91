"""Check every kernel family on this machine's device: `selftest [--quick] [--report FILE]`."""

from __future__ import annotations

import argparse
import sys

from .. import selftest
from ..progress import bar


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Runs every kernel family (forward, backward, split-KV and packed decode, varlen, paged KV cache with "
        "append, quantized K/V, int8, sparse-indexed with the indexer, block-sparse, merge) on small random "
        "problems for each dtype and a few head dims (576 included), against the float64 references and, on "
        "Metal, against the cpu backend. Prints one row per family; the exit status is 1 if any is wrong.")
    parser.add_argument("--quick", action="store_true", help="float16 at D 64 (and D 576 for the dense families)")
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--report", metavar="FILE", help="also write the table as Markdown (to paste into an issue)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    with bar(len(selftest.FAMILIES), "selftest", unit="family", quiet=args.quiet) as progress:
        facts, rows = selftest.run(args.device, quick=args.quick, progress=lambda family: progress.update())
    for key, value in facts.items():
        print(f"{key}: {value}")
    print(selftest.table(rows))
    if args.report:
        with open(args.report, "w", encoding="utf-8") as report:
            report.write(selftest.markdown(facts, rows))
    failed = [r.family for r in rows if r.status != "ok"]
    if failed:
        print(f"selftest: {len(failed)} of {len(rows)} families failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"selftest: all {len(rows)} families ok")
    return 0
