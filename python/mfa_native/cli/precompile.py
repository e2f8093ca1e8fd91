"""Compile kernels ahead of time: `precompile FILE` (a bundle spec or a list of calls, as JSON)."""

from __future__ import annotations

import argparse
import sys

from ..precompiling import precompile, read_work


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Compiles the kernels of FILE ahead of time, so the calls after it compile nothing (on the cpu "
        "backend into the kernel disk cache, for every later process). FILE is JSON: a bundle spec "
        '({"families": [...]}, as `bundle` takes it), or a list of calls, each {"op": "attention", '
        '"q": {"shape": [1, 8, 512, 64], "dtype": "float16"}, ..., "causal": true} (array arguments as '
        '{"shape", "dtype"} or a list of numbers; add "format": "q8_0" for a quantized one). '
        "A progress bar shows on a terminal.")
    parser.add_argument("file", metavar="FILE", help="the JSON file, or - for standard input")
    parser.add_argument("--device", choices=["cpu", "metal"], help="default: the default device")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")


def run(args: argparse.Namespace) -> int:
    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
        done = precompile(read_work(text), device=args.device, quiet=args.quiet)
    except (OSError, TypeError, ValueError) as error:
        print(f"precompile: {error}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"precompile: {done.items} items, {done.compiled} kernels compiled in {done.seconds:.1f} s")
    return 0
