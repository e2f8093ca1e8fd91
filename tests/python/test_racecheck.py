"""The race detector for threadgroup memory (sanitize="race", MFA_NATIVE_SANITIZE=race)."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import mfa_native
from kernel_sweep import GENERATED_KERNEL_TESTS, SAMPLED_KERNEL_TESTS, run_sweep
from mfa_native.sample_kernels import gemm

REDUCTION = """
#include <metal_stdlib>
using namespace metal;
constant bool SYNC [[function_constant(0)]];
kernel void total(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                  uint i [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]]) {
  threadgroup float partial[128];
  partial[i] = x[i];
  if (SYNC) threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = n / 2; stride > 0; stride /= 2) {
    if (i < stride) partial[i] += partial[i + stride];
    if (SYNC) threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (i == 0) out[0] = partial[0];
}
"""


def reduce(sync: bool, sanitize: str | None = "race") -> np.ndarray:
    kernel = mfa_native.Kernel(REDUCTION, "total", constants={"SYNC": sync}, device="cpu", sanitize=sanitize)
    out = np.zeros(1, np.float32)
    kernel([np.arange(128, dtype=np.float32), out], threadgroups=1, threads_per_threadgroup=128)
    return out


def test_a_reduction_with_its_barriers_is_race_free():
    assert reduce(True)[0] == 127 * 128 / 2


def test_a_reduction_without_its_barriers_reports_both_lines_and_threads():
    with pytest.raises(mfa_native.DispatchError) as error:
        reduce(False)
    assert str(error.value) == (
        "kernel 'total': threadgroup (0, 0, 0): data race (write-after-read) on byte 4 of the kernel-scope "
        "threadgroup variables: thread (0, 0, 0) (simdgroup 0, lane 0) read it at total.metal:11, then "
        "thread (1, 0, 0) (simdgroup 0, lane 1) wrote it at total.metal:8, with no "
        "threadgroup_barrier(mem_flags::mem_threadgroup) between them (nor a simdgroup_barrier with "
        "mem_threadgroup, for lanes of one simdgroup)")


def test_unchecked_the_racy_reduction_is_silently_wrong():
    assert reduce(False, sanitize=None)[0] != 127 * 128 / 2


# float16 and bfloat16 elements store `ELEMENT(a_tile[e])`: an explicit cast of a checked
# threadgroup element, which g++ 13 refused for half (see mfa_buffer_ptr.h, static_castable).
@pytest.mark.parametrize("dtype, tolerance", [(np.float32, 1e-4), (np.float16, 2e-3), (ml_dtypes.bfloat16, 1e-2)],
                         ids=["float32", "float16", "bfloat16"])
def test_a_gemm_through_threadgroup_tiles_is_race_free(rng, monkeypatch, dtype, tolerance):
    monkeypatch.setenv("MFA_NATIVE_SANITIZE", "race")
    a = rng.standard_normal((40, 72)).astype(dtype)
    b = rng.standard_normal((72, 36)).astype(dtype)
    c, stats = gemm(a, b, device="cpu")
    expected = a.astype(np.float64) @ b.astype(np.float64)
    assert np.linalg.norm(c.astype(np.float64) - expected) / np.linalg.norm(expected) < tolerance
    assert stats.barriers > 0


def test_unknown_sanitizers_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="sanitize must be None, 'race' or 'address'"):
        mfa_native.Kernel(REDUCTION, "total", device="cpu", sanitize="thread")
    monkeypatch.setenv("MFA_NATIVE_SANITIZE", "memory")
    with pytest.raises(ValueError, match="sanitize must be 'race', 'address'.*MFA_NATIVE_SANITIZE"):
        mfa_native.Kernel(REDUCTION, "total", constants={"SYNC": True}, device="cpu")


@pytest.mark.skipif(os.environ.get("MFA_NATIVE_SANITIZE") != "race", reason="run by the sweep below")
def test_the_environment_checks_every_kernel():
    with pytest.raises(mfa_native.DispatchError, match="data race"):
        reduce(False, sanitize=None)


# Every generated kernel runs clean under the race detector: the tests of
# each pass (forward, split-KV partial + combine, backward dQ / dK dV /
# dsinks, block-sparse with given and built transposed lists, from_mask,
# sparse-indexed forward (its staged rows in threadgroup memory), backward, top-k,
# quantize),
# run again in a process where MFA_NATIVE_SANITIZE=race builds every kernel
# checked. The first test there proves that the variable takes effect.
SWEEP = ["tests/python/test_racecheck.py::test_the_environment_checks_every_kernel", *GENERATED_KERNEL_TESTS]
SAMPLE = [SWEEP[0], *SAMPLED_KERNEL_TESTS]   # the default run's (kernel_sweep.py)


@pytest.mark.exhaustive
def test_every_generated_kernel_runs_clean_under_the_race_detector():
    run_sweep("MFA_NATIVE_SANITIZE", "race", SWEEP, workers=2)


def test_a_kernel_of_every_family_runs_clean_under_the_race_detector():
    run_sweep("MFA_NATIVE_SANITIZE", "race", SAMPLE)
