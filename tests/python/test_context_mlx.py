"""Context parallelism on mx.distributed: real processes started with `mlx.launch --backend ring
-n N --hosts 127.0.0.1` (mlx_context_worker.py), N = 1, 2, 4. Ring attention forward and
backward (mx.grad) and sharded decode equal the float64 reference on the whole sequences; the
shards' lengths include 0 and 1."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from context_cases import DecodeCase, RingCase, check_decode, check_ring

pytest.importorskip("mlx.core")

HERE = Path(__file__).parent
TIMEOUT = 300

RING_CASES = {
    1: (RingCase((4,), (6,), causal=True, window=(2, 0), dtype="bfloat16"),),
    2: (RingCase((5, 0), causal=True, sinks=True), RingCase((3, 8), (6, 2), causal="upper_left", layout="bshd"),
        RingCase((6, 1), window=(3, 2), dtype="float16")),
    4: (RingCase((5, 9, 1, 7), causal=True, sinks=True, layout="bshd"),
        RingCase((3, 0, 6, 2), (5, 9, 1, 7), causal="upper_left", window=(4, 1), sinks=True),
        RingCase((2, 7, 0, 5), causal=True, dtype="bfloat16")),
}
DECODE_CASES = {
    1: (DecodeCase(((7, 3),), causal=True, dtype="float16"),),
    2: (DecodeCase(((9, 0), (5, 12)), causal=True, sinks=True),
        DecodeCase(((16, 3), (1, 9)), appended=2, R=2, causal=True, window=(6, 0), page=8, quantized=True),
        DecodeCase(((4, 6), (3, 0)), appended=0, R=3, causal="upper_left", dtype="bfloat16")),
    4: (DecodeCase(((9, 2), (0, 7), (1, 5), (6, 3)), causal=True, window=(10, 0), sinks=True, page=8),
        DecodeCase(((3, 4), (5, 0), (2, 1), (7, 8)), appended=2, R=2, causal="upper_left", dtype="float16")),
}


def launch(size: int, out: Path, seed: int, mode: str = "cases", timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    """The worker on `size` ring ranks on this machine (one rank: a plain process, MLX's singleton
    group; mlx.launch -n 1 writes a hostfile its ring backend cannot parse)."""
    launcher = [shutil.which("mlx.launch") or "mlx.launch", "--backend", "ring", "-n", str(size), "--hosts",
                "127.0.0.1", "--python", sys.executable, "--cwd", str(HERE)]
    command = [*(launcher if size > 1 else [sys.executable]), str(HERE / "mlx_context_worker.py"), str(out),
               str(seed), str(size), mode]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=HERE)


# One rank (no exchange) and four (19 s cold) run in the exhaustive step; two in the default run.
@pytest.mark.parametrize("size", [pytest.param(1, marks=pytest.mark.exhaustive), 2,
                                  pytest.param(4, marks=pytest.mark.exhaustive)])
def test_mlx_ring_attention_and_sharded_decode_equal_the_reference(rng, tmp_path, size):
    seed = int(rng.integers(1 << 30))
    done = launch(size, tmp_path, seed)
    missing = [r for r in range(size) if not (tmp_path / f"rank{r}.npz").exists()]   # mlx.launch may exit 0 anyway
    assert done.returncode == 0 and not missing, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(size)]
    for prefix, table, check, offset in (("ring", RING_CASES, check_ring, 0), ("decode", DECODE_CASES, check_decode, 100)):
        for index, case in enumerate(table[size]):
            by_rank = [{key.split(".", 1)[1]: r[key] for key in r.files if key.startswith(f"{prefix}{index}.")}
                       for r in ranks]
            check(seed + offset + index, case, by_rank)


def test_mlx_ranks_that_disagree_or_overflow_all_raise_the_same_error(tmp_path):
    done = launch(2, tmp_path, 0, "refusals")
    reports = [(tmp_path / f"rank{r}.txt") for r in range(2)]
    assert all(r.exists() for r in reports), done.stdout[-3000:] + done.stderr[-3000:]
    first, second = (r.read_text().splitlines() for r in reports)
    assert first == second and len(first) == 6, (first, second)
    causal, window, full, not_written, heads, not_written_either = first
    assert causal.startswith("ValueError: ring_attention: the ranks disagree on causal")
    assert "rank 1: window left must be >= 0" in window
    assert full.startswith("ValueError: sharded_decode: rank 1: ") and "beyond the cache's capacity Cmax = 8" in full
    assert "q's shape" in heads and "rank 1 has (1, 1, 5, 32)" in heads
    assert not_written == not_written_either == "written: False"


def test_an_mlx_rank_that_dies_ends_the_run_not_hangs_it(tmp_path):
    """mlx.launch ends the other ranks when one dies; nothing waits for the dead rank."""
    done = launch(2, tmp_path, 0, "dying", timeout=120)
    assert "Node with rank 1 exited with code 17" in done.stdout + done.stderr, done.stdout + done.stderr
    assert not (tmp_path / "rank0.txt").exists() or "returned" not in (tmp_path / "rank0.txt").read_text()
