"""`python -m mfa_native` commands run and print what they promise."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "mfa_native", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_info_lists_devices_compiler_cache_and_statistics():
    out = run_cli("info")
    assert "device cpu" in out
    assert "compiler:" in out
    assert "cache_dir:" in out and "kernels_from_disk_cache:" in out
    assert "pipeline cache:" in out and "buffer pool:" in out


def test_bench_core_prints_its_table():
    out = run_cli("bench", "core", "--size", "40", "--repeats", "1")
    for row in ("fiber context switches", "GEMM 40^3", "cold disk cache", "warm disk cache"):
        assert row in out


def test_a_reader_that_stops_early_gets_no_traceback():
    """`python -m mfa_native info | head -1`: the pipe closes after one line."""
    child = subprocess.Popen([sys.executable, "-m", "mfa_native", "info"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, bufsize=1)
    assert child.stdout.readline().startswith("mfa_native ")
    child.stdout.close()
    stderr = child.communicate(timeout=600)[1]
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_bench_serving_compares_varlen_with_padding():
    out = run_cli("bench", "serving", "--quick", "--section", "varlen")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("attention_varlen", "padded"))}
    assert float(rows["padded"][4]) > 2.0, out   # padding to the longest issues more work than varlen


@pytest.mark.exhaustive
def test_bench_serving_times_the_batch_invariant_mode_against_the_default():
    out = run_cli("bench", "serving", "--quick", "--section", "invariant")
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("kvcache", "varlen", "attention"))
            and not line.endswith(" ms")]   # not progress
    assert len(rows) == 4, out
    for row in rows:
        off_kernels, off, on_kernels, on, ratio = row[-5:]
        assert off_kernels == on_kernels and float(off) > 0 and float(on) > 0, out
        assert abs(float(ratio) - float(on) / float(off)) < 0.01, out


def test_bench_serving_cache_steps_read_kv_once_and_split():
    out = run_cli("bench", "serving", "--quick", "--section", "cache")
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("kvcache", "varlen")) and not line.endswith(" ms")]   # not progress
    assert len(rows) == 3, out
    for row in rows:
        kernels, ratio, issued = row[-8], float(row[-5]), float(row[-2])
        assert ratio <= 1.05 and issued == 1.0, out
        assert kernels.endswith("partial+combine" if row[0] == "kvcache" else "forward"), out
