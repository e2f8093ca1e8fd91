"""`python -m mfa_native info` without a usable C++ compiler: the diagnosis, a clean exit 1."""

from __future__ import annotations

import os
import subprocess
import sys


def run_info(**environment: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **environment}
    return subprocess.run([sys.executable, "-m", "mfa_native", "info"], capture_output=True, text=True,
                          env=env, timeout=120)


def test_a_compiler_that_does_not_exist_is_diagnosed():
    done = run_info(MFA_NATIVE_CXX="/nonexistent", MFA_NATIVE_DEVICE="cpu")
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    assert "device cpu" in done.stdout
    # what was tried, why it failed, how to fix
    assert "MFA_NATIVE_CXX=/nonexistent cannot be used" in done.stdout
    assert "cannot run /nonexistent: No such file or directory" in done.stdout
    assert "To fix: point MFA_NATIVE_CXX at g++ >= 12 or clang++ >= 15, or unset it" in done.stdout
    assert "cpu cannot run kernels here" in done.stderr


def test_a_path_without_compilers_is_diagnosed(tmp_path):
    done = run_info(PATH=str(tmp_path), MFA_NATIVE_CXX="", MFA_NATIVE_DEVICE="cpu")
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    assert "no C++ compiler for the cpu backend" in done.stdout
    assert "PATH has no g++, g++-N, clang++ or clang++-N" in done.stdout
    assert "To fix: install one" in done.stdout and "apt-get install g++" in done.stdout


def test_a_compiler_that_is_too_old_is_diagnosed(tmp_path):
    old = tmp_path / "g++-9"
    old.write_text("#!/bin/sh\necho 'g++ (GCC) 9.4.0'\necho 'Copyright (C) 2019 Free Software Foundation, Inc.'\n")
    old.chmod(0o755)
    done = run_info(PATH=str(tmp_path), MFA_NATIVE_CXX="", MFA_NATIVE_DEVICE="cpu")
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    assert f"tried:\n      '{old}' is g++ (GCC) 9.4.0; the cpu backend needs g++ >= 12 or clang++ >= 15" in done.stdout
