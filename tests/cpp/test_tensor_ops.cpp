// Metal 4 tensor ops on the cpu device: MSL kernels written as MLX's and
// llama.cpp's are (tensor views, mpp::tensor_ops::matmul2d, cooperative
// tensors) against float64 or exact integer references. ctest runs this file
// under three cooperative-tensor layout seeds (MFA_NATIVE_SHIM_LAYOUT_SEED
// unset, 1 and 6; tests/cpp/CMakeLists.txt), so no result may depend on one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "mfa/command_batch.hpp"
#include "mfa/device.hpp"
#include "mfa/errors.hpp"

namespace {

std::uint64_t layout_seed() {
  const char* text = std::getenv("MFA_NATIVE_SHIM_LAYOUT_SEED");
  return text ? std::stoull(text) : 0;
}

std::string substitute(std::string text, const std::string& placeholder, const std::string& value) {
  for (std::size_t at = text.find(placeholder); at != std::string::npos; at = text.find(placeholder, at)) {
    text.replace(at, placeholder.size(), value);
  }
  return text;
}

// A host matrix of one MSL element type: bytes for the kernel, doubles for the reference.
struct Matrix {
  std::string type;  // "float", "half", "bfloat", "char", "int"
  std::vector<unsigned char> bytes;
  std::vector<double> values;

  Matrix(const std::string& element_type, std::size_t count)
      : type(element_type), bytes(count * element_bytes(element_type), 0xff), values(count) {}

  static std::size_t element_bytes(const std::string& type) {
    return type == "char" ? 1 : type == "half" || type == "bfloat" ? 2 : 4;
  }
  // Stores `value` rounded to the element type.
  void set(std::size_t i, double value) {
    unsigned char* p = bytes.data() + i * element_bytes(type);
    if (type == "float") {
      const float v = float(value);
      std::memcpy(p, &v, 4);
      values[i] = v;
    } else if (type == "half") {
      const _Float16 v = _Float16(value);
      std::memcpy(p, &v, 2);
      values[i] = double(v);
    } else if (type == "bfloat") {
      const float f = float(value);
      std::uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const std::uint16_t raw = std::uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
      std::memcpy(p, &raw, 2);
      const std::uint32_t back = std::uint32_t(raw) << 16;
      float rounded;
      std::memcpy(&rounded, &back, 4);
      values[i] = rounded;
    } else if (type == "char") {
      const std::int8_t v = std::int8_t(value);
      std::memcpy(p, &v, 1);
      values[i] = v;
    } else {
      const std::int32_t v = std::int32_t(value);
      std::memcpy(p, &v, 4);
      values[i] = v;
    }
  }
  double get(std::size_t i) const {
    const unsigned char* p = bytes.data() + i * element_bytes(type);
    if (type == "float") {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    std::int32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
};

double relative_l2(const Matrix& out, const std::vector<double>& expected) {
  double error = 0, norm = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    error += (out.get(i) - expected[i]) * (out.get(i) - expected[i]);
    norm += expected[i] * expected[i];
  }
  return std::sqrt(error / norm);
}

class TensorOps : public ::testing::Test {
 protected:
  TensorOps() : random_(std::random_device{}()) {}

  // A rows x columns matrix of `type`, random (integers in [-128, 127] for char).
  Matrix random_matrix(const std::string& type, std::size_t rows, std::size_t columns) {
    Matrix m(type, rows * columns);
    for (std::size_t i = 0; i < rows * columns; ++i) {
      m.set(i, type == "char" ? double(std::uniform_int_distribution<int>(-128, 127)(random_))
                              : std::normal_distribution<double>()(random_));
    }
    return m;
  }
  std::vector<double> random_vector(std::size_t n) {
    std::vector<double> v(n);
    for (double& x : v) x = float(std::normal_distribution<double>()(random_));
    return v;
  }

  std::shared_ptr<const mfa::Pipeline> pipeline(const std::string& source, const std::string& name,
                                                bool bounds_check = false, const std::string& sanitize = "",
                                                std::vector<std::pair<std::string, std::string>> macros = {}) {
    mfa::CompileOptions options;
    options.bounds_check = bounds_check;
    options.sanitize = sanitize;
    options.macros = std::move(macros);
    return device_.pipeline(source, name, {}, options);
  }

