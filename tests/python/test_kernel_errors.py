"""Every error path of the Kernel API raises a clear Python exception."""

from __future__ import annotations

import numpy as np
import pytest

import mfa_native

SOURCE = """
#include <metal_stdlib>
using namespace metal;
constant uint COUNT [[function_constant(0)]];
kernel void copy(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                 constant float& scale [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  if (i < COUNT) y[i] = x[i] * scale;
}
"""


@pytest.fixture(scope="module")
def kernel() -> mfa_native.Kernel:
    return mfa_native.Kernel(SOURCE, "copy", constants={"COUNT": 16}, device="cpu")


@pytest.fixture
def arrays(rng):
    return rng.standard_normal(16).astype(np.float32), np.full(16, np.nan, np.float32)


def run(kernel, buffers, **launch):
    launch.setdefault("threadgroups", 1)
    launch.setdefault("threads_per_threadgroup", 16)
    return kernel(buffers, **launch)


def test_the_happy_path_works(kernel, arrays):
    x, y = arrays
    run(kernel, [x, y, np.float32(2.0)])
    np.testing.assert_allclose(y, 2 * x)


def test_unbound_buffer_index(kernel, arrays):
    x, _ = arrays
    with pytest.raises(ValueError, match=r"\[\[buffer\(1\)\]\] 'y' is not bound"):
        run(kernel, [x])
    with pytest.raises(ValueError, match=r"\[\[buffer\(1\)\]\] 'y' is not bound"):
        run(kernel, [x, None, np.float32(1)])


def test_a_buffer_the_kernel_does_not_have(kernel, arrays):
    x, y = arrays
    with pytest.raises(ValueError, match=r"has no \[\[buffer\(3\)\]\]"):
        run(kernel, [x, y, np.float32(1), x])


def test_wrong_scalar_type(kernel, arrays):
    x, y = arrays
    with pytest.raises(TypeError, match="must be float32, got float64"):
        run(kernel, [x, y, np.float64(2.0)])
    with pytest.raises(TypeError, match="must be float32, got int32"):
        run(kernel, [x, y, np.int32(2)])
    with pytest.raises(TypeError, match="must be a number"):
        run(kernel, [x, y, "2"])


def test_wrong_array_element_type(kernel, arrays):
    x, y = arrays
    with pytest.raises(TypeError, match="holds float32 elements, got an array of float64"):
        run(kernel, [x.astype(np.float64), y, np.float32(1)])


