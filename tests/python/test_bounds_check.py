"""Exact array bounds on the cpu backend (bounds_check=True, MFA_NATIVE_BOUNDS_CHECK=1): device
buffers, threadgroup arrays, [[threadgroup(i)]] blocks and thread-local arrays."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import mfa_native
from kernel_sweep import GENERATED_KERNEL_TESTS, SAMPLED_KERNEL_TESTS, run_sweep

# The kernel: small[t + 40] lands in `after`, past ASan's redzone after `small`.
SPILL = """
#include <metal_stdlib>
using namespace metal;
kernel void spill(device float* out [[buffer(0)]], constant int& shift [[buffer(1)]],
                  uint t [[thread_index_in_threadgroup]]) {
  threadgroup float small[32];
  threadgroup float after[32];
  after[t] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  small[int(t) + shift] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = after[t];
}
"""

# a[8] on a thread's float a[4] lands in the thread's other locals.
LOCAL = """
#include <metal_stdlib>
using namespace metal;
kernel void local(device float* out [[buffer(0)]], constant int& index [[buffer(1)]],
                  uint t [[thread_position_in_grid]]) {
  float before[4] = {5.0f, 6.0f, 7.0f, 8.0f};
  float a[4];
  for (int k = 0; k < 4; ++k) { a[k] = float(k + int(t)); }
  out[t] = a[index] + before[t % 4];
}
"""

BLOCK = """
#include <metal_stdlib>
using namespace metal;
kernel void block(device float* out [[buffer(0)]], constant int& shift [[buffer(1)]],
                  threadgroup float* tile [[threadgroup(0)]], uint t [[thread_index_in_threadgroup]]) {
  tile[t] = float(t);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = tile[(int(t) + shift) % 64];
}
"""


def run(source: str, name: str, value: int, threads: int = 32, **kwargs) -> np.ndarray:
    out = np.full(threads, np.nan, np.float32)
    kernel = mfa_native.Kernel(source, name, device="cpu", **kwargs)
    memory = {"threadgroup_memory": [64 * 4]} if name == "block" else {}
    kernel([out, np.int32(value)], threadgroups=1, threads_per_threadgroup=threads, **memory)
    return out


def failure(source: str, name: str, value: int, **kwargs) -> str:
    with pytest.raises(mfa_native.DispatchError) as caught:
        run(source, name, value, **kwargs)
    return str(caught.value)


def test_an_index_past_a_threadgroup_array_fails_instead_of_writing_its_neighbour():
    assert run(SPILL, "spill", 0, bounds_check=True).tolist() == [1.0] * 32
    if os.environ.get("MFA_NATIVE_BOUNDS_CHECK") != "1":  # unchecked, `after` is silently overwritten
        assert run(SPILL, "spill", 40).tolist() == [1.0] * 8 + [2.0] * 24
    message = failure(SPILL, "spill", 40, bounds_check=True)
    found = re.fullmatch(r"kernel 'spill': threadgroup \(0, 0, 0\), thread \((\d+), 0, 0\): out-of-bounds index "
                         r"(\d+) into threadgroup float small\[32\] \(32 elements\) at spill\.metal:10", message)
    assert found, message
    assert int(found[2]) == int(found[1]) + 40
    # Just before it, and far away.
    assert failure(SPILL, "spill", -1, bounds_check=True).endswith(
        "thread (0, 0, 0): out-of-bounds index -1 into threadgroup float small[32] (32 elements) at spill.metal:10")
    assert re.search(r"out-of-bounds index 10000\d\d into threadgroup float small\[32\] \(32 elements\)",
                     failure(SPILL, "spill", 1_000_000, bounds_check=True))


def test_an_index_past_a_thread_array_fails():
    assert run(LOCAL, "local", 3, bounds_check=True).tolist() == [3.0 + t + 5.0 + t % 4 for t in range(32)]
    assert failure(LOCAL, "local", 8, bounds_check=True) == (
        "kernel 'local': threadgroup (0, 0, 0), thread (0, 0, 0): out-of-bounds index 8 into thread float a[4] "
        "(4 elements) at local.metal:9")
    assert "out-of-bounds index -1 into thread float a[4] (4 elements)" in failure(
        LOCAL, "local", -1, bounds_check=True)


def test_threadgroup_argument_memory_is_checked_against_its_length():
    assert run(BLOCK, "block", 3, 64, bounds_check=True).tolist() == [float((t + 3) % 64) for t in range(64)]
    message = failure(BLOCK, "block", -40, bounds_check=True)
    assert re.search(r"out-of-bounds index -\d+ into \[\[threadgroup\(0\)\]\] threadgroup float\* tile "
                     r"\(64 elements\) at block\.metal:8$", message), message


def test_the_sample_gemm_runs_clean_with_bounds_checks(rng):
    from mfa_native.sample_kernels import GEMM_SOURCE

    a = rng.standard_normal((40, 72)).astype(np.float32)
    b = rng.standard_normal((72, 36)).astype(np.float32)
    checked = mfa_native.Kernel(GEMM_SOURCE.replace("ELEMENT", "float"), "gemm", constants={"M": 40, "N": 36, "K": 72},
                                device="cpu", bounds_check=True)
    c = np.full((40, 36), np.nan, np.float32)
    checked([a, b, c], threadgroups=(2, 2), threads_per_threadgroup=128)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)


def test_a_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv("MFA_NATIVE_BOUNDS_CHECK", "yes")
    with pytest.raises(ValueError, match="MFA_NATIVE_BOUNDS_CHECK must be 1 .* or 0, got 'yes'"):
        mfa_native.Kernel(SPILL, "spill", device="cpu")


@pytest.mark.skipif(os.environ.get("MFA_NATIVE_BOUNDS_CHECK") != "1", reason="run by the sweep below")
def test_the_environment_checks_every_kernel():
    with pytest.raises(mfa_native.DispatchError, match="out-of-bounds index 40 into thread float a"):
        run(LOCAL, "local", 40)


# Every generated kernel runs clean with every array and buffer access
# checked: the passes of the race sweep (tests/python/test_racecheck.py), and
# ragged lengths, odd head dimensions, int8 and quantized K/V, views whose first element
# forbids vector pairs (a misaligned vector access would fail here), run again in a
# process where MFA_NATIVE_BOUNDS_CHECK=1 builds every kernel checked. The
# first test there proves that the variable takes effect.
SWEEP = ["tests/python/test_bounds_check.py::test_the_environment_checks_every_kernel", *GENERATED_KERNEL_TESTS,
         "tests/python/test_attention.py::test_sequence_lengths_including_one_and_ragged",
         "tests/python/test_attention.py::test_head_dimensions",
         "tests/python/test_int8_attention.py::test_computes_the_emulated_pipeline",
         "tests/python/test_quantized_attention.py::test_every_format_as_k_and_as_v",
         "tests/python/test_vector_access.py::test_views_that_forbid_vector_pairs_fall_back_and_stay_right"]
# The default run's (kernel_sweep.SAMPLED_KERNEL_TESTS), with the views that forbid vector pairs.
SAMPLE = [SWEEP[0], *SAMPLED_KERNEL_TESTS, SWEEP[-1]]


@pytest.mark.exhaustive
def test_every_generated_kernel_runs_clean_with_bounds_checks():
    run_sweep("MFA_NATIVE_BOUNDS_CHECK", "1", SWEEP, workers=2)


def test_a_kernel_of_every_family_runs_clean_with_bounds_checks():
    run_sweep("MFA_NATIVE_BOUNDS_CHECK", "1", SAMPLE)


def test_the_address_sanitizer_implies_the_exact_array_checks():
    """sanitize="address" catches what ASan alone cannot: an index past a threadgroup array into
    its neighbour, and past a thread array, with the same message as bounds_check=True."""
    pytest.importorskip("mfa_native.runtime.asan")
    message = failure(SPILL, "spill", 40, sanitize="address")
    assert re.fullmatch(r"kernel 'spill': threadgroup \(0, 0, 0\), thread \(\d+, 0, 0\): out-of-bounds index \d+ "
                        r"into threadgroup float small\[32\] \(32 elements\) at spill\.metal:10", message), message
    assert failure(LOCAL, "local", 8, sanitize="address") == (
        "kernel 'local': threadgroup (0, 0, 0), thread (0, 0, 0): out-of-bounds index 8 into thread float a[4] "
        "(4 elements) at local.metal:9")
    assert run(SPILL, "spill", 0, sanitize="address").tolist() == [1.0] * 32