  mfa::DispatchStats run(const std::shared_ptr<const mfa::Pipeline>& pipeline, std::uint32_t threads,
                         const std::function<void(mfa::CommandBatch::DispatchRef&)>& bind,
                         mfa::Size3 groups = {1}) {
    mfa::CommandBatch batch(device_);
    mfa::CommandBatch::DispatchRef dispatch = batch.dispatch(pipeline, groups, {threads});
    bind(dispatch);
    return batch.run().at(0);
  }

  std::string failure_of(const std::shared_ptr<const mfa::Pipeline>& pipeline, std::uint32_t threads,
                         const std::function<void(mfa::CommandBatch::DispatchRef&)>& bind) {
    try {
      run(pipeline, threads, bind);
    } catch (const mfa::DispatchError& e) {
      return e.what();
    }
    return "no error";
  }

  mfa::Device device_ = mfa::Device::get(mfa::DeviceKind::cpu);
  std::mt19937 random_;
};

// C = A * B into a device tensor, as llama.cpp's kernel_mul_mm makes its
// views: dynamic extents, K read from A's extents (dynamic_length_v<int>).
const char* kDeviceGemm = R"(
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

kernel void device_gemm(device const $T* a [[buffer(0)]],
                        device const $T* b [[buffer(1)]],
                        device float* c [[buffer(2)]],
                        constant int& k [[buffer(3)]]) {
  auto tA = tensor((device $T*)a, dextents<int32_t, 2>(k, 32));
  auto tB = tensor((device $T*)b, dextents<int32_t, 2>(16, k), array<int, 2>({1, 16}));
  auto tC = tensor(c, dextents<int32_t, 2>(16, 32));
  mpp::tensor_ops::matmul2d<mpp::tensor_ops::matmul2d_descriptor(32, 16, mpp::tensor_ops::dynamic_length_v<int>),
                            execution_simdgroups<4>> mm;
  mm.run(tA, tB, tC);
}
)";

std::vector<double> product(const std::vector<double>& a, const std::vector<double>& b, int m, int n, int k,
                            bool a_transposed = false, bool b_transposed = false) {
  std::vector<double> c(std::size_t(m) * n, 0.0);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      for (int l = 0; l < k; ++l) {
        c[i * n + j] += a[a_transposed ? l * m + i : i * k + l] * b[b_transposed ? j * k + l : l * n + j];
      }
    }
  }
  return c;
}

TEST_F(TensorOps, DeviceTensorGemmOfHalfBfloatAndFloatAccumulatesInFloat) {
  constexpr int m = 32, n = 16, k = 24;
  for (const char* type : {"half", "bfloat", "float"}) {
    SCOPED_TRACE(type);
    Matrix a = random_matrix(type, m, k), b = random_matrix(type, k, n), c("float", m * n);
    const mfa::DispatchStats stats =
        run(pipeline(substitute(kDeviceGemm, "$T", type), "device_gemm"), 128, [&](mfa::CommandBatch::DispatchRef& d) {
          d.host(0, a.bytes.data(), a.bytes.size(), false);
          d.host(1, b.bytes.data(), b.bytes.size(), false);
          d.host(2, c.bytes.data(), c.bytes.size(), true);
          d.bytes(3, &k, sizeof k);
        });
    EXPECT_LT(relative_l2(c, product(a.values, b.values, m, n, k)), 1e-6);
    // The traffic counters count a run as the 8x8x8 MMAs it issues, once per scope,
    // and each operand and destination element once.
    EXPECT_EQ(stats.simdgroup_matrix_ops.value(), std::uint64_t((m / 8) * (n / 8) * (k / 8)));
    EXPECT_EQ(stats.barriers.value(), 1u);  // four simdgroups meet as at a barrier
    const std::vector<mfa::BufferTraffic>& traffic = stats.traffic.value();
    EXPECT_EQ(traffic.at(0).bytes_read, a.bytes.size());
    EXPECT_EQ(traffic.at(1).bytes_read, b.bytes.size());
    EXPECT_EQ(traffic.at(2).bytes_written, c.bytes.size());
    EXPECT_EQ(traffic.at(2).bytes_read, 0u);
  }
}

