"""The CMake package C++ embedders use: the C++ guide's attention projects (C++, and C through
the C ABI) and examples/cpp/attention.cpp and decode.cpp build with find_package(mfa_native)
against the *installed* package (the wheel's, or a standalone `cmake --install` of this tree into
a temporary prefix when mfa_native runs from a source tree), and compute attention from a bundle
the CLI wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mfa_native

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def package_dir(tmp_path_factory) -> str:
    installed = Path(mfa_native.cmake_dir())
    if (installed / "mfa_nativeConfig.cmake").exists():
        return str(installed)
    work = tmp_path_factory.mktemp("package")
    _run(["cmake", "-S", str(ROOT), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release"])
    _run(["cmake", "--build", str(work / "build"), "-j2"])
    _run(["cmake", "--install", str(work / "build"), "--prefix", str(work / "prefix")])
    return str(work / "prefix" / "lib" / "cmake" / "mfa_native")


def _guide_section(title: str) -> str:
    text = (ROOT / "docs" / "guides" / "cpp.md").read_text().split("## " + title + "\n", 1)[1]
    return text.split("\n## ", 1)[0]


def _guide_project() -> tuple[str, str, dict]:
    section = _guide_section("Attention from C++: bundles")
    cmake = re.search(r"```cmake\n(.*?)```", section, re.S)[1]
    cpp = re.search(r"```cpp\n(.*?)```", section, re.S)[1]
    spec = json.loads(re.search(r"<<'JSON'\n(.*?)JSON\n", section, re.S)[1])
    return cmake, cpp, spec


def _guide_c_project() -> tuple[str, str]:
    section = _guide_section("Attention from C: the C ABI")
    return re.search(r"```cmake\n(.*?)```", section, re.S)[1], re.search(r"```c\n(.*?)```", section, re.S)[1]


def _build(source: Path, package: str) -> Path:
    _run(["cmake", "-S", str(source), "-B", str(source / "build"), f"-Dmfa_native_DIR={package}",
          "-DCMAKE_BUILD_TYPE=Release"])
    _run(["cmake", "--build", str(source / "build")])
    return source / "build"


def _bundle(spec: dict, path: Path) -> None:
    spec_file = path.with_suffix(".json")
    spec_file.write_text(json.dumps(spec))
    _run([sys.executable, "-m", "mfa_native", "bundle", "-o", str(path), "--spec", str(spec_file), "--quiet"])


@pytest.mark.parametrize("language", ["C++", "C"])
def test_guide_project_builds_and_matches_python(package_dir, tmp_path, language):
    """The C++ project, and the C one through include/mfa/mfa.h, print Python's numbers."""
    cmake, cpp, spec = _guide_project()
    if language == "C":
        cmake, c = _guide_c_project()
        (tmp_path / "main.c").write_text(c)
    else:
        (tmp_path / "main.cpp").write_text(cpp)
    (tmp_path / "CMakeLists.txt").write_text(cmake)
    build = _build(tmp_path, package_dir)
    _bundle(spec, tmp_path / "attention.mfab")
    app = "attention_c" if language == "C" else "attention_app"
    out = _run([str(build / app), str(tmp_path / "attention.mfab")], cwd=tmp_path,
               env={"MFA_NATIVE_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    o0, lse0 = (float(x) for x in re.search(r"out\[0\] = (\S+), lse\[0\] = (\S+)", out).groups())
    B, H, R, C, D = 1, 2, 10, 20, 32
    i = np.arange(B * H * C * D, dtype=np.float32)
    k, v = np.sin(np.float32(0.1) * i).reshape(B, H, C, D), np.cos(np.float32(0.2) * i).reshape(B, H, C, D)
    q = np.cos(np.float32(0.3) * np.arange(B * H * R * D, dtype=np.float32)).reshape(B, H, R, D)
    o, lse = mfa_native.attention(q, k, v, causal=True, return_lse=True, device="cpu")
    assert abs(o0 - o.flat[0]) <= 1e-6 and abs(lse0 - lse.flat[0]) <= 1e-6


def test_examples_build_against_the_package(package_dir, tmp_path):
    """examples/cpp/attention.cpp and sparse.cpp check themselves; examples/cpp/decode.cpp prints its
    Python twin's line (tokens and logits checksum) on the cpu backend, where the two are bit-identical."""
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.20)\nproject(example LANGUAGES CXX)\nset(CMAKE_CXX_STANDARD 17)\n"
        "find_package(mfa_native CONFIG REQUIRED)\n"
        + "".join(f"add_executable({name} {ROOT / 'examples/cpp' / name}.cpp)\n"
                  f"target_link_libraries({name} PRIVATE mfa_native::core)\n" for name in ("attention", "decode", "sparse")))
    build = _build(tmp_path, package_dir)
    _bundle(json.loads((ROOT / "examples/cpp/attention_spec.json").read_text()), tmp_path / "example.mfab")
    out = _run([str(build / "attention"), str(tmp_path / "example.mfab")])
    assert out.count("max relative error") == 2

    _bundle(json.loads((ROOT / "examples/cpp/decode_spec.json").read_text()), tmp_path / "decode.mfab")
    env = {**os.environ, "MFA_NATIVE_DEVICE": "cpu"}
    line = _run([str(build / "decode"), str(tmp_path / "decode.mfab")], env=env).strip()
    assert line.startswith("logits checksum ") and len(line.split("tokens ")[1].split()) == 9
    assert line == _run([sys.executable, str(ROOT / "examples/cpp/decode_twin.py")], env=env).strip()

    _bundle(json.loads((ROOT / "examples/cpp/sparse_spec.json").read_text()), tmp_path / "sparse.mfab")
    assert "indexer's valid lists" in _run([str(build / "sparse"), str(tmp_path / "sparse.mfab")])
