// The shim's SIMD-group functions, barriers, simdgroup_matrix and atomics,
// run as MSL kernels on the cpu device (front end, compiler, executor) and
// checked against scalar references computed here. Inputs are fresh random
// values on a grid that makes every sum exact in every element type, so the
// references do not depend on the order of the GPU's reductions.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
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

// --- host-side element types --------------------------------------------------

enum class Kind { f32, f16, bf16, i32, u32 };

struct ScalarType {
  const char* name;
  Kind kind;
  std::size_t bytes;
};
constexpr ScalarType kFloat{"float", Kind::f32, 4};
constexpr ScalarType kHalf{"half", Kind::f16, 2};
constexpr ScalarType kBfloat{"bfloat", Kind::bf16, 2};
constexpr ScalarType kInt{"int", Kind::i32, 4};
constexpr ScalarType kUint{"uint", Kind::u32, 4};

bool is_integer(Kind kind) { return kind == Kind::i32 || kind == Kind::u32; }

struct VectorType {
  ScalarType scalar;
  int components;  // 1 for a scalar
  std::string name() const {
    return scalar.name + (components > 1 ? std::to_string(components) : std::string());
  }
  std::size_t stride() const { return (components == 3 ? 4 : components) * scalar.bytes; }
};

std::uint16_t bfloat_bits(float value) {  // round to nearest even
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

float from_bfloat_bits(std::uint16_t raw) {
  const std::uint32_t bits = std::uint32_t(raw) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// A device buffer of `count` elements of one MSL type, read and written as
// doubles. Starts poisoned (all bits set: NaN, or -1).
class Values {
 public:
  Values(VectorType type, std::size_t count) : type_(type), bytes_(count * type.stride(), 0xff) {}

  double get(std::size_t i, int component) const {
    const unsigned char* p = at(i, component);
    switch (type_.scalar.kind) {
      case Kind::f32: return load<float>(p);
      case Kind::f16: return static_cast<double>(load<_Float16>(p));
      case Kind::bf16: return from_bfloat_bits(load<std::uint16_t>(p));
      case Kind::i32: return load<std::int32_t>(p);
      case Kind::u32: return load<std::uint32_t>(p);
    }
    return NAN;
  }

  // Stores `value` rounded to the element type; returns what was stored.
  double set(std::size_t i, int component, double value) {
    unsigned char* p = at(i, component);
    switch (type_.scalar.kind) {
      case Kind::f32: store(p, static_cast<float>(value)); break;
      case Kind::f16: store(p, static_cast<_Float16>(value)); break;
      case Kind::bf16: store(p, bfloat_bits(static_cast<float>(value))); break;
      case Kind::i32: store(p, static_cast<std::int32_t>(value)); break;
      case Kind::u32: store(p, static_cast<std::uint32_t>(value)); break;
    }
    return get(i, component);
  }

  void* data() { return bytes_.data(); }
  std::size_t bytes() const { return bytes_.size(); }

  // `value` rounded to a scalar type, and that type's unit in the last place at `magnitude`.
  static double round(ScalarType type, double value) { return Values({type, 1}, 1).set(0, 0, value); }
  static double ulp(ScalarType type, double magnitude) {
    const int digits = type.kind == Kind::f32 ? 24 : type.kind == Kind::f16 ? 11 : 8;
    return std::ldexp(1.0, std::max(std::ilogb(std::max(magnitude, 0x1p-14)), -14) - (digits - 1));
  }

 private:
  template <class T>
  static T load(const unsigned char* p) {
    T value;
    std::memcpy(&value, p, sizeof value);
    return value;
  }
  template <class T>
  static void store(unsigned char* p, T value) {
    std::memcpy(p, &value, sizeof value);
  }
  unsigned char* at(std::size_t i, int component) {
    return bytes_.data() + i * type_.stride() + component * type_.scalar.bytes;
  }
  const unsigned char* at(std::size_t i, int component) const {
    return bytes_.data() + i * type_.stride() + component * type_.scalar.bytes;
  }

  VectorType type_;
  std::vector<unsigned char> bytes_;
};

std::string substitute(std::string text, const std::string& placeholder, const std::string& value) {
  for (std::size_t at = text.find(placeholder); at != std::string::npos;
       at = text.find(placeholder, at + value.size())) {
    text.replace(at, placeholder.size(), value);
  }
  return text;
}

// The GPU threads of thread i's simdgroup: [first, last).
struct Simdgroup {
  std::size_t first, last;
};
Simdgroup simdgroup_of(std::size_t i, std::size_t threads_per_group) {
  const std::size_t group_start = i / threads_per_group * threads_per_group;
  const std::size_t first = group_start + (i - group_start) / 32 * 32;
  return {first, std::min(first + 32, group_start + threads_per_group)};
}

// Matrix lane layout (ARCHITECTURE.md): lane l holds row (l / 16) * 4 + (l / 2) % 4,
// columns c and c + 1 with c = ((l / 4) & 2) * 2 + (l % 2) * 2.
unsigned layout_row(unsigned lane) { return (lane / 16) * 4 + (lane / 2) % 4; }
unsigned layout_column(unsigned lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

class SimdKernelTest : public ::testing::Test {
 protected:
  SimdKernelTest() : seed_(std::random_device{}()), random_(seed_) {}

  std::string trace() const { return "seed " + std::to_string(seed_); }
  int integer(int low, int high) { return std::uniform_int_distribution<int>(low, high)(random_); }
  // Multiples of 1/4 in [-1, 1] (floating types) or integers in [low, high]:
  // every sum of 32 of them is exact, even in bfloat.
  double grid_value(Kind kind) {
    return is_integer(kind) ? integer(kind == Kind::u32 ? 0 : -1000, 1000) : integer(-4, 4) / 4.0;
  }
  // Values that differ from lane to lane (rounded to the element type on store).
  double distinct_value(Kind kind) {
    return is_integer(kind) ? integer(kind == Kind::u32 ? 0 : -100000, 100000) : uniform(-100, 100);
  }
  double uniform(double low, double high) { return std::uniform_real_distribution<double>(low, high)(random_); }
  template <class T>
  const T& pick(const std::vector<T>& choices) {
    return choices[std::uniform_int_distribution<std::size_t>(0, choices.size() - 1)(random_)];
  }

  std::shared_ptr<const mfa::Pipeline> pipeline(const std::string& source, const std::string& name,
                                                bool bounds_check = false, const std::string& sanitize = "",
                                                const mfa::FunctionConstants& constants = {}) {
    mfa::CompileOptions options;
    options.bounds_check = bounds_check;
    options.sanitize = sanitize;
    return device_.pipeline(source, name, constants, options);
  }

  // Runs one dispatch; `bind` binds its buffers.
  mfa::DispatchStats run(const std::shared_ptr<const mfa::Pipeline>& pipeline, std::uint32_t groups,
                         std::uint32_t threads,
                         const std::function<void(mfa::CommandBatch::DispatchRef&)>& bind) {
    mfa::CommandBatch batch(device_);
    mfa::CommandBatch::DispatchRef dispatch = batch.dispatch(pipeline, {groups}, {threads});
    bind(dispatch);
    std::vector<mfa::DispatchStats> stats = batch.run();
    return stats.at(0);
  }

  // The DispatchError message of a dispatch that must fail.
  std::string failure_of(const std::shared_ptr<const mfa::Pipeline>& pipeline, std::uint32_t groups,
                         std::uint32_t threads,
                         const std::function<void(mfa::CommandBatch::DispatchRef&)>& bind) {
    try {
      run(pipeline, groups, threads, bind);
    } catch (const mfa::DispatchError& e) {
      return e.what();
    }
    return "no error";
  }

  mfa::Device device_ = mfa::Device::get(mfa::DeviceKind::cpu);

 private:
  unsigned seed_;
  std::mt19937 random_;
};

// --- reductions and scans ---------------------------------------------------------

const char* kReduce = R"(
#include <metal_stdlib>
using namespace metal;
kernel void reduce(device const $T* in [[buffer(0)]],
                   device const $T* factors [[buffer(1)]],
                   device $T* out [[buffer(2)]],
                   uint i [[thread_position_in_grid]]) {
  const $T x = in[i];
  out[6 * i + 0] = simd_sum(x);
  out[6 * i + 1] = simd_product(factors[i]);
  out[6 * i + 2] = simd_max(x);
  out[6 * i + 3] = simd_min(x);
  out[6 * i + 4] = simd_prefix_inclusive_sum(x);
  out[6 * i + 5] = simd_prefix_exclusive_sum(x);
}
)";

TEST_F(SimdKernelTest, ReductionsAndPrefixSumsCoverTheActiveLanes) {
  // 48 threads per group: one full simdgroup and one of 16 lanes.
  const std::uint32_t groups = 2, threads = 48, n = groups * threads;
  const VectorType types[] = {{kFloat, 1}, {kHalf, 1}, {kBfloat, 1}, {kInt, 1}, {kUint, 1},
                              {kFloat, 4}, {kHalf, 2}, {kInt, 3}};
  for (const VectorType& type : types) {
    SCOPED_TRACE(type.name() + ", " + trace());
    const Kind kind = type.scalar.kind;
    // Products stay exact: powers of two for float, signs for the narrow and
    // signed types, small factors (wrapping mod 2^32) for uint.
    const std::vector<double> factors_for_kind =
        kind == Kind::f32 ? std::vector<double>{0.5, 1, 2, -1}
        : kind == Kind::u32 ? std::vector<double>{1, 3, 5}
                            : std::vector<double>{1, -1};
    Values in(type, n), factors(type, n), out(type, 6 * n);
    for (std::size_t i = 0; i < n; ++i) {
      for (int c = 0; c < type.components; ++c) {
        in.set(i, c, grid_value(kind));
        factors.set(i, c, pick(factors_for_kind));
      }
    }
    run(pipeline(substitute(kReduce, "$T", type.name()), "reduce"), groups, threads,
        [&](mfa::CommandBatch::DispatchRef& d) {
          d.host(0, in.data(), in.bytes(), false)
              .host(1, factors.data(), factors.bytes(), false)
              .host(2, out.data(), out.bytes(), true);
        });
    for (std::size_t i = 0; i < n; ++i) {
      const Simdgroup lanes = simdgroup_of(i, threads);
      for (int c = 0; c < type.components; ++c) {
        double sum = 0, product = 1, largest = -INFINITY, smallest = INFINITY, before = 0;
        for (std::size_t l = lanes.first; l < lanes.last; ++l) {
          sum += in.get(l, c);
          product = std::fmod(product * factors.get(l, c), 4294967296.0);
          largest = std::max(largest, in.get(l, c));
          smallest = std::min(smallest, in.get(l, c));
          if (l < i) before += in.get(l, c);
        }
        ASSERT_EQ(out.get(6 * i + 0, c), sum) << "simd_sum, thread " << i;
        ASSERT_EQ(out.get(6 * i + 1, c), product) << "simd_product, thread " << i;
        ASSERT_EQ(out.get(6 * i + 2, c), largest) << "simd_max, thread " << i;
        ASSERT_EQ(out.get(6 * i + 3, c), smallest) << "simd_min, thread " << i;
        ASSERT_EQ(out.get(6 * i + 4, c), before + in.get(i, c)) << "simd_prefix_inclusive_sum, thread " << i;
        ASSERT_EQ(out.get(6 * i + 5, c), before) << "simd_prefix_exclusive_sum, thread " << i;
      }
    }
  }
}

const char* kBitwise = R"(
#include <metal_stdlib>
using namespace metal;
kernel void bitwise(device const $T* in [[buffer(0)]],
                    device $T* out [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  out[3 * i + 0] = simd_and(in[i]);
  out[3 * i + 1] = simd_or(in[i]);
  out[3 * i + 2] = simd_xor(in[i]);
}
)";

TEST_F(SimdKernelTest, BitwiseReductions) {
  const std::uint32_t groups = 3, threads = 40, n = groups * threads;
  for (const VectorType& type : {VectorType{kUint, 1}, VectorType{kInt, 2}}) {
    SCOPED_TRACE(type.name() + ", " + trace());
    Values in(type, n), out(type, 3 * n);
    std::vector<std::int64_t> bits(n * type.components);
    for (std::size_t i = 0; i < n; ++i) {
      for (int c = 0; c < type.components; ++c) {
        bits[i * type.components + c] = static_cast<std::int64_t>(in.set(i, c, integer(0, 1 << 30)));
      }
    }
    run(pipeline(substitute(kBitwise, "$T", type.name()), "bitwise"), groups, threads,
        [&](mfa::CommandBatch::DispatchRef& d) {
          d.host(0, in.data(), in.bytes(), false).host(1, out.data(), out.bytes(), true);
        });
    for (std::size_t i = 0; i < n; ++i) {
      const Simdgroup lanes = simdgroup_of(i, threads);
      for (int c = 0; c < type.components; ++c) {
        std::int64_t all = (std::int64_t(1) << 31) - 1, any = 0, parity = 0;
        for (std::size_t l = lanes.first; l < lanes.last; ++l) {
          all &= bits[l * type.components + c];
          any |= bits[l * type.components + c];
          parity ^= bits[l * type.components + c];
        }
        ASSERT_EQ(out.get(3 * i + 0, c), double(all)) << "simd_and, thread " << i;
        ASSERT_EQ(out.get(3 * i + 1, c), double(any)) << "simd_or, thread " << i;
        ASSERT_EQ(out.get(3 * i + 2, c), double(parity)) << "simd_xor, thread " << i;
      }
    }
  }
}

// --- shuffles ---------------------------------------------------------------------

const char* kShuffle = R"(
#include <metal_stdlib>
using namespace metal;
struct Shuffle { ushort mask; ushort up; ushort down; ushort lane; };
kernel void shuffle(device const $T* in [[buffer(0)]],
                    device const ushort* sources [[buffer(1)]],
                    constant Shuffle& p [[buffer(2)]],
                    device $T* out [[buffer(3)]],
                    uint i [[thread_position_in_grid]]) {
  const $T x = in[i];
  out[5 * i + 0] = simd_shuffle(x, sources[i]);
  out[5 * i + 1] = simd_shuffle_xor(x, p.mask);
  out[5 * i + 2] = simd_shuffle_up(x, p.up);
  out[5 * i + 3] = simd_shuffle_down(x, p.down);
  out[5 * i + 4] = simd_broadcast(x, p.lane);
}
)";

TEST_F(SimdKernelTest, ShufflesReadTheirSourceLanes) {
  struct Shuffle {
    std::uint16_t mask, up, down, lane;
  };
  const VectorType types[] = {{kFloat, 1}, {kHalf, 1}, {kBfloat, 1}, {kInt, 1}, {kUint, 1},
                              {kFloat, 4}, {kHalf, 4}, {kUint, 2}};
  for (const VectorType& type : types) {
    // Full simdgroups; then one of 16 lanes, whose sources stay inside it
    // (down by 32 or more: every lane keeps its own value).
    for (const std::uint32_t threads : {64u, 48u}) {
      SCOPED_TRACE(type.name() + ", " + std::to_string(threads) + " threads, " + trace());
      const std::uint32_t groups = 2, n = groups * threads;
      const bool partial = threads % 32 != 0;
      const int width = partial ? 16 : 32;
      const Shuffle p{std::uint16_t(integer(1, width - 1)), std::uint16_t(integer(1, 31)),
                      std::uint16_t(partial ? integer(32, 100) : integer(1, 31)),
                      std::uint16_t(integer(0, width - 1))};
      Values in(type, n), out(type, 5 * n);
      std::vector<std::uint16_t> sources(n);
      for (std::size_t i = 0; i < n; ++i) {
        const Simdgroup lanes = simdgroup_of(i, threads);
        sources[i] = std::uint16_t(integer(0, int(lanes.last - lanes.first) - 1));
        for (int c = 0; c < type.components; ++c) in.set(i, c, distinct_value(type.scalar.kind));
      }
      run(pipeline(substitute(kShuffle, "$T", type.name()), "shuffle"), groups, threads,
          [&](mfa::CommandBatch::DispatchRef& d) {
            d.host(0, in.data(), in.bytes(), false)
                .host(1, sources.data(), sources.size() * 2, false)
                .bytes(2, &p, sizeof p)
                .host(3, out.data(), out.bytes(), true);
          });
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t first = simdgroup_of(i, threads).first, lane = i - first;
        const std::size_t up = lane >= p.up ? i - p.up : i;
        const std::size_t down = lane + p.down < 32 ? i + p.down : i;
        for (int c = 0; c < type.components; ++c) {
          ASSERT_EQ(out.get(5 * i + 0, c), in.get(first + sources[i], c)) << "simd_shuffle, thread " << i;
          ASSERT_EQ(out.get(5 * i + 1, c), in.get(first + (lane ^ p.mask), c)) << "simd_shuffle_xor, thread " << i;
          ASSERT_EQ(out.get(5 * i + 2, c), in.get(up, c)) << "simd_shuffle_up, thread " << i;
          ASSERT_EQ(out.get(5 * i + 3, c), in.get(down, c)) << "simd_shuffle_down, thread " << i;
          ASSERT_EQ(out.get(5 * i + 4, c), in.get(first + p.lane, c)) << "simd_broadcast, thread " << i;
        }
      }
    }
  }
}

