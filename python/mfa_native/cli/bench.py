"""Run a benchmark and print its table: `bench NAME [options]` (`bench --help` lists them)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import pkgutil
import textwrap

from .. import bench


def names() -> list[str]:
    """Every benchmark: the public modules of mfa_native/bench/."""
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def what(name: str) -> str:
    """What benchmark `name` measures: its module docstring's first paragraph without the usage
    line (read from the source, so listing the benchmarks imports none of them)."""
    spec = importlib.util.find_spec(f"{bench.__name__}.{name}")
    with open(spec.origin, encoding="utf-8") as source:
        doc = ast.get_docstring(ast.parse(source.read())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(": `python -m")[0].rstrip(".:") or name


def summary() -> str:
    """The command's line in `python -m mfa_native --help`: every benchmark by name."""
    listed = names()
    return f"Run a benchmark and print its table: {', '.join(listed[:-1])} or {listed[-1]}."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    listed = names()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = "benchmarks (`bench NAME --help` shows each one's options):\n" + "\n".join(
        textwrap.fill(what(name), 100, initial_indent=f"  {name:<14} ", subsequent_indent=" " * 17)
        for name in listed)
    parser.add_argument("name", choices=listed, help="which benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="passed on to the benchmark (try --help)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"{bench.__name__}.{args.name}")
    return module.main(args.options)
