#!/usr/bin/env bash
# The cpu backend's kernel sweep under every host compiler found: the shim and
# the translator must work with each g++ >= 12 and clang++ >= 16 (the kernel
# compiler is chosen at run time, MFA_NATIVE_CXX). For each compiler: the C++
# suites that compile kernels through the whole shim (SIMD-group functions,
# matrices, atomics, casts, the race detector, array bounds, Metal 4 tensor
# ops as C++20 under three layout seeds), then a small set
# of representative kernels (the sample GEMM in three element types, attention
# forward and backward, sparse-indexed and block-sparse passes, the Kernel API
# tests, views that forbid vector pairs) plain, under the race detector and with bounds
# checks (which also fail a misaligned vector access).
#
# Runs after scripts/run-tests.sh (CI: .ci/run), with the package installed and
# the CMake tree in build/. Installs clang-16 and clang-19 from Debian when they
# are missing and it runs as root; without root it sweeps what is there.
# PYTHON and BUILD_DIR override the interpreter and the CMake tree; COMPILERS
# (names on PATH, space-separated) the compilers to sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
build=${BUILD_DIR:-build}

if [ "$(id -u)" = 0 ]; then
  missing=()
  for version in 16 19; do
    command -v "clang++-$version" > /dev/null || missing+=("clang-$version")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "compiler-sweep: installing ${missing[*]} from Debian"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null; }; then
      echo "compiler-sweep: could not install ${missing[*]}; sweeping the compilers there are"
    fi
  fi
else
  echo "compiler-sweep: not root, installing nothing; sweeping the compilers there are"
fi

# Every g++-N (N >= 12) and clang++-N (N >= 16) on PATH, one per real binary.
compilers=()
declare -A seen=()
for name in ${COMPILERS:-g++-12 g++-13 g++-14 g++-15 clang++-16 clang++-17 clang++-18 clang++-19 clang++-20 clang++-21}; do
  path=$(command -v "$name" || true)
  [ -n "$path" ] || continue
  real=$(readlink -f "$path")
  [ -z "${seen[$real]:-}" ] || continue
  seen[$real]=1
  compilers+=("$name")
done
if [ ${#compilers[@]} -eq 0 ]; then
  echo "compiler-sweep: no g++-N (N >= 12) or clang++-N (N >= 16) on PATH" >&2
  exit 1
fi
[ ${#compilers[@]} -ge 2 ] || echo "compiler-sweep: warning: only ${compilers[*]} found"
echo "compiler-sweep: ${compilers[*]}"

cpp_suites='^(SimdKernelTest|RaceCheckTest|ArrayBoundsTest|TensorOps)\.'
kernels=(
  tests/python/test_racecheck.py::test_a_gemm_through_threadgroup_tiles_is_race_free
  tests/python/test_racecheck.py::test_the_environment_checks_every_kernel
  tests/python/test_bounds_check.py::test_the_environment_checks_every_kernel
  tests/python/test_bounds_check.py::test_an_index_past_a_threadgroup_array_fails_instead_of_writing_its_neighbour
  tests/python/test_bounds_check.py::test_an_index_past_a_thread_array_fails
  tests/python/test_attention.py::test_sinks
  tests/python/test_attention_backward.py::test_sinks
  tests/python/test_vector_access.py::test_views_that_forbid_vector_pairs_fall_back_and_stay_right
  "tests/python/test_sparse.py::test_matches_gather_then_dense[H4/2-topk20]"
  tests/python/test_sparse.py::test_the_indexer_feeds_sparse_attention
  "tests/python/test_block_sparse.py::test_forward_matches_the_dense_reference[(32, 64)-['causal', 'layout', 'mask']]"
  tests/python/test_kernel.py::test_shuffles_match_a_scalar_reference
  "tests/python/test_kernel.py::test_staged_gemm_with_ragged_edges[37-45-29]"
  tests/python/test_kernel.py::test_half_and_bfloat_inputs_and_outputs
  tests/python/test_kernel.py::test_threadgroup_memory_arguments
)

for cxx in "${compilers[@]}"; do
  echo "=== compiler-sweep: $cxx ($("$cxx" --version | head -n 1))"
  MFA_NATIVE_CXX=$cxx ctest --test-dir "$build" --output-on-failure --parallel 2 -R "$cpp_suites"
  for mode in plain race bounds; do
    env=(MFA_NATIVE_CXX="$cxx")
    [ "$mode" = race ] && env+=(MFA_NATIVE_SANITIZE=race)
    [ "$mode" = bounds ] && env+=(MFA_NATIVE_BOUNDS_CHECK=1)
    echo "--- compiler-sweep: $cxx, $mode"
    # The two environment checks run in their own mode and skip in the others.
    env "${env[@]}" "$python" -m pytest -q -p no:cacheprovider -rs "${kernels[@]}"
  done
done
echo "compiler-sweep: passed with ${compilers[*]}"
