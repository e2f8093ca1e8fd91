"""Kernel compile time on the cpu backend: `python -m mfa_native bench compile [--repeats 3]`.

For a fixed set of kernels (attention's forward, dQ and dK/dV kernels at D 64 and 128, float16
and float32): the cold compile time of each (a fresh kernel cache, in a child process; the
median over `--repeats` fresh caches), the time to load it from the disk cache (another child
process on the cache the first one filled) and an in-process cache hit. The first compile into
a fresh cache also builds the shim's precompiled header; it is timed on its own row (a kernel
of the Kernel API compiled first), so the kernels' rows are what each further kernel costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import _table
from ._table import Table

D_VALUES = (64, 128)
DTYPES = ("float16", "float32")
FIRST = "first compile into a fresh cache (the shim's precompiled header, once per cache and compiler)"


def kernels():
    """(name, KernelLaunch) of every kernel the benchmark compiles."""
    from .. import codegen
    out = []
    for dtype in DTYPES:
        for d in D_VALUES:
            problem = codegen.AttentionProblem(1, 4, 4, 256, 256, d, d, dtype=dtype, return_lse=True)
            forward = codegen.attention_pass(problem)
            backward = codegen.attention_backward_pass(codegen.AttentionBackwardProblem(problem))
            for kernel in forward.kernels + backward.kernels:
                out.append((f"{kernel.entry} {dtype} D{d}", kernel))
    return out


FIRST_KERNEL = """#include <metal_stdlib>
using namespace metal;
kernel void first(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] += 1.0f; }
"""


def _child() -> None:
    """In a child process: answers each line of standard input with a line of JSON: "first" with
    the seconds of FIRST_KERNEL's pipeline, a kernel's index with the seconds of its pipeline as
    this process finds it (a compile, a disk hit) and of an in-process hit, "compiled" with the
    kernels this process compiled."""
    from ..runtime.devices import resolve_device
    device = resolve_device("cpu")
    listed = kernels()

    def timed(source: str, entry: str) -> float:
        start = time.perf_counter()
        device.pipeline(device.library(source), entry, [])
        return time.perf_counter() - start

    print(json.dumps("ready"), flush=True)
    for request in sys.stdin:
        request = request.strip()
        if request == "first":
            answer = timed(FIRST_KERNEL, "first")
        elif request == "compiled":
            answer = int(device.properties["kernels_compiled"])
        else:
            _, kernel = listed[int(request)]
            answer = [timed(kernel.source, kernel.entry), timed(kernel.source, kernel.entry)]
        print(json.dumps(answer), flush=True)


class _Child:
    """A child process timing pipelines in the kernel cache `cache_dir` (_child), one request at a
    time, so that the parent can print each kernel's row as soon as every child timed it."""

    def __init__(self, cache_dir: str, log) -> None:
        env = dict(os.environ, MFA_NATIVE_CACHE_DIR=cache_dir)
        self.process = subprocess.Popen([sys.executable, "-m", "mfa_native.bench.compile", "--child"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.log, self.cache_dir = log, cache_dir

    def answer(self):
        line = self.process.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"bench compile: a child process failed:\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def ask(self, request: str):
        try:
            self.process.stdin.write(request + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:   # it has ended: answer() says why
            pass
        return self.answer()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def _rows(repeats: int, names: list[str], summary: dict):
    """The table's rows: the first compile (the precompiled header) into `repeats` fresh caches,
    then each kernel: compiled into each of them (the median), loaded from the last one's disk
    cache by another process and hit in that process. Fills `summary` for the line after it."""
    with tempfile.TemporaryDirectory(prefix="mfa_native-bench-compile-") as root, \
            tempfile.TemporaryFile("w+") as log:
        children = [_Child(os.path.join(root, f"cache{repeat}"), log) for repeat in range(repeats)]
        loader = None
        try:
            for child in children:   # started together, timed one at a time once all have started
                child.answer()
            yield [FIRST, f"{np.median([child.ask('first') for child in children]):.3f}", "-", "-"]
            for index, name in enumerate(names):
                cold = np.median([child.ask(str(index))[0] for child in children])
                if loader is None:   # once the last cache holds what a process compiles first
                    loader = _Child(children[-1].cache_dir, log)
                    loader.answer()
                    loader.ask("first")
                disk, hit = loader.ask(str(index))
                summary.setdefault("cold", []).append(cold)
                yield [name, f"{cold:.3f}", f"{disk * 1e3:.2f}", f"{hit * 1e6:.1f}"]
            summary["compiled"] = loader.ask("compiled") if loader else 0
        finally:
            for child in children + ([loader] if loader else []):
                child.close()


def main(argv: list[str] | None = None) -> int:
    parser = _table.parser("compile", __doc__)
    parser.add_argument("--repeats", type=int, default=3, help="fresh caches to compile into (default 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child()
        return 0
    repeats = max(1, args.repeats)
    names = [name for name, _ in kernels()]
    summary = {}
    _table.show("compile", [Table(["kernel", "cold compile s", "disk cache hit ms", "in-process hit us"],
                                  _rows(repeats, names, summary), 1 + len(names),
                                  f"cpu backend, {len(names)} kernels, median of {repeats} fresh caches each",
                                  [max(len(FIRST), *map(len, names))])], quiet=args.quiet)
    medians = summary["cold"]
    print(f"cold compile per kernel: median {np.median(medians):.3f} s, max {max(medians):.3f} s; "
          f"a second process compiled {summary['compiled']} of them")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