TEST_F(TensorOps, OperandReadsOutsideTheirBufferFailTheBoundsCheck) {
  constexpr int k = 24;
  Matrix a = random_matrix("float", 31, k), b = random_matrix("float", k, 16), c("float", 32 * 16);
  const std::string message = failure_of(
      pipeline(substitute(kDeviceGemm, "$T", "float"), "device_gemm", true), 128,
      [&](mfa::CommandBatch::DispatchRef& d) {
        d.host(0, a.bytes.data(), a.bytes.size(), false);  // one row short of the 32 x k tensor
        d.host(1, b.bytes.data(), b.bytes.size(), false);
        d.host(2, c.bytes.data(), c.bytes.size(), true);
        d.bytes(3, &k, sizeof k);
      });
  EXPECT_NE(message.find("out-of-bounds access to buffer(0)"), std::string::npos) << message;
}

// llama.cpp's edge tiles: each threadgroup slices its 16 x 16 tile out of
// ragged matrices (B stored transposed, K dynamic); the operands read 0
// past their extents and the store drops what falls outside C.
const char* kEdgeTiles = R"(
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

kernel void edge_tiles(device const half* a [[buffer(0)]],
                       device const half* b_t [[buffer(1)]],
                       device float* c [[buffer(2)]],
                       constant int3& shape [[buffer(3)]],
                       uint2 group [[threadgroup_position_in_grid]]) {
  auto tA = tensor((device half*)a, dextents<int32_t, 2>(shape.z, shape.x));
  auto tB = tensor((device half*)b_t, dextents<int32_t, 2>(shape.z, shape.y));
  auto tC = tensor(c, dextents<int32_t, 2>(shape.y, shape.x));
  matmul2d<matmul2d_descriptor(16, 16, dynamic_length_v<int>, false, true, true), execution_simdgroups<2>> mm;
  auto mA = tA.slice(0, group.y * 16);
  auto mB = tB.slice(0, group.x * 16);
  auto cT = mm.get_destination_cooperative_tensor<decltype(mA), decltype(mB), float>();
  mm.run(mA, mB, cT);
  cT.store(tC.slice(group.x * 16, group.y * 16));
}
)";

TEST_F(TensorOps, RaggedTilesSliceReadZerosPastTheirExtentsAndStoreOnlyInside) {
  const int m = 37, n = 21, k = 19;
  Matrix a = random_matrix("half", m, k), b_t = random_matrix("half", n, k), c("float", m * n);
  const int shape[4] = {m, n, k, 0};
  run(
      pipeline(kEdgeTiles, "edge_tiles", /*bounds_check=*/true), 64,
      [&](mfa::CommandBatch::DispatchRef& d) {
        d.host(0, a.bytes.data(), a.bytes.size(), false);
        d.host(1, b_t.bytes.data(), b_t.bytes.size(), false);
        d.host(2, c.bytes.data(), c.bytes.size(), true);
        d.bytes(3, shape, sizeof shape);
      },
      {(n + 15) / 16, (m + 15) / 16});
  EXPECT_LT(relative_l2(c, product(a.values, b_t.values, m, n, k, false, true)), 1e-6);
}

// MLX-style staging: transposed operands in threadgroup memory, static
// slices per K step, multiply_accumulate into a cooperative tensor, each
// element then scaled by its row through get_multidimensional_index.
const char* kStagedGemm = R"(
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

