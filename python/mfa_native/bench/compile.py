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

from ._table import format_table

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
    """In a child process: times every kernel's pipeline as this process finds it (a compile, a
    disk hit), then an in-process hit of each; prints them as JSON."""
    from ..runtime.devices import resolve_device
    device = resolve_device("cpu")

    def timed(source: str, entry: str) -> float:
        start = time.perf_counter()
        device.pipeline(device.library(source), entry, [])
        return time.perf_counter() - start

    result = {"first": timed(FIRST_KERNEL, "first"), "kernels": {}}
    listed = kernels()
    for name, kernel in listed:
        result["kernels"][name] = [timed(kernel.source, kernel.entry)]
    for name, kernel in listed:
        result["kernels"][name].append(timed(kernel.source, kernel.entry))
    result["compiled"] = int(device.properties["kernels_compiled"])
    print(json.dumps(result))


def _run_child(cache_dir: str) -> dict:
    env = dict(os.environ, MFA_NATIVE_CACHE_DIR=cache_dir)
    done = subprocess.run([sys.executable, "-m", "mfa_native.bench.compile", "--child"], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfa_native bench compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh caches to compile into (default 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child()
        return 0
    cold, first, disk = {}, [], {}
    with tempfile.TemporaryDirectory(prefix="mfa_native-bench-compile-") as root:
        for repeat in range(max(1, args.repeats)):
            cache = os.path.join(root, f"cache{repeat}")
            compiled = _run_child(cache)
            first.append(compiled["first"])
            for name, (seconds, _) in compiled["kernels"].items():
                cold.setdefault(name, []).append(seconds)
        loaded = _run_child(cache)
    for name, (seconds, hit) in loaded["kernels"].items():
        disk[name] = (seconds, hit)
    rows = [[FIRST, f"{np.median(first):.3f}", "-", "-"]]
    for name, times in cold.items():
        rows.append([name, f"{np.median(times):.3f}", f"{disk[name][0] * 1e3:.2f}", f"{disk[name][1] * 1e6:.1f}"])
    medians = [np.median(times) for times in cold.values()]
    print(f"cpu backend, {len(cold)} kernels, median of {max(1, args.repeats)} fresh caches each")
    print(format_table(["kernel", "cold compile s", "disk cache hit ms", "in-process hit us"], rows))
    print(f"cold compile per kernel: median {np.median(medians):.3f} s, max {max(medians):.3f} s; "
          f"a second process compiled {loaded['compiled']} of them")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