const char* kReadInactiveLane = R"(
#include <metal_stdlib>
using namespace metal;
kernel void read_inactive(device float* out [[buffer(0)]],
                          uint i [[thread_position_in_grid]]) {
  out[i] = simd_shuffle_down(float(i), 4);
}
)";

TEST_F(SimdKernelTest, ShuffleFromAnInactiveLaneFailsTheDispatch) {
  std::vector<float> out(20);
  const std::string message =
      failure_of(pipeline(kReadInactiveLane, "read_inactive"), 1, 20, [&](mfa::CommandBatch::DispatchRef& d) {
        d.host(0, out.data(), out.size() * 4, true);
      });
  EXPECT_NE(message.find("simd_shuffle_down"), std::string::npos) << message;
  EXPECT_NE(message.find("lane 16 reads lane 20, which is not an active lane"), std::string::npos) << message;
}

// --- votes --------------------------------------------------------------------------

const char* kVote = R"(
#include <metal_stdlib>
using namespace metal;
kernel void vote(device const int* in [[buffer(0)]],
                 device uint* out [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
  const bool p = in[i] > 0;
  out[4 * i + 0] = uint((simd_vote::vote_t)simd_ballot(p));
  out[4 * i + 1] = simd_all(p) ? 1u : 0u;
  out[4 * i + 2] = simd_any(p) ? 1u : 0u;
  out[4 * i + 3] = uint((simd_vote::vote_t)simd_active_threads_mask());
}
)";