kernel void staged_gemm(device const float* a_t [[buffer(0)]],
                        device const float* b_t [[buffer(1)]],
                        device const float* row_scale [[buffer(2)]],
                        device float* c [[buffer(3)]],
                        uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float a_tile[32 * 32];
  threadgroup float b_tile[16 * 32];
  for (uint i = tid; i < 32 * 32; i += 64) a_tile[i] = a_t[i];
  for (uint i = tid; i < 16 * 32; i += 64) b_tile[i] = b_t[i];
#ifndef MISSING_BARRIER
  threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
  auto tA = tensor(a_tile, extents<int32_t, 32, 32>());
  auto tB = tensor(b_tile, extents<int32_t, 32, 16>());
  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
      32, 16, 8, true, true, false, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
  mpp::tensor_ops::matmul2d<desc, execution_simdgroups<2>> mm;
  auto cT = mm.get_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  for (uint16_t i = 0; i < cT.get_capacity(); ++i) {
    if (cT.is_valid_element(i)) cT[i] = 0.0f;
  }
  for (int k0 = 0; k0 < 32; k0 += 8) {
    auto a = tA.static_slice<32, 8>(0, k0);
    auto b = tB.static_slice<8, 16>(k0, 0);
    mm.run(a, b, cT);
  }
  for (uint16_t i = 0; i < cT.get_capacity(); ++i) {
    if (cT.is_valid_element(i)) {
      auto index = cT.get_multidimensional_index(i);
      cT[i] *= row_scale[index[1]];
    }
  }
  auto tC = tensor(c, dextents<int32_t, 2>(16, 32));
  cT.store(tC);
}
)";

TEST_F(TensorOps, ThreadgroupSlicesAccumulateTransposedOperandsIntoAScaledCooperativeTensor) {
  constexpr int m = 32, n = 16, k = 32;
  Matrix a_t = random_matrix("float", k, m), b_t = random_matrix("float", n, k), c("float", m * n);
  Matrix scale = random_matrix("float", m, 1);
  run(pipeline(kStagedGemm, "staged_gemm"), 64, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, a_t.bytes.data(), a_t.bytes.size(), false);
    d.host(1, b_t.bytes.data(), b_t.bytes.size(), false);
    d.host(2, scale.bytes.data(), scale.bytes.size(), false);
    d.host(3, c.bytes.data(), c.bytes.size(), true);
  });
  std::vector<double> expected = product(a_t.values, b_t.values, m, n, k, true, true);
  for (int i = 0; i < m * n; ++i) expected[i] *= scale.values[i / n];
  EXPECT_LT(relative_l2(c, expected), 1e-6);
}

TEST_F(TensorOps, RunningOnAThreadgroupTileBeforeItsBarrierIsARace) {
  Matrix a_t = random_matrix("float", 32, 32), b_t = random_matrix("float", 16, 32), c("float", 32 * 16);
  Matrix scale = random_matrix("float", 32, 1);
  const std::string message = failure_of(
      pipeline(kStagedGemm, "staged_gemm", false, "race", {{"MISSING_BARRIER", "1"}}), 64,
      [&](mfa::CommandBatch::DispatchRef& d) {
        d.host(0, a_t.bytes.data(), a_t.bytes.size(), false);
        d.host(1, b_t.bytes.data(), b_t.bytes.size(), false);
        d.host(2, scale.bytes.data(), scale.bytes.size(), false);
        d.host(3, c.bytes.data(), c.bytes.size(), true);
      });
  EXPECT_NE(message.find("race"), std::string::npos) << message;
}

// int8 operands, int32 accumulation, one simdgroup (execution_simdgroup).
const char* kInt8Gemm = R"(
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

kernel void int8_gemm(device const char* a [[buffer(0)]],
                      device const char* b [[buffer(1)]],
                      device int* c [[buffer(2)]]) {
  auto tA = tensor((device char*)a, extents<int32_t, 64, 16>());
  auto tB = tensor((device char*)b, extents<int32_t, 16, 64>());
  auto tC = tensor(c, extents<int32_t, 16, 16>());
  mpp::tensor_ops::matmul2d<mpp::tensor_ops::matmul2d_descriptor(16, 16, 64), execution_simdgroup> mm;
  auto cT = mm.get_destination_cooperative_tensor<decltype(tA), decltype(tB), int>();
  mm.run(tA, tB, cT);
  cT.store(tC);
}
)";

TEST_F(TensorOps, Int8ProductsAccumulateExactlyInInt32) {
  constexpr int m = 16, n = 16, k = 64;
  Matrix a = random_matrix("char", m, k), b = random_matrix("char", k, n), c("int", m * n);
  run(pipeline(kInt8Gemm, "int8_gemm"), 32, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, a.bytes.data(), a.bytes.size(), false);
    d.host(1, b.bytes.data(), b.bytes.size(), false);
    d.host(2, c.bytes.data(), c.bytes.size(), true);
  });
  const std::vector<double> expected = product(a.values, b.values, m, n, k);
  for (int i = 0; i < m * n; ++i) ASSERT_EQ(c.get(i), expected[i]) << "element " << i;
}