def test_non_contiguous_array(kernel, rng):
    x = rng.standard_normal(32).astype(np.float32)[::2]
    y = np.empty(16, np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        run(kernel, [x, y, np.float32(1)])


def test_read_only_array_for_a_written_buffer(kernel, arrays):
    x, y = arrays
    y.flags.writeable = False
    with pytest.raises(ValueError, match="writable in the kernel, but read-only"):
        run(kernel, [x, y, np.float32(1)])


def test_too_many_threads_per_threadgroup(kernel, arrays):
    x, y = arrays
    with pytest.raises(ValueError, match="2048 threads per threadgroup exceeds the limit of 1024"):
        run(kernel, [x, y, np.float32(1)], threads_per_threadgroup=(1024, 2))


@pytest.mark.parametrize("grid,error", [(0, ValueError), ((1, 2, 3, 4), TypeError), (1.5, TypeError),
                                        ((1, -1), ValueError), (True, TypeError)])
def test_malformed_grid(kernel, arrays, grid, error):
    x, y = arrays
    with pytest.raises(error, match="threadgroups"):
        run(kernel, [x, y, np.float32(1)], threadgroups=grid)


def test_buffers_must_be_a_sequence(kernel, arrays):
    x, _ = arrays
    with pytest.raises(TypeError, match="sequence"):
        run(kernel, x)


def test_unknown_function_constant():
    with pytest.raises(ValueError, match="no function constant 'LENGTH'.*COUNT"):
        mfa_native.Kernel(SOURCE, "copy", constants={"LENGTH": 4}, device="cpu")
    with pytest.raises(ValueError, match="no function constant index 3"):
        mfa_native.Kernel(SOURCE, "copy", constants={3: 4}, device="cpu")


def test_function_constant_of_the_wrong_type():
    with pytest.raises(TypeError, match="COUNT.*integer"):
        mfa_native.Kernel(SOURCE, "copy", constants={"COUNT": 1.5}, device="cpu")
    with pytest.raises(ValueError, match="out of range for uint"):
        mfa_native.Kernel(SOURCE, "copy", constants={"COUNT": -1}, device="cpu")
    with pytest.raises(TypeError, match="bool, int or float"):
        mfa_native.Kernel(SOURCE, "copy", constants={"COUNT": "4"}, device="cpu")


def test_a_used_function_constant_without_a_value():
    with pytest.raises(mfa_native.CompileError, match="function_constant_COUNT_index_0_has_no_value"):
        mfa_native.Kernel(SOURCE, "copy", device="cpu")


def test_unknown_kernel_name():
    with pytest.raises(ValueError, match="no kernel named 'paste'.*copy"):
        mfa_native.Kernel(SOURCE, "paste", constants={"COUNT": 4}, device="cpu")


def test_compile_errors_carry_the_log_and_the_metal_line():
    broken = SOURCE.replace("y[i] = x[i] * scale;", "y[i] = x[i] * scael;")
    with pytest.raises(mfa_native.CompileError) as caught:
        mfa_native.Kernel(broken, "copy", constants={"COUNT": 4}, device="cpu")
    assert "scael" in caught.value.log
    line = broken.splitlines().index(next(l for l in broken.splitlines() if "scael" in l)) + 1
    assert f"copy.metal:{line}" in caught.value.log


def test_unknown_device():
    with pytest.raises(ValueError, match="device must be"):
        mfa_native.Kernel(SOURCE, "copy", device="gpu")
    with pytest.raises(TypeError, match="device must be"):
        mfa_native.Kernel(SOURCE, "copy", device=3)


def test_metal_is_cleanly_absent_here():
    if any(d.kind == "metal" for d in mfa_native.devices()):
        pytest.skip("this machine has Metal")
    assert [d.kind for d in mfa_native.devices()] == ["cpu"]
    with pytest.raises(mfa_native.DeviceUnavailableError, match="Metal"):
        mfa_native.Kernel(SOURCE, "copy", device="metal")


def test_out_of_bounds_access_is_caught_with_bounds_checking(rng):
    source = SOURCE.replace("if (i < COUNT) y[i]", "y[i + COUNT]")
    x = rng.standard_normal(16).astype(np.float32)
    y = np.empty(16, np.float32)
    checked = mfa_native.Kernel(source, "copy", constants={"COUNT": 16}, device="cpu", bounds_check=True)
    with pytest.raises(mfa_native.DispatchError, match=r"kernel 'copy'.*out-of-bounds.*buffer\(1\)"):
        checked([x, y, np.float32(1)], threadgroups=1, threads_per_threadgroup=16)


def test_runtime_diagnostics_raise_instead_of_hanging():
    source = """
    #include <metal_stdlib>
    using namespace metal;
    kernel void early_exit(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
      if (i == 3) return;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      y[i] = 1.0f;
    }
    """
    kernel = mfa_native.Kernel(source, "early_exit", device="cpu")
    with pytest.raises(mfa_native.DispatchError, match="threadgroup_barrier"):
        kernel([np.zeros(64, np.float32)], threadgroups=1, threads_per_threadgroup=64)


def test_an_endless_loop_ends_with_the_watchdog_and_the_process_stays_usable(monkeypatch):
    source = """
    #include <metal_stdlib>
    using namespace metal;
    kernel void forever(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
      float x = y[i];
      while (x >= 0.0f) {
        x = x + 1.0f;
      }
      y[i] = x;
    }
    """
    monkeypatch.setenv("MFA_NATIVE_CPU_WATCHDOG_S", "0.5")
    kernel = mfa_native.Kernel(source, "forever", device="cpu")
    y = np.ones(64, np.float32)
    with pytest.raises(mfa_native.DispatchError,
                       match=r"kernel 'forever': .*still running after 0.5 s .*in the loop at forever.metal:6"):
        kernel([y], threadgroups=2, threads_per_threadgroup=32)
    y[:] = -1.0  # the same kernel, now with loops that end, and another kernel after it
    kernel([y], threadgroups=2, threads_per_threadgroup=32)
    np.testing.assert_array_equal(y, -1.0)
    x = np.arange(16, dtype=np.float32)
    out = np.empty(16, np.float32)
    run(mfa_native.Kernel(SOURCE, "copy", constants={"COUNT": 16}, device="cpu"), [x, out, np.float32(3)])
    np.testing.assert_array_equal(out, 3 * x)