TEST_F(SimdKernelTest, BallotAllAnyAndActiveMask) {
  SCOPED_TRACE(trace());
  // Simdgroup s votes all false, all true or at random (s % 3), full and partial.
  const std::uint32_t groups = 3, threads = 48, n = groups * threads;
  std::vector<std::int32_t> in(n);
  std::vector<std::uint32_t> out(4 * n, 0xdeadbeef);
  std::size_t simdgroup = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (i > 0 && simdgroup_of(i, threads).first == i) ++simdgroup;
    in[i] = simdgroup % 3 == 0 ? -integer(0, 5) : simdgroup % 3 == 1 ? integer(1, 5) : integer(-5, 5);
  }
  run(pipeline(kVote, "vote"), groups, threads, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, in.data(), in.size() * 4, false).host(1, out.data(), out.size() * 4, true);
  });
  for (std::size_t i = 0; i < n; ++i) {
    const Simdgroup lanes = simdgroup_of(i, threads);
    std::uint32_t votes = 0, active = 0;
    for (std::size_t l = lanes.first; l < lanes.last; ++l) {
      active |= 1u << (l - lanes.first);
      if (in[l] > 0) votes |= 1u << (l - lanes.first);
    }
    ASSERT_EQ(out[4 * i + 0], votes) << "simd_ballot, thread " << i;
    ASSERT_EQ(out[4 * i + 1], votes == active ? 1u : 0u) << "simd_all, thread " << i;
    ASSERT_EQ(out[4 * i + 2], votes != 0 ? 1u : 0u) << "simd_any, thread " << i;
    ASSERT_EQ(out[4 * i + 3], active) << "simd_active_threads_mask, thread " << i;
  }
}

// --- barriers -----------------------------------------------------------------------

// Each round passes every value to the neighbouring thread through
// threadgroup memory (fibers run one at a time: without the barriers a
// thread reads its neighbour's slot before the neighbour writes it).
const char* kRotate = R"(
#include <metal_stdlib>
using namespace metal;
kernel void rotate(device const float* in [[buffer(0)]],
                   device float* out [[buffer(1)]],
                   threadgroup float* pairs [[threadgroup(0)]],
                   uint t [[thread_index_in_threadgroup]],
                   uint g [[threadgroup_position_in_grid]],
                   uint n [[threads_per_threadgroup]]) {
  threadgroup float ring[256];
  float value = in[g * n + t];
  for (uint round = 0; round < 5; ++round) {
    ring[t] = value;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    value = ring[(t + 1) % n] + 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  pairs[t] = value;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  out[g * n + t] = pairs[t ^ 1];
}
)";

TEST_F(SimdKernelTest, BarriersOrderThreadgroupMemory) {
  SCOPED_TRACE(trace());
  const std::uint32_t groups = 3, threads = 96, n = groups * threads;
  std::vector<float> in(n), out(n, NAN);
  for (float& x : in) x = float(integer(-1000, 1000));
  const mfa::DispatchStats stats =
      run(pipeline(kRotate, "rotate"), groups, threads, [&](mfa::CommandBatch::DispatchRef& d) {
        d.host(0, in.data(), n * 4, false).host(1, out.data(), n * 4, true).threadgroup_memory(0, threads * 4);
      });
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t group = i / threads, partner = (i % threads) ^ 1;
    ASSERT_EQ(out[i], in[group * threads + (partner + 5) % threads] + 5.0f) << "thread " << i;
  }
  if (stats.barriers) {
    EXPECT_EQ(*stats.barriers, 10u * groups);
  }
}

// --- simdgroup_matrix -------------------------------------------------------------

const char* kLayout = R"(
#include <metal_stdlib>
using namespace metal;
kernel void layout(device const float* in [[buffer(0)]],
                   device float* elements [[buffer(1)]],
                   device float* stored [[buffer(2)]],
                   ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, in, 8);
  elements[2 * lane] = m.thread_elements()[0];
  elements[2 * lane + 1] = m.thread_elements()[1];
  m.thread_elements() = float2(2 * lane, 2 * lane + 1);
  simdgroup_store(m, stored, 8);
}
)";

