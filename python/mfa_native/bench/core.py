"""Foundation benchmark: fiber context switches, a 256^3 simdgroup_matrix GEMM
against numpy, and kernel compile time with a cold and a warm disk cache."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import mfa_native
from mfa_native import _core
from mfa_native.sample_kernels import gemm, gemm_kernel

from ._table import format_table

# Compiles one GEMM specialization in a fresh process and prints the seconds.
_COMPILE_PROBE = (
    "import time, numpy as np; from mfa_native.sample_kernels import gemm_kernel; "
    "t = time.perf_counter(); gemm_kernel(np.float32, {n}, {n}, {n}, device='cpu'); "
    "print(time.perf_counter() - t)"
)


def _compile_seconds(cache_dir: str, size: int) -> float:
    env = dict(os.environ, MFA_NATIVE_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE.format(n=size)], env=env,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _best_of(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfa_native bench core", description=__doc__)
    parser.add_argument("--size", type=int, default=256, help="GEMM M = N = K (default 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None, help="cpu or metal (default: the default device)")
    args = parser.parse_args(argv)
    device = args.device or mfa_native.default_device().kind

    rows = []
    switches = 2_000_000
    rate = _core.cpu_context_switches_per_second(switches)
    rows.append(["fiber context switches", _core.cpu_fiber_switch(), f"{rate / 1e6:.1f} M/s", f"{1e9 / rate:.1f} ns each"])

    n = args.size
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c, stats = gemm(a, b, device=device)
    error = np.linalg.norm(c.astype(np.float64) - a.astype(np.float64) @ b) / np.linalg.norm(a.astype(np.float64) @ b)
    kernel = gemm_kernel(np.float32, n, n, n, device=device)
    out = np.empty((n, n), np.float32)
    grid = ((n + 31) // 32, (n + 31) // 32)
    ours = _best_of(args.repeats, lambda: kernel([a, b, out], threadgroups=grid, threads_per_threadgroup=128))
    theirs = _best_of(args.repeats, lambda: a @ b)
    rows.append([f"GEMM {n}^3 float32 ({device})", f"{stats.simdgroup_matrix_ops} simdgroup MACs",
                 f"{ours * 1e3:.2f} ms", f"{ours / theirs:.0f}x numpy ({theirs * 1e3:.3f} ms), rel err {error:.1e}"])

    with tempfile.TemporaryDirectory() as cache:
        cold = _compile_seconds(cache, n)
        warm = _compile_seconds(cache, n)
    rows.append(["kernel compile, cold disk cache", "new process", f"{cold * 1e3:.0f} ms", ""])
    rows.append(["kernel compile, warm disk cache", "new process", f"{warm * 1e3:.0f} ms", f"{cold / warm:.0f}x faster"])

    print(format_table(["what", "detail", "time / rate", "notes"], rows))
    return 0