// Cooperative-tensor operands, as a single simdgroup fills them: the left one
// element by element through get_multidimensional_index, the right one
// (transposed) with load; two multiply_accumulate runs.
const char* kCooperativeOperands = R"(
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

kernel void cooperative_operands(device const half* a [[buffer(0)]],
                                 device const half* b_t [[buffer(1)]],
                                 device float* c [[buffer(2)]]) {
  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
      16, 16, 16, false, true, false, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
  mpp::tensor_ops::matmul2d<desc, execution_simdgroup> mm;
  auto ct_a = mm.get_left_input_cooperative_tensor<half, half, float>();
  auto ct_b = mm.get_right_input_cooperative_tensor<half, half, float>();
  auto ct_c = mm.get_destination_cooperative_tensor<decltype(ct_a), decltype(ct_b), float>();
  for (uint16_t i = 0; i < ct_a.get_capacity(); ++i) {
    if (!ct_a.is_valid_element(i)) continue;
    auto index = ct_a.get_multidimensional_index(i);
    ct_a[i] = a[index[1] * 16 + index[0]];
  }
  ct_b.load(tensor((device half*)b_t, extents<int32_t, 16, 16>()));
  for (uint16_t i = 0; i < ct_c.get_capacity(); ++i) {
    if (ct_c.is_valid_element(i)) ct_c[i] = 0.0f;
  }
  mm.run(ct_a, ct_b, ct_c);
  mm.run(ct_a, ct_b, ct_c);
  ct_c.store(tensor(c, extents<int32_t, 16, 16>()));
}
)";

TEST_F(TensorOps, CooperativeTensorOperandsFilledThroughTheirIndicesMultiply) {
  Matrix a = random_matrix("half", 16, 16), b_t = random_matrix("half", 16, 16), c("float", 256);
  const mfa::DispatchStats stats =
      run(pipeline(kCooperativeOperands, "cooperative_operands"), 32, [&](mfa::CommandBatch::DispatchRef& d) {
        d.host(0, a.bytes.data(), a.bytes.size(), false);
        d.host(1, b_t.bytes.data(), b_t.bytes.size(), false);
        d.host(2, c.bytes.data(), c.bytes.size(), true);
      });
  std::vector<double> expected = product(a.values, b_t.values, 16, 16, 16, false, true);
  for (double& e : expected) e *= 2;
  EXPECT_LT(relative_l2(c, expected), 1e-6);
  EXPECT_EQ(stats.simdgroup_matrix_ops.value(), 2u * 2 * 2 * 2);
}

// Attention's two products, as public MPP kernels chain them: S = Q K^T into
// a cooperative tensor, scaled in place, converted into the left operand of
// O = P V.
const char* kChained = R"(
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

kernel void chained(device const half* q [[buffer(0)]],
                    device const half* keys [[buffer(1)]],
                    device const half* values [[buffer(2)]],
                    device float* o [[buffer(3)]]) {
  auto tQ = tensor((device half*)q, extents<int32_t, 16, 16>());
  auto tK = tensor((device half*)keys, extents<int32_t, 16, 32>());
  auto tV = tensor((device half*)values, extents<int32_t, 16, 32>());
  matmul2d<matmul2d_descriptor(16, 32, 16, false, true, true), execution_simdgroup> mmS;
  matmul2d<matmul2d_descriptor(16, 16, 32, false, false, true), execution_simdgroup> mmO;
  auto S = mmS.get_destination_cooperative_tensor<decltype(tQ), decltype(tK), float>();
  mmS.run(tQ, tK, S);
  for (uint16_t i = 0; i < S.get_capacity(); ++i) {
    if (S.is_valid_element(i)) S[i] *= 0.5f;
  }
  auto P = mmO.get_left_input_cooperative_tensor<float, half, float>(S);
  auto O = mmO.get_destination_cooperative_tensor<decltype(P), decltype(tV), float>();
  mmO.run(P, tV, O);
  O.store(tensor(o, extents<int32_t, 16, 16>()));
}
)";