TEST_F(SimdKernelTest, MatrixLaneLayoutIsApples) {
  SCOPED_TRACE(trace());
  std::vector<float> in(64), elements(64, NAN), stored(64, NAN);
  for (float& x : in) x = float(integer(-1000, 1000));
  run(pipeline(kLayout, "layout"), 1, 32, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, in.data(), 256, false).host(1, elements.data(), 256, true).host(2, stored.data(), 256, true);
  });
  for (unsigned lane = 0; lane < 32; ++lane) {
    for (unsigned j = 0; j < 2; ++j) {
      const unsigned index = layout_row(lane) * 8 + layout_column(lane) + j;
      EXPECT_EQ(elements[2 * lane + j], in[index]) << "lane " << lane;
      EXPECT_EQ(stored[index], float(2 * lane + j)) << "lane " << lane;
    }
  }
}

const char* kViews = R"(
#include <metal_stdlib>
using namespace metal;
// view: matrix origin (x = column, y = row), elements per row, transpose.
kernel void views(device const float* in [[buffer(0)]],
                  device float* loaded [[buffer(1)]],
                  device float* stored [[buffer(2)]],
                  constant uint4& view [[buffer(3)]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, in, view.z, ulong2(view.x, view.y), view.w != 0);
  simdgroup_store(m, loaded, 8);
  simdgroup_load(m, in, 8);
  simdgroup_store(m, stored, view.z, ulong2(view.x, view.y), view.w != 0);
}
)";

TEST_F(SimdKernelTest, MatrixLoadAndStoreHonourOriginStrideAndTranspose) {
  const std::uint32_t width = 20, height = 18;
  for (const bool transpose : {false, true}) {
    SCOPED_TRACE(std::string(transpose ? "transposed, " : "") + trace());
    const std::uint32_t view[4] = {std::uint32_t(integer(0, 10)), std::uint32_t(integer(0, 10)), width,
                                   transpose};
    std::vector<float> in(width * height), loaded(64, NAN), stored(width * height, NAN);
    for (float& x : in) x = float(integer(-1000, 1000));
    run(pipeline(kViews, "views"), 1, 32, [&](mfa::CommandBatch::DispatchRef& d) {
      d.host(0, in.data(), in.size() * 4, false)
          .host(1, loaded.data(), 256, true)
          .host(2, stored.data(), stored.size() * 4, true)
          .bytes(3, view, sizeof view);
    });
    // Element (r, c) of the matrix is at memory row origin.y + r, column
    // origin.x + c; transposed, at memory row origin.x + c, column origin.y + r.
    for (std::uint32_t r = 0; r < 8; ++r) {
      for (std::uint32_t c = 0; c < 8; ++c) {
        const std::uint32_t at = transpose ? (view[0] + c) * width + view[1] + r
                                           : (view[1] + r) * width + view[0] + c;
        EXPECT_EQ(loaded[r * 8 + c], in[at]) << r << ", " << c;
        EXPECT_EQ(stored[at], in[r * 8 + c]) << r << ", " << c;
      }
    }
  }
}

// D = A (8x16) * B (16x8, stored transposed) + C in two 8x8x8 steps, one
// simdgroup per threadgroup, in the given element types.
const char* kMultiplyAccumulate = R"(
#include <metal_stdlib>
using namespace metal;
kernel void mma(device const $A* a [[buffer(0)]],
                device const $B* b [[buffer(1)]],
                device const $C* c [[buffer(2)]],
                device $D* d [[buffer(3)]],
                uint g [[threadgroup_position_in_grid]]) {
  simdgroup_matrix<$A, 8, 8> left;
  simdgroup_matrix<$B, 8, 8> right;
  simdgroup_matrix<$C, 8, 8> bias;
  simdgroup_matrix<$D, 8, 8> sum;
  simdgroup_load(bias, c + 64 * g, 8);
  for (uint k = 0; k < 16; k += 8) {
    simdgroup_load(left, a + 128 * g, 16, ulong2(k, 0));
    simdgroup_load(right, b + 128 * g, 16, ulong2(0, k), true);
    if (k == 0) {
      simdgroup_multiply_accumulate(sum, left, right, bias);
    } else {
      simdgroup_multiply_accumulate(sum, left, right, sum);
    }
  }
  simdgroup_store(sum, d + 64 * g, 8);
}
)";

TEST_F(SimdKernelTest, MultiplyAccumulateInMixedTypes) {
  struct Case {
    ScalarType d, a, b, c;
  };
  const Case cases[] = {{kFloat, kFloat, kFloat, kFloat},
                        {kFloat, kHalf, kHalf, kFloat},
                        {kHalf, kHalf, kHalf, kHalf},
                        {kFloat, kBfloat, kBfloat, kFloat},
                        {kBfloat, kBfloat, kFloat, kHalf}};
  const std::uint32_t groups = 3;
  for (const Case& t : cases) {
    std::string source = kMultiplyAccumulate;
    for (const auto& [placeholder, type] : {std::pair{"$A", t.a}, {"$B", t.b}, {"$C", t.c}, {"$D", t.d}}) {
      source = substitute(source, placeholder, type.name);
    }
    SCOPED_TRACE(std::string("D ") + t.d.name + " = A " + t.a.name + " * B " + t.b.name + " + C " + t.c.name +
                 ", " + trace());
    Values a({t.a, 1}, 128 * groups), b({t.b, 1}, 128 * groups), c({t.c, 1}, 64 * groups), d({t.d, 1}, 64 * groups);
    for (std::size_t i = 0; i < 128 * groups; ++i) {
      a.set(i, 0, uniform(-1, 1));
      b.set(i, 0, uniform(-1, 1));
      if (i < 64 * groups) c.set(i, 0, uniform(-1, 1));
    }
    const mfa::DispatchStats stats =
        run(pipeline(source, "mma"), groups, 32, [&](mfa::CommandBatch::DispatchRef& ref) {
          ref.host(0, a.data(), a.bytes(), false)
              .host(1, b.data(), b.bytes(), false)
              .host(2, c.data(), c.bytes(), false)
              .host(3, d.data(), d.bytes(), true);
        });
    // Each product runs in float and is rounded to D's type: the first
    // (k < 8) and the final sum. Float's own error is far below D's ulp,
    // but may tip either rounding by one ulp.
    for (std::size_t g = 0; g < groups; ++g) {
      for (std::size_t row = 0; row < 8; ++row) {
        for (std::size_t column = 0; column < 8; ++column) {
          double partial = c.get(64 * g + row * 8 + column, 0), rest = 0;
          for (std::size_t k = 0; k < 16; ++k) {
            const double term = a.get(128 * g + row * 16 + k, 0) * b.get(128 * g + column * 16 + k, 0);
            (k < 8 ? partial : rest) += term;
          }
          partial = Values::round(t.d, partial);
          const double expected = Values::round(t.d, partial + rest);
          const double tolerance =
              Values::ulp(t.d, std::max(std::fabs(partial), std::fabs(expected))) + 1e-5 * (1 + std::fabs(expected));
          ASSERT_NEAR(d.get(64 * g + row * 8 + column, 0), expected, tolerance)
              << "group " << g << ", element " << row << ", " << column;
        }
      }
    }
    if (stats.simdgroup_matrix_ops) {
      EXPECT_EQ(*stats.simdgroup_matrix_ops, 2u * groups);
    }
  }
}

