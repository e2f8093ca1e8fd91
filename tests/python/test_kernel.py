"""mfa_native.Kernel on the cpu backend: shuffles, a staged simdgroup_matrix
GEMM with ragged edges, half/bfloat I/O and function constants."""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16

import mfa_native
from mfa_native import _core
from mfa_native.sample_kernels import gemm

from conftest import relative_l2

SHUFFLES = """
#include <metal_stdlib>
using namespace metal;
kernel void shuffles(device const float* x [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     uint i [[thread_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]]) {
  const float v = x[i];
  out[6 * i + 0] = simd_shuffle(v, (lane * 7) % 32);
  out[6 * i + 1] = simd_shuffle_xor(v, 5);
  out[6 * i + 2] = simd_shuffle_down(v, 3);
  out[6 * i + 3] = simd_shuffle_up(v, 2);
  out[6 * i + 4] = simd_sum(v);
  out[6 * i + 5] = simd_prefix_exclusive_sum(v);
}
"""


def shuffles_reference(x: np.ndarray) -> np.ndarray:
    out = np.empty((x.size, 6))
    for base in range(0, x.size, 32):
        v = x[base:base + 32].astype(np.float64)
        for lane in range(32):
            row = out[base + lane]
            row[0] = v[(lane * 7) % 32]
            row[1] = v[lane ^ 5]
            row[2] = v[lane + 3] if lane + 3 < 32 else v[lane]
            row[3] = v[lane - 2] if lane >= 2 else v[lane]
            row[4] = v.sum()
            row[5] = v[:lane].sum()
    return out.reshape(-1)


def test_shuffles_match_a_scalar_reference(rng):
    x = rng.standard_normal(128).astype(np.float32)
    out = np.full(128 * 6, np.nan, np.float32)
    kernel = mfa_native.Kernel(SHUFFLES, "shuffles", device="cpu")
    stats = kernel([x, out], threadgroups=2, threads_per_threadgroup=64)
    assert stats.threadgroups == 2
    assert relative_l2(out, shuffles_reference(x)) < 1e-6