TEST_F(TensorOps, ADestinationConvertsIntoTheNextProductsLeftOperand) {
  Matrix q = random_matrix("half", 16, 16), keys = random_matrix("half", 32, 16);
  Matrix values = random_matrix("half", 32, 16), o("float", 256);
  run(pipeline(kChained, "chained"), 32, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, q.bytes.data(), q.bytes.size(), false);
    d.host(1, keys.bytes.data(), keys.bytes.size(), false);
    d.host(2, values.bytes.data(), values.bytes.size(), false);
    d.host(3, o.bytes.data(), o.bytes.size(), true);
  });
  std::vector<double> s = product(q.values, keys.values, 16, 32, 16, false, true);
  for (double& x : s) x *= 0.5;
  EXPECT_LT(relative_l2(o, product(s, values.values, 16, 16, 32)), 1e-6);
}

// Row maxima and sums and column sums of a destination cooperative tensor,
// into the op's reduction cooperative tensors, stored through tensors.
const char* kReductions = R"(
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

kernel void reductions(device const float* a [[buffer(0)]],
                       device const float* b_t [[buffer(1)]],
                       device float* row_max [[buffer(2)]],
                       device float* row_sum [[buffer(3)]],
                       device float* column_sum [[buffer(4)]]) {
  auto tA = tensor((device float*)a, extents<int32_t, 16, 16>());
  auto tB = tensor((device float*)b_t, extents<int32_t, 16, 32>());
  matmul2d<matmul2d_descriptor(16, 32, 16, false, true), execution_simdgroup> mm;
  auto S = mm.get_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  mm.run(tA, tB, S);
  auto maxima = mm.get_row_reduction_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  auto sums = mm.get_row_reduction_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  auto columns = mm.get_column_reduction_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  reduce_rows(S, maxima, reduction_operation::max, reduction_operation_identity<float>::max_identity);
  reduce_rows(S, sums);
  reduce_columns(S, columns, reduction_operation::sum, 0.0f);
  maxima.store(tensor(row_max, extents<int32_t, 1, 16>()));
  sums.store(tensor(row_sum, extents<int32_t, 1, 16>()));
  columns.store(tensor(column_sum, extents<int32_t, 32, 1>()));
}
)";

TEST_F(TensorOps, ReduceRowsAndColumnsFoldADestinationCooperativeTensor) {
  constexpr int m = 16, n = 32, k = 16;
  Matrix a = random_matrix("float", m, k), b_t = random_matrix("float", n, k);
  Matrix maxima("float", m), sums("float", m), columns("float", n);
  run(pipeline(kReductions, "reductions"), 32, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, a.bytes.data(), a.bytes.size(), false);
    d.host(1, b_t.bytes.data(), b_t.bytes.size(), false);
    d.host(2, maxima.bytes.data(), maxima.bytes.size(), true);
    d.host(3, sums.bytes.data(), sums.bytes.size(), true);
    d.host(4, columns.bytes.data(), columns.bytes.size(), true);
  });
  const std::vector<double> s = product(a.values, b_t.values, m, n, k, false, true);
  std::vector<double> expected_max(m, -INFINITY), expected_sum(m, 0.0), expected_columns(n, 0.0);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      expected_max[i] = std::max(expected_max[i], s[i * n + j]);
      expected_sum[i] += s[i * n + j];
      expected_columns[j] += s[i * n + j];
    }
  }
  EXPECT_LT(relative_l2(maxima, expected_max), 1e-6);
  EXPECT_LT(relative_l2(sums, expected_sum), 1e-5);
  EXPECT_LT(relative_l2(columns, expected_columns), 1e-5);
}

// Subtracts each row's maximum from S: through map_iterator when the row
// reduction's layout holds each thread's rows (is_iterator_compatible), else
// through threadgroup memory and get_multidimensional_index, as Apple's
// header says to fall back. MAP_ONLY skips the check.
const char* kRowBroadcast = R"(
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;
#ifndef MAP_ONLY
#define MAP_ONLY false
#endif