const char* kMultiply = R"(
#include <metal_stdlib>
using namespace metal;
kernel void multiply(device const float* a [[buffer(0)]],
                     device float* doubled [[buffer(1)]],
                     device float* row_sums [[buffer(2)]]) {
  simdgroup_float8x8 left, product;
  simdgroup_load(left, a, 8);
  simdgroup_multiply(product, left, simdgroup_float8x8(2.0f));  // a diagonal matrix
  simdgroup_store(product, doubled, 8);
  simdgroup_multiply(product, left, make_filled_simdgroup_matrix<float, 8, 8>(1.0f));
  simdgroup_store(product, row_sums, 8);
}
)";

TEST_F(SimdKernelTest, MultiplyWithDiagonalAndFilledMatrices) {
  SCOPED_TRACE(trace());
  std::vector<float> a(64), doubled(64, NAN), row_sums(64, NAN);
  for (float& x : a) x = float(integer(-1000, 1000)) / 8;
  const mfa::DispatchStats stats = run(pipeline(kMultiply, "multiply"), 1, 32, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, a.data(), 256, false).host(1, doubled.data(), 256, true).host(2, row_sums.data(), 256, true);
  });
  for (std::size_t row = 0; row < 8; ++row) {
    float sum = 0;
    for (std::size_t k = 0; k < 8; ++k) sum += a[row * 8 + k];
    for (std::size_t column = 0; column < 8; ++column) {
      EXPECT_EQ(doubled[row * 8 + column], 2 * a[row * 8 + column]);
      EXPECT_EQ(row_sums[row * 8 + column], sum);
    }
  }
  if (stats.simdgroup_matrix_ops) {
    EXPECT_EQ(*stats.simdgroup_matrix_ops, 2u);
  }
}

const char* kMatrixInPartialSimdgroup = R"(
#include <metal_stdlib>
using namespace metal;
kernel void partial(device float* out [[buffer(0)]], ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_multiply(m, m, m);
  out[lane] = m.thread_elements()[0];
}
)";

TEST_F(SimdKernelTest, MatrixMultiplyNeedsAFullSimdgroup) {
  std::vector<float> out(24);
  const std::string message = failure_of(pipeline(kMatrixInPartialSimdgroup, "partial"), 1, 24,
                                         [&](mfa::CommandBatch::DispatchRef& d) {
                                           d.host(0, out.data(), out.size() * 4, true);
                                         });
  EXPECT_NE(message.find("simdgroup_multiply"), std::string::npos) << message;
}

// --- atomics --------------------------------------------------------------------------

const char* kAtomics = R"(
#include <metal_stdlib>
using namespace metal;
kernel void atomics(device atomic_uint* count [[buffer(0)]],
                    device atomic_float* total [[buffer(1)]],
                    device atomic_int* largest [[buffer(2)]],
                    device const float* values [[buffer(3)]],
                    device uint* per_group [[buffer(4)]],
                    uint i [[thread_position_in_grid]],
                    uint t [[thread_index_in_threadgroup]],
                    uint g [[threadgroup_position_in_grid]]) {
  threadgroup atomic_uint local;
  if (t == 0) atomic_store_explicit(&local, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(count, 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(total, values[i], memory_order_relaxed);
  atomic_fetch_max_explicit(largest, int(values[i] * 4.0f), memory_order_relaxed);
  atomic_fetch_add_explicit(&local, t, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t == 0) per_group[g] = atomic_load_explicit(&local, memory_order_relaxed);
}
)";

TEST_F(SimdKernelTest, AtomicsAcrossParallelThreadgroups) {
  SCOPED_TRACE(trace());
  const std::uint32_t groups = 16, threads = 64, n = groups * threads;
  std::vector<float> values(n);
  for (float& x : values) x = float(integer(0, 400)) / 4;  // sums exact in any order
  std::uint32_t count = 0;
  float total = 0;
  std::int32_t largest = -1;
  std::vector<std::uint32_t> per_group(groups, 0);
  run(pipeline(kAtomics, "atomics"), groups, threads, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, &count, 4, true)
        .host(1, &total, 4, true)
        .host(2, &largest, 4, true)
        .host(3, values.data(), n * 4, false)
        .host(4, per_group.data(), groups * 4, true);
  });
  double expected_total = 0;
  for (float x : values) expected_total += x;
  EXPECT_EQ(count, n);
  EXPECT_EQ(total, expected_total);
  EXPECT_EQ(largest, std::int32_t(*std::max_element(values.begin(), values.end()) * 4));
  for (std::uint32_t g = 0; g < groups; ++g) EXPECT_EQ(per_group[g], threads * (threads - 1) / 2);
}

// --- memory diagnostics of the shim -------------------------------------------------

const char* kTooMuchThreadgroupMemory = R"(
#include <metal_stdlib>
using namespace metal;
kernel void greedy(device float* out [[buffer(0)]],
                   threadgroup float* scratch [[threadgroup(0)]],
                   uint t [[thread_index_in_threadgroup]]) {
  threadgroup float big[6000];
  threadgroup float more[2000];
  big[t] = 1.0f;
  more[t] = 2.0f;
  scratch[t] = 3.0f;
  out[t] = big[t] + more[t] + scratch[t];
}
)";

TEST_F(SimdKernelTest, KernelScopeThreadgroupMemoryOverTheLimitFails) {
  std::vector<float> out(32);
  const std::string message =
      failure_of(pipeline(kTooMuchThreadgroupMemory, "greedy"), 1, 32, [&](mfa::CommandBatch::DispatchRef& d) {
        d.host(0, out.data(), out.size() * 4, true).threadgroup_memory(0, 1024);
      });
  EXPECT_NE(message.find("threadgroup memory over 32 KiB"), std::string::npos) << message;
  EXPECT_NE(message.find("need 32000 bytes after 1024 bytes of [[threadgroup]] arguments"), std::string::npos)
      << message;
}

const char* kOutOfBounds = R"(
#include <metal_stdlib>
using namespace metal;
kernel void shifted(device const float* in [[buffer(0)]],
                    device float* out [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  out[i] = in[i + 1];
}
)";

TEST_F(SimdKernelTest, BoundsCheckingReportsTheAccess) {
  std::vector<float> in(100, 1.0f), out(100, NAN);
  auto bind = [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, in.data(), 400, false).host(1, out.data(), 400, true);
  };
  const std::string message = failure_of(pipeline(kOutOfBounds, "shifted", true), 1, 100, bind);
  EXPECT_NE(message.find("out-of-bounds access to buffer(0): byte offset 400, 4 bytes"), std::string::npos)
      << message;
  // Without the bound that goes past the end, the same kernel runs.
  std::vector<float> longer(101, 1.0f);
  run(pipeline(kOutOfBounds, "shifted", true), 1, 100, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, longer.data(), 404, false).host(1, out.data(), 400, true);
  });
  EXPECT_EQ(out[99], 1.0f);
}

const char* kPairs = R"(
#include <metal_stdlib>
using namespace metal;
kernel void pairs(device const half* in [[buffer(0)]], device half* out [[buffer(1)]],
                  constant uint& from [[buffer(2)]], constant uint& to [[buffer(3)]],
                  uint i [[thread_position_in_grid]]) {
  const half2 pair = *(device const half2*)(in + from + 2 * i);
  *(device half2*)(out + to + 2 * i) = pair;
}
)";

