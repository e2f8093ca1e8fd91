"""Run a benchmark and print its table: `bench core` or `bench attention`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

from .. import bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))
    parser.add_argument("name", choices=names, help="which benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="passed on to the benchmark (try --help)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"{bench.__name__}.{args.name}")
    return module.main(args.options)
