"""Foundation benchmark: fiber context switches, a 256^3 simdgroup_matrix GEMM
against numpy, and kernel compile time with a cold and a warm disk cache."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import mfa_native
from mfa_native import _core
from mfa_native.sample_kernels import gemm, gemm_kernel

from . import _table
from ._table import Table

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


def _rows(args, device: str):
    """The table's rows, each measured as it is asked for."""
    switches = 2_000_000
    rate = _core.cpu_context_switches_per_second(switches)
    yield ["fiber context switches", _core.cpu_fiber_switch(), f"{rate / 1e6:.1f} M/s", f"{1e9 / rate:.1f} ns each"]

    n = args.size
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c, stats = gemm(a, b, device=device)
    exact = a.astype(np.float64) @ b
    error = np.linalg.norm(c.astype(np.float64) - exact) / np.linalg.norm(exact)
    kernel = gemm_kernel(np.float32, n, n, n, device=device)
    out = np.empty((n, n), np.float32)
    grid = ((n + 31) // 32, (n + 31) // 32)
    ours = _best_of(args.repeats, lambda: kernel([a, b, out], threadgroups=grid, threads_per_threadgroup=128))
    theirs = _best_of(args.repeats, lambda: a @ b)
    yield [f"GEMM {n}^3 float32 ({device})", f"{stats.simdgroup_matrix_ops} simdgroup MACs",
           f"{ours * 1e3:.2f} ms", f"{ours / theirs:.0f}x numpy ({theirs * 1e3:.3f} ms), rel err {error:.1e}"]

    with tempfile.TemporaryDirectory() as cache:
        cold = _compile_seconds(cache, n)
        yield ["kernel compile, cold disk cache", "new process", f"{cold * 1e3:.0f} ms", ""]
        warm = _compile_seconds(cache, n)
    yield ["kernel compile, warm disk cache", "new process", f"{warm * 1e3:.0f} ms", f"{cold / warm:.0f}x faster"]


def main(argv: list[str] | None = None) -> int:
    parser = _table.parser("core", __doc__)
    parser.add_argument("--size", type=int, default=256, help="GEMM M = N = K (default 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None, help="cpu or metal (default: the default device)")
    args = parser.parse_args(argv)
    device = args.device or mfa_native.default_device().kind
    # the widest cells: names, the GEMM's ops (one per 8x8x8 tile of its 32x32 tiles, or None), its notes
    tiles = (-(-args.size // 32) * 4) ** 3
    widths = [len("kernel compile, cold disk cache"), max(len(str(tiles)), len("None")) + len(" simdgroup MACs"), 0,
              len("1000x numpy (100.000 ms), rel err 1.0e-07")]
    _table.show("core", [Table(["what", "detail", "time / rate", "notes"], _rows(args, device), 4, widths=widths)],
                quiet=args.quiet)
    return 0
