"""Malformed calls never crash: PreparedPass.run and the public ops (varlen and the KV-cache
call, contiguous, paged, quantized and appending, included), the flash-attn drop-ins, and
mlx.patch() with every mask form MLX takes, fed wrong arrays and arguments by a seeded
generator (fuzz_child.py) in a subprocess, raise ValueError, TypeError or NotImplementedError
or return a result without NaN (under the patch: MLX's own result); a segfault is a failed exit
code, a hang a timeout."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("fuzz_child.py")
RUN_CASES, OP_CASES = 200, 300
PATCH_CASES = 40   # fuzz_child.PATCH_CASES


def test_malformed_calls_raise_clean_errors_or_return_results():
    done = subprocess.run([sys.executable, str(CHILD), "0", str(RUN_CASES), str(OP_CASES)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    errors, results, bad = map(int, re.search(r"clean errors (\d+) results (\d+) bad (\d+)", done.stdout).groups())
    patched = 0 if importlib.util.find_spec("mlx") is None else PATCH_CASES
    assert bad == 0 and errors + results == RUN_CASES + OP_CASES + patched + 2  # + the two valid runs
    assert errors > 0.6 * (RUN_CASES + OP_CASES), done.stdout
