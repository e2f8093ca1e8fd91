"""A C++ program built against the installed package (headers and static core
from the wheel, nothing from the source tree) compiles, runs and checks itself."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import mfa_native

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpp" / "run_kernel.cpp"


def test_the_wheel_carries_the_cpp_core():
    assert (Path(mfa_native.embedding.include_dir()) / "mfa" / "mfa.hpp").is_file()
    assert Path(mfa_native.embedding.library_path()).is_file()


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_an_embedder_builds_against_the_installed_package(tmp_path):
    program = tmp_path / "run_kernel"
    command = ["c++", "-std=c++17", "-O1", str(EXAMPLE), "-o", str(program), *shlex.split(mfa_native.cpp_flags())]
    built = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(program)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert "saxpy on" in ran.stdout and "max error 0" in ran.stdout