// Metal requires a vector access to be aligned to its vector (half2: 4 bytes). Bounds
// checking fails a misaligned one, load or store, naming the buffer and the offset.
TEST_F(SimdKernelTest, BoundsCheckingReportsAMisalignedVectorAccess) {
  std::vector<_Float16> in(66), out(66, _Float16(NAN));
  for (std::size_t k = 0; k < in.size(); ++k) in[k] = _Float16(float(integer(-1000, 1000)));
  auto bind = [&](std::uint32_t from, std::uint32_t to) {
    return [&, from, to](mfa::CommandBatch::DispatchRef& d) {
      d.host(0, in.data(), in.size() * 2, false).host(1, out.data(), out.size() * 2, true);
      d.bytes(2, &from, 4).bytes(3, &to, 4);
    };
  };
  std::string message = failure_of(pipeline(kPairs, "pairs", true), 1, 32, bind(1, 0));
  EXPECT_NE(message.find("misaligned vector access to buffer(0): byte offset 2, a 4-byte vector needs an address "
                         "that is a multiple of 4"), std::string::npos) << message;
  message = failure_of(pipeline(kPairs, "pairs", true), 1, 32, bind(2, 1));
  EXPECT_NE(message.find("misaligned vector access to buffer(1): byte offset 2,"), std::string::npos) << message;
  // Aligned (even element offsets), the same kernel runs and copies the pairs.
  run(pipeline(kPairs, "pairs", true), 1, 32, bind(2, 2));
  for (std::size_t k = 2; k < in.size(); ++k) EXPECT_EQ(float(out[k]), float(in[k])) << k;
  // Unchecked, the misaligned access is not diagnosed (the host allows it; Metal does not).
  EXPECT_EQ(failure_of(pipeline(kPairs, "pairs", false), 1, 32, bind(1, 0)), "no error");
}

const char* kCasts = R"(#include <metal_stdlib>
using namespace metal;
enum class Mode : uint { keep = 0, negate = 1 };
kernel void casts(device uint* modes [[buffer(0)]], device float* values [[buffer(1)]],
                  device half* halves [[buffer(2)]], threadgroup float* scratch [[threadgroup(0)]],
                  uint i [[thread_index_in_threadgroup]]) {
  scratch[i] = values[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const Mode mode = Mode(modes[i]);
  halves[i] = half(scratch[i]);
  values[i] = mode == Mode::negate ? -float(halves[i]) : float(bfloat(scratch[i]));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  scratch[i] = float(halves[i]) * 2.0f;
  halves[i] = scratch[i];
}
)";

// Explicit casts of a writable element (device memory always; threadgroup
// memory with the race detector or bounds checks) are static_casts, as in
// MSL: half(x) of a float element, bfloat(x), E(x) for a scoped enum. They
// must not depend on std::is_constructible, which is false where only an
// explicit conversion exists: int to a scoped enum everywhere, and float to
// _Float16 on g++ >= 13 (C++23's rules for extended floating types), where
// half(scratch[i]) failed to compile under sanitize="race".
TEST_F(SimdKernelTest, ExplicitCastsOfWritableElementsCompileInEveryMode) {
  constexpr std::size_t n = 64;
  for (const auto& [bounds_check, sanitize] : std::vector<std::pair<bool, std::string>>{
           {false, ""}, {true, ""}, {false, "race"}, {true, "race"}}) {
    std::vector<std::uint32_t> modes(n);
    std::vector<float> values(n);
    std::vector<_Float16> halves(n, _Float16(NAN));
    for (std::size_t k = 0; k < n; ++k) {
      modes[k] = k % 3 == 0;
      values[k] = float(k) * 0.25f - 8.0f;
    }
    const std::vector<float> inputs = values;
    const std::string message =
        failure_of(pipeline(kCasts, "casts", bounds_check, sanitize), 1, n, [&](mfa::CommandBatch::DispatchRef& d) {
          d.host(0, modes.data(), n * 4, true).host(1, values.data(), n * 4, true).host(2, halves.data(), n * 2, true);
          d.threadgroup_memory(0, n * 4);
        });
    ASSERT_EQ(message, "no error") << "bounds_check " << bounds_check << ", sanitize '" << sanitize << "'";
    for (std::size_t k = 0; k < n; ++k) {
      EXPECT_EQ(values[k], modes[k] ? -inputs[k] : inputs[k]) << k;
      EXPECT_EQ(static_cast<float>(halves[k]), 2.0f * inputs[k]) << k;  // exact in half
    }
  }
}

// --- exact array bounds (bounds_check) ----------------------------------------------

const char* kArrays = R"(#include <metal_stdlib>
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
kernel void rows(device float* out [[buffer(0)]], constant int& shift [[buffer(1)]],
                 uint t [[thread_index_in_threadgroup]]) {
  threadgroup float grid[4][8];
  grid[t / 8][t % 8] = float(t);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float v = grid[t / 8][t % 8];
  if (t == 0) v += grid[shift / 8][0];
  if (t == 0) v += grid[0][shift];
  out[t] = v;
}
float sum3(thread const float* v) { return v[0] + v[1] + v[2]; }
kernel void local(device float* out [[buffer(0)]], constant int& shift [[buffer(1)]],
                  uint t [[thread_index_in_threadgroup]]) {
  float a[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  float b[2][3];
  for (int k = 0; k < 6; ++k) { b[k / 3][k % 3] = float(k); }
  out[t] = a[t % 4] + sum3(a) + b[1][2];
  if (t == 3) out[t] = a[shift];
  if (t == 4) out[t] = b[0][shift];
}
kernel void block(device float* out [[buffer(0)]], constant int& shift [[buffer(1)]],
                  threadgroup float* tile [[threadgroup(0)]], uint t [[thread_index_in_threadgroup]]) {
  threadgroup float* p = tile + 8;
  p[t] = float(t);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup const float4* quads = (threadgroup const float4*)tile;
  out[t] = t != 0 ? p[t] : shift < 1000 ? p[shift] : quads[shift - 1000].x;
}
)";

class ArrayBoundsTest : public SimdKernelTest {
 protected:
  // Runs `kernel` (32 threads, 64 floats of [[threadgroup(0)]]) with `shift`;
  // the DispatchError's text from "out-of-bounds", or "no error".
  std::string run_arrays(const std::string& kernel, int shift, bool bounds_check = true,
                         const std::string& sanitize = "") {
    out_.assign(32, NAN);
    const std::string message = failure_of(pipeline(kArrays, kernel, bounds_check, sanitize), 1, 32,
                                           [&](mfa::CommandBatch::DispatchRef& d) {
                                             d.host(0, out_.data(), 128, true).bytes(1, &shift, 4);
                                             if (kernel == "block") d.threadgroup_memory(0, 64 * 4);
                                           });
    const std::size_t at = message.find("out-of-bounds");
    return at == std::string::npos ? message : message.substr(at);
  }
  std::vector<float> out_;
};

// The issue's case: small[t + 40] lands in `after`, which unchecked is
// silently overwritten; checked, any index outside small -- just past it,
// just before it, far away -- names the array, its size, the index and the line.
TEST_F(ArrayBoundsTest, ThreadgroupArraysAreCheckedNearAndFar) {
  EXPECT_EQ(run_arrays("spill", 0), "no error");
  EXPECT_EQ(out_[31], 1.0f);
  EXPECT_EQ(run_arrays("spill", 40, false), "no error");
  EXPECT_EQ(out_[8], 2.0f);  // unchecked: `after` was overwritten
  const std::string past = run_arrays("spill", 40);
  EXPECT_EQ(past.find("out-of-bounds index "), 0u) << past;
  EXPECT_NE(past.find(" into threadgroup float small[32] (32 elements) at spill.metal:9"), std::string::npos) << past;
  const int index = std::atoi(past.c_str() + std::strlen("out-of-bounds index "));
  EXPECT_GE(index, 40);
  EXPECT_LE(index, 71);
  EXPECT_EQ(run_arrays("spill", -1), "out-of-bounds index -1 into threadgroup float small[32] (32 elements) at spill.metal:9");
  const std::string far = run_arrays("spill", 1 << 20);
  EXPECT_NE(far.find(" into threadgroup float small[32] (32 elements) at spill.metal:9"), std::string::npos) << far;
  EXPECT_GE(std::atol(far.c_str() + std::strlen("out-of-bounds index ")), 1 << 20);
  // With the race detector too.
  EXPECT_EQ(run_arrays("spill", -1, true, "race"),
            "out-of-bounds index -1 into threadgroup float small[32] (32 elements) at spill.metal:9");
}

