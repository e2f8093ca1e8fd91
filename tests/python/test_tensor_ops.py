"""Metal 4 tensor-op MSL through mfa_native.Kernel on the cpu backend: a tile GEMM
staged in threadgroup memory and multiplied by mpp::tensor_ops::matmul2d into a
cooperative tensor. This process runs under one cooperative-tensor layout
(MFA_NATIVE_SHIM_LAYOUT_SEED); tests/cpp/test_tensor_ops.cpp runs the tensor-op
kernels under three."""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16

import mfa_native

from conftest import relative_l2

TILE_GEMM = """
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

// C (M x 32) = A (M x K) * B (K x 32), a 32-row tile per threadgroup; K a multiple of 16.
kernel void tile_gemm(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]],
                      device float* c [[buffer(2)]], constant int2& shape [[buffer(3)]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint group [[threadgroup_position_in_grid]]) {
  const int m = shape.x, k = shape.y;
  threadgroup T a_tile[32 * 16];
  auto tA = tensor(a_tile, extents<int32_t, 16, 32>());
  auto tB = tensor((device T*)b, dextents<int32_t, 2>(32, k));
  auto tC = tensor(c, dextents<int32_t, 2>(32, m));
  matmul2d<matmul2d_descriptor(32, 32, 16, false, false, false, matmul2d_descriptor::mode::multiply_accumulate),
           execution_simdgroups<2>> mm;
  auto cT = mm.get_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  for (uint16_t i = 0; i < cT.get_capacity(); ++i) {
    if (cT.is_valid_element(i)) cT[i] = 0.0f;
  }
  for (int k0 = 0; k0 < k; k0 += 16) {
    for (uint i = tid; i < 32 * 16; i += 64) {
      const int row = int(group) * 32 + int(i / 16);
      a_tile[i] = row < m ? a[row * k + k0 + int(i % 16)] : T(0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    auto b_rows = tB.slice(0, k0);
    mm.run(tA, b_rows, cT);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  cT.store(tC.slice(0, int(group) * 32));
}
"""


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["half", "bfloat"])
def test_a_staged_tile_gemm_accumulates_in_float(rng, dtype):
    m, k = 45, 48
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, 32)).astype(dtype)
    c = np.full((m, 32), np.nan, np.float32)
    type_name = "half" if dtype == np.float16 else "bfloat"
    kernel = mfa_native.Kernel(f"#define T {type_name}\n" + TILE_GEMM, "tile_gemm", device="cpu")
    stats = kernel([a, b, c, np.array([m, k], np.int32)], threadgroups=(m + 31) // 32, threads_per_threadgroup=64)
    assert relative_l2(c, a.astype(np.float64) @ b.astype(np.float64)) < 1e-6
    # Each run issues 4 x 4 x 2 MMAs of 8x8x8, once per threadgroup.
    assert stats.simdgroup_matrix_ops == ((m + 31) // 32) * (k // 16) * 32


def test_an_operand_of_const_elements_is_refused():
    """MetalPerformancePrimitives refuses tensors of const elements as matmul2d operands, and so
    does the shim, so a kernel the cpu backend accepts does not fail on a Mac for it."""
    source = "#define T half\n" + TILE_GEMM.replace("tensor((device T*)b,", "tensor(b,")
    with pytest.raises(mfa_native.CompileError, match="const elements"):
        mfa_native.Kernel(source, "tile_gemm", device="cpu")
