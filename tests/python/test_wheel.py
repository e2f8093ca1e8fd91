"""The wheel as a user gets it (slow: builds the package; scripts/check-portable.sh runs it).

Built as manylinux toolchains build, with libstdc++ linked statically into the
extension, repaired by auditwheel where it is installed, installed into a fresh
venv and used from there alone: kernels are compiled at run time by the host
compiler against the shim headers the wheel carries. Inside the process another
libstdc++ (numpy's and ml_dtypes' C++) sits beside the static one: that made
std::regex throw std::bad_cast at the first device query and, while _core still
exported libstdc++'s symbols, ostringstream write nothing (colliding pipeline keys).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STATIC_LIBSTDCXX = "-static-libstdc++"


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, f"{command}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The manylinux wheel: pip wheel with libstdc++ linked statically, then auditwheel repair."""
    work = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-w", work / "dist",
         f"-Cbuild-dir={work / 'build'}",
         f"-Ccmake.define.CMAKE_SHARED_LINKER_FLAGS={STATIC_LIBSTDCXX}",
         f"-Ccmake.define.CMAKE_MODULE_LINKER_FLAGS={STATIC_LIBSTDCXX}"])
    (built,) = (work / "dist").glob("mfa_native-*.whl")
    if importlib.util.find_spec("auditwheel") is None:
        pytest.skip("auditwheel is not installed (scripts/check-portable.sh installs it)")
    run([sys.executable, "-m", "auditwheel", "repair", built, "-w", work / "repaired"])
    (repaired,) = (work / "repaired").glob("mfa_native-*manylinux*.whl")
    return repaired


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (numpy, ml_dtypes and pytest from the base interpreter)."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--system-site-packages", venv])
    python = venv / "bin" / "python"
    # --ignore-installed: the base interpreter may have mfa_native too; the venv's must win.
    run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed", wheel])
    return python


def test_the_wheel_is_manylinux_and_needs_no_shared_libstdcxx(wheel):
    shown = run([sys.executable, "-m", "auditwheel", "show", wheel]).stdout
    assert "is consistent with" in " ".join(shown.split()) and "manylinux_" in shown, shown
    assert "libstdc++" not in shown, shown


def test_the_smoke_tests_pass_from_the_wheel_alone(venv_python, tmp_path):
    # A fresh kernel cache: info and demo compile with the host compiler against
    # the shim headers the wheel carries (the subset keeps the test suite's cache).
    env = {**os.environ, "MFA_NATIVE_CACHE_DIR": str(tmp_path / "cache"), "MFA_NATIVE_DEVICE": "cpu"}
    out = run(["bash", ROOT / "scripts" / "wheel-smoke.sh", venv_python], env=env).stdout
    assert f"mfa_native from {venv_python.parent.parent}" in out, out
    assert "compiler:" in out and f"cache_dir: {tmp_path / 'cache'}" in out, out
    assert "(ok, limit" in out, out
    (shim,) = (tmp_path / "cache").glob("shim-*")
    assert (shim / "metal_stdlib").is_file()
    assert any((tmp_path / "cache" / "kernels").glob("*.so"))
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in .*", summary), out