kernel void row_broadcast(device const float* a [[buffer(0)]],
                          device const float* b_t [[buffer(1)]],
                          device float* c [[buffer(2)]],
                          device int* compatible [[buffer(3)]],
                          uint lane [[thread_index_in_simdgroup]]) {
  auto tA = tensor((device float*)a, extents<int32_t, 16, 16>());
  auto tB = tensor((device float*)b_t, extents<int32_t, 16, 32>());
  matmul2d<matmul2d_descriptor(16, 32, 16, false, true), execution_simdgroup> mm;
  auto S = mm.get_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  mm.run(tA, tB, S);
  auto R = mm.get_row_reduction_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  reduce_rows(S, R, reduction_operation::max, reduction_operation_identity<float>::max_identity);
  threadgroup float row_max[16];
  const bool mapped = is_iterator_compatible(S, R);
  if (lane == 0) compatible[0] = mapped;
  if (mapped || MAP_ONLY) {
    for (auto it = S.begin(); it != S.end(); ++it) {
      if (S.is_valid_element(ushort(it - S.begin()))) *it -= *R.map_iterator(it);
    }
  } else {
    R.store(tensor(row_max, extents<int32_t, 1, 16>()));
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (uint16_t i = 0; i < S.get_capacity(); ++i) {
      if (S.is_valid_element(i)) S[i] -= row_max[S.get_multidimensional_index(i)[1]];
    }
  }
  // Another destination of the op has S's layout: its elements map one to one.
  auto product = mm.get_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  mm.run(tA, tB, product);
  const bool same_layout = is_iterator_compatible(product, S);
  if (lane == 0) compatible[1] = same_layout;
  if (same_layout) {
    for (auto it = product.begin(); it != product.end(); ++it) {
      if (product.is_valid_element(ushort(it - product.begin()))) *S.map_iterator(it) += *it;
    }
  }
  S.store(tensor(c, extents<int32_t, 32, 16>()));
}
)";

TEST_F(TensorOps, RowValuesReachTheirElementsThroughMapIteratorOrTheFallback) {
  constexpr int m = 16, n = 32, k = 16;
  Matrix a = random_matrix("float", m, k), b_t = random_matrix("float", n, k), c("float", m * n);
  std::vector<std::int32_t> compatible(2, -1);
  auto bind = [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, a.bytes.data(), a.bytes.size(), false);
    d.host(1, b_t.bytes.data(), b_t.bytes.size(), false);
    d.host(2, c.bytes.data(), c.bytes.size(), true);
    d.host(3, compatible.data(), compatible.size() * 4, true);
  };
  const std::vector<double> s = product(a.values, b_t.values, m, n, k, false, true);
  std::vector<double> expected(s.size());
  for (int i = 0; i < m; ++i) {
    const double row_max = *std::max_element(s.begin() + i * n, s.begin() + (i + 1) * n);
    for (int j = 0; j < n; ++j) expected[i * n + j] = 2 * s[i * n + j] - row_max;
  }
  run(pipeline(kRowBroadcast, "row_broadcast", true), 32, bind);
  EXPECT_LT(relative_l2(c, expected), 1e-6);
  EXPECT_EQ(compatible[1], 1);
  // Mapping without the check reaches end() where this thread holds no such row.
  const std::string message = failure_of(pipeline(kRowBroadcast, "row_broadcast", true, "", {{"MAP_ONLY", "1"}}), 32, bind);
  if (compatible[0] == 1) {
    EXPECT_EQ(message, "no error");
  } else {
    EXPECT_NE(message.find("cooperative tensor index"), std::string::npos) << message;
  }
}

// Reads a cooperative tensor's storage by lane, as if lane l held elements
// 2l and 2l + 1 of the 8x8 result: right for seed 0's layout only.
const char* kAssumesLayout = R"(
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