@pytest.mark.parametrize("m,n,k", [(37, 45, 29), (64, 32, 96), (1, 9, 70)])
def test_staged_gemm_with_ragged_edges(rng, m, n, k):
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c, stats = gemm(a, b, device="cpu")
    assert relative_l2(c, a.astype(np.float64) @ b) < 1e-5
    groups = ((n + 31) // 32) * ((m + 31) // 32)
    assert stats.threadgroups == groups
    # 4 simdgroups x 2x2 products per 8-wide k step, over the 32-padded K.
    assert stats.simdgroup_matrix_ops == groups * 4 * 4 * 4 * ((k + 31) // 32)


@pytest.mark.parametrize("dtype,tolerance", [(np.float16, 2e-3), (bfloat16, 1e-2)])
def test_half_and_bfloat_inputs_and_outputs(rng, dtype, tolerance):
    a = rng.standard_normal((40, 24)).astype(dtype)
    b = rng.standard_normal((24, 33)).astype(dtype)
    c, _ = gemm(a, b, device="cpu")
    assert c.dtype == np.dtype(dtype)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    assert relative_l2(c.astype(np.float32), expected) < tolerance


CONSTANTS = """
#include <metal_stdlib>
using namespace metal;
constant uint WIDTH [[function_constant(0)]];
constant float SCALE [[function_constant(1)]];
constant bool NEGATE [[function_constant(2)]];
constant bool HAS_OFFSET [[function_constant(3)]];
constant half OFFSET [[function_constant(4)]];
kernel void affine(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                   uint i [[thread_position_in_grid]]) {
  if (i >= WIDTH) return;
  float v = x[i] * SCALE;
  if (NEGATE) v = -v;
  if (is_function_constant_defined(OFFSET)) v += float(OFFSET);
  y[i] = v;
}
"""


def test_function_constants_by_name_and_index(rng):
    x = rng.standard_normal(50).astype(np.float32)
    y = np.full(64, np.nan, np.float32)
    kernel = mfa_native.Kernel(CONSTANTS, "affine", constants={"WIDTH": 50, 1: 1.5, "NEGATE": True}, device="cpu")
    kernel([x, y], threadgroups=1, threads_per_threadgroup=64)
    np.testing.assert_allclose(y[:50], -1.5 * x, rtol=1e-6)
    assert np.all(np.isnan(y[50:]))  # guarded: never written

    with_offset = mfa_native.Kernel(CONSTANTS, "affine",
                                    constants={"WIDTH": 50, "SCALE": 2.0, "NEGATE": False, "OFFSET": 0.25},
                                    device="cpu")
    with_offset([x, y], threadgroups=1, threads_per_threadgroup=64)
    np.testing.assert_allclose(y[:50], 2.0 * x + 0.25, rtol=1e-6)


def test_constant_reference_arguments_take_scalars_and_structs(rng):
    source = """
    #include <metal_stdlib>
    using namespace metal;
    struct Params { float scale; uint count; };
    kernel void apply(device float* y [[buffer(0)]], constant Params& p [[buffer(1)]],
                      constant float& bias [[buffer(2)]], uint i [[thread_position_in_grid]]) {
      if (i < p.count) y[i] = y[i] * p.scale + bias;
    }
    """
    params = np.zeros((), dtype=[("scale", np.float32), ("count", np.uint32)])
    params["scale"], params["count"] = 3.0, 20
    y = rng.standard_normal(32).astype(np.float32)
    expected = y.copy()
    expected[:20] = expected[:20] * 3.0 + 0.5
    mfa_native.Kernel(source, "apply", device="cpu")([y, params, np.float32(0.5)], threadgroups=1,
                                                     threads_per_threadgroup=32)
    np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_threadgroup_memory_arguments(rng):
    source = """
    #include <metal_stdlib>
    using namespace metal;
    kernel void reverse(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                        threadgroup float* tile [[threadgroup(0)]],
                        uint t [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]],
                        uint g [[threadgroup_position_in_grid]]) {
      tile[t] = x[g * n + t];
      threadgroup_barrier(mem_flags::mem_threadgroup);
      y[g * n + t] = tile[n - 1 - t];
    }
    """
    x = rng.standard_normal(96).astype(np.float32)
    y = np.full(96, np.nan, np.float32)
    mfa_native.Kernel(source, "reverse", device="cpu")([x, y], threadgroups=3, threads_per_threadgroup=32,
                                                       threadgroup_memory=[32 * 4])
    np.testing.assert_array_equal(y, x.reshape(3, 32)[:, ::-1].reshape(-1))


def test_profile_records_every_dispatch(rng):
    a = rng.standard_normal((16, 16)).astype(np.float32)
    with mfa_native.profile() as p:
        gemm(a, a, device="cpu")
        gemm(a, a, device="cpu")
    assert [r.kernel for r in p.records] == ["gemm", "gemm"]
    assert p.simdgroup_matrix_ops == 2 * p.records[0].simdgroup_matrix_ops > 0


def test_profile_asks_every_backend_to_time_each_dispatch_while_active():
    """Metal times each dispatch of a batch only while asked (an encoder per dispatch); profile() asks."""
    assert not _core.dispatch_timing_requested()
    with mfa_native.profile():
        with mfa_native.profile():
            assert _core.dispatch_timing_requested()
        assert _core.dispatch_timing_requested()
    assert not _core.dispatch_timing_requested()


class _DLPackOnly:
    """An array from another framework: it speaks DLPack and nothing else."""

    def __init__(self, array: np.ndarray, device_type: int = 1) -> None:
        self._array, self._device_type = array, device_type

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (self._device_type, 0)


def test_cpu_dlpack_arrays_are_used_in_place(rng):
    x = rng.standard_normal(50).astype(np.float32)
    y = np.full(64, np.nan, np.float32)
    kernel = mfa_native.Kernel(CONSTANTS, "affine", constants={"WIDTH": 50, "SCALE": 3.0, "NEGATE": False},
                               device="cpu")
    kernel([_DLPackOnly(x), _DLPackOnly(y)], threadgroups=1, threads_per_threadgroup=64)
    np.testing.assert_allclose(y[:50], 3.0 * x, rtol=1e-6)  # written through the DLPack view


def test_metal_dlpack_tensors_need_the_metal_device(rng):
    x = rng.standard_normal(50).astype(np.float32)
    kernel = mfa_native.Kernel(CONSTANTS, "affine", constants={"WIDTH": 50, "SCALE": 3.0, "NEGATE": False},
                               device="cpu")
    with pytest.raises(ValueError, match=r"buffers\[0\] \('x'\) is a Metal tensor.*cpu device"):
        kernel([_DLPackOnly(x, device_type=8), x.copy()], threadgroups=1, threads_per_threadgroup=64)


def test_only_metal_dlpack_capsules_become_device_buffers(rng):
    from mfa_native import _core

    x = rng.standard_normal(8).astype(np.float32)
    with pytest.raises(ValueError, match="device type 1, not Metal"):
        _core.metal_buffer_from_dlpack(mfa_native.default_device(), x.__dlpack__())
