#!/usr/bin/env bash
# Runs every test from a fresh clone: builds the package with the GoogleTest
# suites, then runs ctest and pytest. CI (.ci/run) runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

# GoogleTest for the C++ suites (Debian's package; needs root or sudo once).
if [ ! -f /usr/include/gtest/gtest.h ]; then
  sudo_if_needed=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo")
  $sudo_if_needed apt-get update -qq
  $sudo_if_needed apt-get install -y -qq libgtest-dev
fi

# One build serves both: pip installs the package and keeps the CMake tree
# (with the C++ tests) in build/ for ctest. The torch and mlx extras bring the
# frameworks the adapter tests need (without them those tests are skipped), the docs
# extra MkDocs, which the documentation test builds the site with.
python3 -m pip install --quiet ".[test,torch,mlx,docs]" -Cbuild-dir=build -Ccmake.define.MFA_BUILD_TESTS=ON

ctest --test-dir build --output-on-failure --parallel 2
# One pytest worker per core (pytest-xdist, the test extra's), each test file on one worker: the
# cold run is mostly the host compiler building kernels, which a second core halves.
python3 -m pytest -q -n auto --dist loadfile tests/python