kernel void assumes_layout(device const float* a [[buffer(0)]],
                           device const float* b [[buffer(1)]],
                           device float* c [[buffer(2)]],
                           uint lane [[thread_index_in_simdgroup]]) {
  auto tA = tensor((device float*)a, extents<int32_t, 8, 8>());
  auto tB = tensor((device float*)b, extents<int32_t, 8, 8>());
  mpp::tensor_ops::matmul2d<mpp::tensor_ops::matmul2d_descriptor(8, 8, 8), execution_simdgroup> mm;
  auto cT = mm.get_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  mm.run(tA, tB, cT);
  c[2 * lane] = cT[0];
  c[2 * lane + 1] = cT[1];
}
)";

TEST_F(TensorOps, AKernelThatAssumesTheLayoutIsWrongUnderOtherSeeds) {
  Matrix a = random_matrix("float", 8, 8), b = random_matrix("float", 8, 8), c("float", 64);
  run(pipeline(kAssumesLayout, "assumes_layout"), 32, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, a.bytes.data(), a.bytes.size(), false);
    d.host(1, b.bytes.data(), b.bytes.size(), false);
    d.host(2, c.bytes.data(), c.bytes.size(), true);
  });
  const double error = relative_l2(c, product(a.values, b.values, 8, 8, 8));
  if (layout_seed() == 0) {
    EXPECT_LT(error, 1e-6);
  } else {
    EXPECT_FALSE(error < 1e-3) << "seed " << layout_seed() << " gave the layout the kernel assumes";
  }
}

// Reads one slot past a cooperative tensor's capacity.
const char* kPastCapacity = R"(
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

kernel void past_capacity(device const float* a [[buffer(0)]],
                          device float* c [[buffer(1)]],
                          uint lane [[thread_index_in_simdgroup]]) {
  auto tA = tensor((device float*)a, extents<int32_t, 8, 8>());
  mpp::tensor_ops::matmul2d<mpp::tensor_ops::matmul2d_descriptor(8, 8), execution_simdgroup> mm;
  auto cT = mm.get_destination_cooperative_tensor<decltype(tA), decltype(tA), float>();
  mm.run(tA, tA, cT);
  c[lane] = cT[cT.get_capacity()];
}
)";

TEST_F(TensorOps, ACooperativeTensorIndexPastItsCapacityFailsTheBoundsCheck) {
  std::vector<float> a(64, 1.0f), c(32, 0.0f);
  const std::string message =
      failure_of(pipeline(kPastCapacity, "past_capacity", true), 32, [&](mfa::CommandBatch::DispatchRef& d) {
        d.host(0, a.data(), a.size() * 4, false);
        d.host(1, c.data(), c.size() * 4, true);
      });
  EXPECT_NE(message.find("cooperative tensor index"), std::string::npos) << message;
}

// Threads that skip run, or reach it at different places, fail the dispatch.
const char* kPartialRun = R"(
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

kernel void partial_run(device const float* a [[buffer(0)]],
                        device float* c [[buffer(1)]],
                        uint tid [[thread_index_in_threadgroup]]) {
  auto tA = tensor((device float*)a, extents<int32_t, 8, 8>());
  auto tC = tensor(c, extents<int32_t, 8, 8>());
  mpp::tensor_ops::matmul2d<mpp::tensor_ops::matmul2d_descriptor(8, 8, 8), execution_simdgroups<$N>> mm;
  if (tid < 40) {
    mm.run(tA, tA, tC);
  } else if ($OTHERS_RUN) {
    mm.run(tA, tA, tC);
  }
}
)";

TEST_F(TensorOps, AMissingOrDivergentParticipantIsADispatchError) {
  std::vector<float> a(64, 1.0f), c(64, 0.0f);
  auto bind = [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, a.data(), a.size() * 4, false);
    d.host(1, c.data(), c.size() * 4, true);
  };
  const std::string missing =
      failure_of(pipeline(substitute(substitute(kPartialRun, "$N", "2"), "$OTHERS_RUN", "false"), "partial_run"), 64, bind);
  EXPECT_NE(missing.find("matmul2d::run"), std::string::npos) << missing;
  const std::string divergent =
      failure_of(pipeline(substitute(substitute(kPartialRun, "$N", "1"), "$OTHERS_RUN", "true"), "partial_run"), 64, bind);
  EXPECT_NE(divergent.find("matmul2d::run"), std::string::npos) << divergent;
}

}  // namespace
