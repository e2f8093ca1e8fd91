"""`python -m mfa_native cache info|clear`, and MFA_NATIVE_CACHE_MAX_BYTES end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys

# A forward small enough to compile and run in about a second: one kernel.
DEMO = ("demo", "--device", "cpu", "--seq", "16", "--heads", "2", "--head-dim", "16")


def run_cli(cache_dir, *args: str, **environment: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MFA_NATIVE_CACHE_MAX_BYTES"}
    env.update(MFA_NATIVE_CACHE_DIR=str(cache_dir), **environment)
    return subprocess.run([sys.executable, "-m", "mfa_native", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def cache_info(cache_dir, **environment: str) -> dict[str, int]:
    done = run_cli(cache_dir, "cache", "info", **environment)
    assert done.returncode == 0, done.stderr
    assert f"kernel cache: {cache_dir / 'kernels'}" in done.stdout
    entries = int(re.search(r"entries: (\d+)", done.stdout).group(1))
    size = int(re.search(r"size: (\d+) bytes", done.stdout).group(1))
    limit = int(re.search(r"limit: (\d+) bytes", done.stdout).group(1))
    return {"entries": entries, "bytes": size, "limit": limit}


def test_info_counts_what_a_run_compiled_and_clear_removes_it(tmp_path):
    assert cache_info(tmp_path) == {"entries": 0, "bytes": 0, "limit": 2 << 30}
    assert run_cli(tmp_path, *DEMO).returncode == 0
    info = cache_info(tmp_path)
    assert info["entries"] >= 1
    on_disk = sum(f.stat().st_size for f in (tmp_path / "kernels").iterdir())
    assert info["bytes"] == on_disk > 0

    done = run_cli(tmp_path, "cache", "clear")
    assert done.returncode == 0, done.stderr
    assert f"removed {info['entries']} entries, {info['bytes']} bytes" in done.stdout
    assert cache_info(tmp_path)["entries"] == 0
    assert list((tmp_path / "kernels").iterdir()) == []
    # The next run rebuilds what it needs.
    assert run_cli(tmp_path, *DEMO).returncode == 0
    assert cache_info(tmp_path)["entries"] == info["entries"]


def test_the_limit_is_read_from_the_environment_and_applied(tmp_path):
    assert cache_info(tmp_path, MFA_NATIVE_CACHE_MAX_BYTES="64M")["limit"] == 64 << 20
    # One byte: every build evicts what no process is loading; runs still work.
    done = run_cli(tmp_path, *DEMO, MFA_NATIVE_CACHE_MAX_BYTES="1")
    assert done.returncode == 0, done.stderr
    assert cache_info(tmp_path)["entries"] == 0


def test_a_malformed_limit_is_reported_without_a_traceback(tmp_path):
    done = run_cli(tmp_path, "cache", "info", MFA_NATIVE_CACHE_MAX_BYTES="lots")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "MFA_NATIVE_CACHE_MAX_BYTES: 'lots' is not a size in bytes" in done.stderr