// Each subscript of a 2-D array is checked against its own dimension.
TEST_F(ArrayBoundsTest, EveryDimensionOfA2DArrayIsChecked) {
  EXPECT_EQ(run_arrays("rows", 7), "no error");
  EXPECT_EQ(out_[0], 7.0f);
  EXPECT_EQ(out_[31], 31.0f);
  EXPECT_EQ(run_arrays("rows", 8), "out-of-bounds index 8 into threadgroup float grid[4][8] (8 elements) at rows.metal:20");
  EXPECT_EQ(run_arrays("rows", 32), "out-of-bounds index 4 into threadgroup float grid[4][8] (4 elements) at rows.metal:19");
}

// A thread's own arrays: a[8] on float a[4] (which ASan misses when it
// lands in the thread's other locals), and each dimension of a 2-D one.
TEST_F(ArrayBoundsTest, ThreadArraysAreChecked) {
  EXPECT_EQ(run_arrays("local", 2), "no error");
  EXPECT_EQ(out_[0], 1.0f + 6.0f + 5.0f);
  EXPECT_EQ(out_[3], 3.0f);
  EXPECT_EQ(out_[4], 2.0f);
  EXPECT_EQ(run_arrays("local", 2, false), "no error");
  EXPECT_EQ(out_[0], 12.0f);
  EXPECT_EQ(run_arrays("local", 8), "out-of-bounds index 8 into thread float a[4] (4 elements) at local.metal:30");
  EXPECT_EQ(run_arrays("local", 3), "out-of-bounds index 3 into thread float b[2][3] (3 elements) at local.metal:31");
  EXPECT_EQ(run_arrays("local", -2), "out-of-bounds index -2 into thread float a[4] (4 elements) at local.metal:30");
}

// [[threadgroup(i)]] memory is checked against the dispatch's length for it,
// through pointer arithmetic and casts to wider elements.
TEST_F(ArrayBoundsTest, ThreadgroupArgumentsAreCheckedAgainstTheirLength) {
  EXPECT_EQ(run_arrays("block", 55), "no error");
  EXPECT_TRUE(std::isnan(out_[0]));  // tile[63] was never written: the poison

  EXPECT_EQ(out_[31], 31.0f);
  EXPECT_EQ(run_arrays("block", 56),
            "out-of-bounds index 64 into [[threadgroup(0)]] threadgroup float* tile (64 elements) at block.metal:39");
  EXPECT_EQ(run_arrays("block", -9),
            "out-of-bounds index -1 into [[threadgroup(0)]] threadgroup float* tile (64 elements) at block.metal:39");
  EXPECT_EQ(run_arrays("block", 1015), "no error");
  EXPECT_EQ(run_arrays("block", 1016),
            "out-of-bounds index 64 into [[threadgroup(0)]] threadgroup float* tile (64 elements) (a 16-byte access "
            "at byte offset 256 of 256) at block.metal:39");
}

const char* kEndlessLoops = R"(
#include <metal_stdlib>
using namespace metal;
kernel void endless(device float* data [[buffer(0)]],
                    uint i [[thread_position_in_threadgroup]]) {
  uint turns = 0;
  while (data[0] >= 0.0f) {
    turns += 1;
  }
  data[i] = float(turns);
}
kernel void endless_with_barrier(device float* data [[buffer(0)]],
                                 uint i [[thread_position_in_threadgroup]]) {
  for (uint k = 0; data[0] >= 0.0f; ++k) {
    threadgroup_barrier(mem_flags::mem_none);
  }
  data[i] = 1.0f;
}
kernel void ends(device float* data [[buffer(0)]],
                 uint i [[thread_position_in_threadgroup]]) {
  for (uint k = 0; k < 5000; ++k) data[i] += 1.0f;
}
)";

// A loop that never ends fails its dispatch after MFA_NATIVE_CPU_WATCHDOG_S,
// naming the kernel and the loop's line, with or without a barrier in it;
// the executor then runs the next dispatch as usual.
TEST_F(SimdKernelTest, EndlessLoopsEndWithTheWatchdog) {
  setenv("MFA_NATIVE_CPU_WATCHDOG_S", "0.5", 1);
  std::vector<float> data(64, 1.0f);
  auto bind = [&](mfa::CommandBatch::DispatchRef& d) { d.host(0, data.data(), data.size() * 4, true); };
  const auto endless_pipeline = pipeline(kEndlessLoops, "endless");
  const auto start = std::chrono::steady_clock::now();
  const std::string endless = failure_of(endless_pipeline, 4, 64, bind);
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  const std::string with_barrier = failure_of(pipeline(kEndlessLoops, "endless_with_barrier"), 4, 64, bind);
  unsetenv("MFA_NATIVE_CPU_WATCHDOG_S");
  EXPECT_NE(endless.find("kernel 'endless': threadgroup ("), std::string::npos) << endless;
  EXPECT_NE(endless.find("still running after 0.5 s (MFA_NATIVE_CPU_WATCHDOG_S), in the loop at endless.metal:7"),
            std::string::npos)
      << endless;
  EXPECT_NE(with_barrier.find("in the loop at endless_with_barrier.metal:14"), std::string::npos) << with_barrier;
  EXPECT_GE(elapsed.count(), 0.5);
  EXPECT_LT(elapsed.count(), 5.0);  // the other groups stop with the first

  std::fill(data.begin(), data.end(), 0.0f);
  run(pipeline(kEndlessLoops, "ends"), 1, 64, bind);
  EXPECT_EQ(data[63], 5000.0f);
}

const char* kReduction = R"(#include <metal_stdlib>
using namespace metal;
constant int BARRIER [[function_constant(0)]];  // 0: none, 1: mem_none, 2: mem_threadgroup
kernel void reduce(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                   threadgroup float* partial [[threadgroup(0)]],
                   uint i [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]]) {
  partial[i] = in[i];
  if (BARRIER == 1) threadgroup_barrier(mem_flags::mem_none);
  if (BARRIER == 2) threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = n / 2; stride > 0; stride /= 2) {
    if (i < stride) partial[i] += partial[i + stride];
    if (BARRIER == 1) threadgroup_barrier(mem_flags::mem_none);
    if (BARRIER == 2) threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (i == 0) out[0] = partial[0];
}
)";

class RaceCheckTest : public SimdKernelTest {
 protected:
  // Sums 64 values in each of `groups` threadgroups with the reduction
  // kernel built with `barrier`, racecheck on.
  std::string reduce(int barrier, float& sum, std::uint32_t groups = 1) {
    std::vector<float> in(64);
    for (std::size_t k = 0; k < in.size(); ++k) in[k] = float(k);
    const auto kernel = pipeline(kReduction, "reduce", false, "race", mfa::FunctionConstants().set(0, barrier));
    return failure_of(kernel, groups, 64, [&](mfa::CommandBatch::DispatchRef& d) {
      d.host(0, in.data(), 256, false).host(1, &sum, 4, true).threadgroup_memory(0, 256);
    });
  }
};

TEST_F(RaceCheckTest, AReductionWithItsBarriersIsRaceFree) {
  float sum = 0;
  EXPECT_EQ(reduce(2, sum, 8), "no error");
  EXPECT_EQ(sum, 63.0f * 64.0f / 2.0f);
}

