"""sanitize="address": the kernel built with AddressSanitizer runs in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mfa_native
from mfa_native.runtime import asan

STACK = """
#include <metal_stdlib>
using namespace metal;
kernel void stack_overflow(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                           uint i [[thread_position_in_grid]]) {
  float local[8];
  for (uint k = 0; k < 8; ++k) local[k] = float(k + i);
  out[i] = local[n + i];
}
"""

THREADGROUP = """
#include <metal_stdlib>
using namespace metal;
kernel void threadgroup_overflow(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                                 uint i [[thread_index_in_threadgroup]]) {
  threadgroup float a[32];
  a[i] = float(i);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = a[i + n];
}
"""

# Through a pointer into a stack array: ASan's to find (the exact array checks follow indices
# into arrays, not a pointer made from one).
THROUGH_POINTER = """
#include <metal_stdlib>
using namespace metal;
kernel void through_pointer(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                            uint i [[thread_position_in_grid]]) {
  float local[8];
  for (uint k = 0; k < 8; ++k) local[k] = float(k + i);
  thread float* p = local + n;
  out[i] = *p;
}
"""

# Every thread keeps a stack array live across barriers and fiber switches.
REDUCTION = """
#include <metal_stdlib>
using namespace metal;
kernel void total(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                  uint i [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]],
                  uint g [[threadgroup_position_in_grid]]) {
  threadgroup float partial[1024];
  float local[4];
  for (uint k = 0; k < 4; ++k) local[k] = x[g * n + i] * float(k + 1);
  partial[i] = local[0];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = n / 2; stride > 0; stride /= 2) {
    if (i < stride) partial[i] += partial[i + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (i == 0) out[g] = partial[0] + local[3] - 4 * local[0];
}
"""


def run(source: str, name: str, n: int, threads: int, **kwargs) -> np.ndarray:
    out = np.zeros(32, np.float32)
    kernel = mfa_native.Kernel(source, name, device="cpu", **kwargs)
    kernel([out, np.uint32(n)], threadgroups=1, threads_per_threadgroup=threads)
    return out


def test_out_of_bounds_is_reported_with_the_metal_line():
    assert run(THROUGH_POINTER, "through_pointer", 0, 8, sanitize="address")[:8].tolist() == [float(i) for i in range(8)]
    with pytest.raises(mfa_native.DispatchError) as caught:
        run(THROUGH_POINTER, "through_pointer", 8, 1, sanitize="address")
    message = str(caught.value)
    assert "kernel 'through_pointer'" in message
    assert "ERROR: AddressSanitizer: stack-buffer-overflow" in message
    assert "in through_pointer " in message and "through_pointer.metal:9" in message
    # The parent process still runs kernels, checked or not.
    assert run(THROUGH_POINTER, "through_pointer", 0, 8)[:8].tolist() == \
        run(THROUGH_POINTER, "through_pointer", 0, 8, sanitize="address")[:8].tolist()


@pytest.mark.parametrize("source, name, n, array, line", [
    (STACK, "stack_overflow", 8, "thread float local[8] (8 elements)", "stack_overflow.metal:8"),
    (THREADGROUP, "threadgroup_overflow", 32, "threadgroup float a[32] (32 elements)", "threadgroup_overflow.metal:9"),
], ids=["stack", "threadgroup"])
def test_an_index_past_an_array_is_the_exact_checks_report(source, name, n, array, line):
    """sanitize="address" implies the exact array checks: an index past a thread or threadgroup
    array is their report (ASan alone misses the threadgroup one when it lands in a neighbour)."""
    assert run(source, name, 0, 8, sanitize="address")[:8].tolist() == (
        [2.0 * i for i in range(8)] if name == "stack_overflow" else list(range(8)))
    with pytest.raises(mfa_native.DispatchError) as caught:
        run(source, name, n, 1, sanitize="address")
    assert str(caught.value) == (f"kernel '{name}': threadgroup (0, 0, 0), thread (0, 0, 0): out-of-bounds index "
                                 f"{n} into {array} at {line}")


def test_clean_kernel_with_many_threads_and_barriers_has_no_false_reports(monkeypatch):
    children, real_run = [], subprocess.run

    def run_child(*args, **kwargs):
        children.append(real_run(*args, **kwargs))
        return children[-1]

    monkeypatch.setattr(asan.subprocess, "run", run_child)
    groups, threads = 3, 1024
    x = np.random.default_rng(0).standard_normal(groups * threads).astype(np.float32)
    out = np.zeros(groups, np.float32)
    kernel = mfa_native.Kernel(REDUCTION, "total", device="cpu", sanitize="address")
    assert kernel([x, out], threadgroups=groups, threads_per_threadgroup=threads) is None
    np.testing.assert_allclose(out, x.reshape(groups, threads).sum(axis=1), rtol=1e-4, atol=1e-3)
    # ASan said nothing: no warning about the fibers' stack switches either.
    assert [(c.returncode, c.stderr) for c in children if "mfa_native.runtime.asan_child" in c.args] == [(0, "")]


def test_read_only_inputs_are_accepted_and_encoding_is_refused():
    kernel = mfa_native.Kernel(REDUCTION, "total", device="cpu", sanitize="address")
    x = np.ones(32, np.float32)
    x.flags.writeable = False
    out = np.zeros(1, np.float32)
    kernel([x, out], threadgroups=1, threads_per_threadgroup=32)
    assert out[0] == 32 + 4 - 4
    with pytest.raises(ValueError, match="child process"):
        kernel.encode(mfa_native._core.CommandBatch(kernel.device), [x, out], threadgroups=1,
                      threads_per_threadgroup=32)


def test_environment_variable_selects_address_for_kernels():
    code = ("import numpy as np, mfa_native\n"
            f"k = mfa_native.Kernel({THROUGH_POINTER!r}, 'through_pointer', device='cpu')\n"
            "try:\n"
            "    k([np.zeros(8, np.float32), np.uint32(8)], threadgroups=1, threads_per_threadgroup=1)\n"
            "except mfa_native.DispatchError as e:\n"
            "    print('stack-buffer-overflow' in str(e))\n")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MFA_NATIVE_SANITIZE": "address"},
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "True", result.stderr