TEST_F(RaceCheckTest, WithoutBarriersTheFirstRaceNamesBothLinesAndThreads) {
  float sum = 0;
  // The threads run in turn: thread 0 sums partial[1] before thread 1 writes it.
  EXPECT_EQ(reduce(0, sum),
            "kernel 'reduce': threadgroup (0, 0, 0): data race (write-after-read) on byte 4 of "
            "[[threadgroup(0)]]: thread (0, 0, 0) (simdgroup 0, lane 0) read it at reduce.metal:11, then "
            "thread (1, 0, 0) (simdgroup 0, lane 1) wrote it at reduce.metal:7, with no "
            "threadgroup_barrier(mem_flags::mem_threadgroup) between them (nor a simdgroup_barrier with "
            "mem_threadgroup, for lanes of one simdgroup)");
}

TEST_F(RaceCheckTest, ABarrierWithoutMemThreadgroupDoesNotOrderThreadgroupMemory) {
  float sum = 0;
  const std::string message = reduce(1, sum);
  EXPECT_NE(message.find("data race (read-after-write) on byte 128 of [[threadgroup(0)]]: thread (32, 0, 0) "
                         "(simdgroup 1, lane 0) wrote it at reduce.metal:7, then thread (0, 0, 0) (simdgroup "
                         "0, lane 0) read it at reduce.metal:11"),
            std::string::npos)
      << message;
}

TEST_F(RaceCheckTest, WithoutTheRaceCheckTheSameKernelRunsUnchecked) {
  std::vector<float> in(64, 1.0f);
  float sum = 0;
  const auto kernel = pipeline(kReduction, "reduce", false, "", mfa::FunctionConstants().set(0, 0));
  run(kernel, 1, 64, [&](mfa::CommandBatch::DispatchRef& d) {
    d.host(0, in.data(), 256, false).host(1, &sum, 4, true).threadgroup_memory(0, 256);
  });
  EXPECT_NE(sum, 64.0f);  // racy: thread 0 summed values the others had not written yet
}

const char* kNeighbours = R"(#include <metal_stdlib>
using namespace metal;
constant bool SIMDGROUP_BARRIER [[function_constant(0)]];
kernel void neighbours(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                       uint i [[thread_index_in_threadgroup]]) {
  threadgroup float values[64];
  values[i] = float(i);
  if (SIMDGROUP_BARRIER) simdgroup_barrier(mem_flags::mem_threadgroup);
  else out[i] = simd_sum(1.0f);
  out[i] = values[i - lane + (lane + 1) % 32];
}
)";

// Lanes of one simdgroup are ordered by simdgroup_barrier(mem_threadgroup),
// not by other SIMD-group functions.
TEST_F(RaceCheckTest, OnlyASimdgroupBarrierOrdersTheLanesOfASimdgroup) {
  std::vector<float> out(64);
  auto bind = [&](mfa::CommandBatch::DispatchRef& d) { d.host(0, out.data(), 256, true); };
  EXPECT_EQ(failure_of(pipeline(kNeighbours, "neighbours", false, "race", mfa::FunctionConstants().set(0, true)), 1, 64, bind), "no error");
  EXPECT_EQ(out[31], 0.0f);
  EXPECT_EQ(out[32], 33.0f);
  const std::string message = failure_of(pipeline(kNeighbours, "neighbours", false, "race", mfa::FunctionConstants().set(0, false)), 1, 64, bind);
  EXPECT_NE(message.find("data race (read-after-write) on byte 0 of the kernel-scope threadgroup variables: "
                         "thread (0, 0, 0) (simdgroup 0, lane 0) wrote it at neighbours.metal:7, then thread "
                         "(31, 0, 0) (simdgroup 0, lane 31) read it at neighbours.metal:10"),
            std::string::npos)
      << message;
}

const char* kShapes = R"(#include <metal_stdlib>
using namespace metal;
float row_sum(threadgroup const float* row, uint n) {
  float s = 0;
  for (uint k = 0; k < n; ++k) { s += row[k]; }
  return s;
}
kernel void shapes(device float* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup float tile[4][32];
  threadgroup float total;
  tile[i / 32][i % 32] = float(i);
  if (i == 0) total = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup float4* quads = (threadgroup float4*)&tile[i / 32][0];
  const float4 first = quads[0];
  if (i % 32 == 0) out[i / 32] = row_sum(tile[i / 32], 32) + first.w;
  if (i == 127) total += 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (i == 5) out[4] = total;
  if (i == 6) tile[0][1] = 0.0f;
}
)";

// 2-D arrays, rows passed to helpers, casts, scalars: every access is
// checked (a race in the helper names the helper's line), and a race-free
// kernel computes what it computes unchecked.
TEST_F(RaceCheckTest, ThreadgroupMemoryOfEveryShapeIsChecked) {
  std::vector<float> out(5, NAN);
  auto bind = [&](mfa::CommandBatch::DispatchRef& d) { d.host(0, out.data(), 20, true); };
  EXPECT_EQ(failure_of(pipeline(kShapes, "shapes", false, "race"), 1, 128, bind), "no error");
  for (int r = 0; r < 4; ++r) EXPECT_EQ(out[r], 32.0f * 32 * r + 496 + 32 * r + 3) << r;
  EXPECT_EQ(out[4], 1.0f);

  // Without the second barrier, thread 5 reads `total` after thread 127,
  // released first from the barrier, wrote it (a kernel-scope scalar names
  // its declaration's line)...
  std::string racy = kShapes;
  const std::string second_barrier = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  if (i == 5)";
  racy.replace(racy.find(second_barrier), second_barrier.size(), "\n  if (i == 5)");
  std::string message = failure_of(pipeline(racy, "shapes", false, "race"), 1, 128, bind);
  EXPECT_NE(message.find("data race (read-after-write) on byte 512 of the kernel-scope threadgroup variables: "
                         "thread (127, 0, 0) (simdgroup 3, lane 31) wrote it at shapes.metal:10, then thread "
                         "(5, 0, 0) (simdgroup 0, lane 5) read it at shapes.metal:10"),
            std::string::npos)
      << message;
  // ... and without that read, thread 6 writes tile[0][1] after thread 0
  // read it in the helper.
  const std::string read_total = "if (i == 5) out[4] = total;";
  racy.replace(racy.find(read_total), read_total.size(), "");
  message = failure_of(pipeline(racy, "shapes", false, "race"), 1, 128, bind);
  EXPECT_NE(message.find("data race (write-after-read) on byte 4 of the kernel-scope threadgroup variables: "
                         "thread (0, 0, 0) (simdgroup 0, lane 0) read it at shapes.metal:5, then thread (6, 0, 0) "
                         "(simdgroup 0, lane 6) wrote it at shapes.metal:20"),
            std::string::npos)
      << message;
}

TEST_F(RaceCheckTest, AccessesOutsideThreadgroupMemoryAreReported) {
  const char* source = R"(kernel void beyond(threadgroup float* scratch [[threadgroup(0)]],
                   device float* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  out[i] = scratch[i + 40000];
}
)";
  std::vector<float> out(4);
  const std::string message =
      failure_of(pipeline(source, "beyond", false, "race"), 1, 4, [&](mfa::CommandBatch::DispatchRef& d) {
        d.host(0, out.data(), 16, true).threadgroup_memory(0, 16);
      });
  EXPECT_NE(message.find("thread (0, 0, 0): a threadgroup pointer accesses 4 bytes at "), std::string::npos)
      << message;
  EXPECT_NE(message.find("outside the threadgroup's 32768 bytes of threadgroup memory, at beyond.metal:3"),
            std::string::npos)
      << message;
}

}  // namespace
