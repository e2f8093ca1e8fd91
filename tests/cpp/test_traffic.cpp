// Device traffic on the cpu backend: every load and store through a device or
// constant pointer counts sizeof(element) against its [[buffer(i)]], through
// local pointers, arithmetic, casts, helper functions, atomics and matrices.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "mfa/command_batch.hpp"
#include "mfa/device.hpp"
#include "mfa/errors.hpp"

namespace {

constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

struct Traffic {
  std::uint64_t read = 0, written = 0;
  bool operator==(const Traffic& o) const { return read == o.read && written == o.written; }
};

std::ostream& operator<<(std::ostream& out, const Traffic& t) {
  return out << "{read " << t.read << ", written " << t.written << "}";
}

// Traffic by argument name; also checks that indices are listed in order.
std::map<std::string, Traffic> traffic_of(const mfa::DispatchStats& stats) {
  std::map<std::string, Traffic> traffic;
  EXPECT_TRUE(stats.traffic.has_value());
  if (!stats.traffic) return traffic;
  int previous = -1;
  for (const mfa::BufferTraffic& buffer : *stats.traffic) {
    EXPECT_GT(buffer.index, previous);
    previous = buffer.index;
    traffic[buffer.name] = {buffer.bytes_read, buffer.bytes_written};
  }
  return traffic;
}

class TrafficTest : public ::testing::Test {
 protected:
  TrafficTest() : seed_(std::random_device{}()), random_(seed_) {}

  std::string trace() const { return "seed " + std::to_string(seed_); }
  std::uint32_t integer(std::uint32_t low, std::uint32_t high) {
    return std::uniform_int_distribution<std::uint32_t>(low, high)(random_);
  }
  std::vector<float> random_floats(std::size_t n) {
    std::uniform_real_distribution<float> value(-10.0f, 10.0f);
    std::vector<float> values(n);
    for (float& v : values) v = value(random_);
    return values;
  }

  std::shared_ptr<const mfa::Pipeline> pipeline(const std::string& source, const std::string& name) {
    return device_.pipeline(source, name);
  }

  mfa::DispatchStats run(const std::string& source, const std::string& name, std::uint32_t groups,
                         std::uint32_t threads, const std::function<void(mfa::CommandBatch::DispatchRef&)>& bind) {
    mfa::CommandBatch batch(device_);
    mfa::CommandBatch::DispatchRef dispatch = batch.dispatch(pipeline(source, name), {groups}, {threads});
    bind(dispatch);
    return batch.run().at(0);
  }

  std::string compile_error(const std::string& source, const std::string& name) {
    try {
      pipeline(source, name);
    } catch (const mfa::CompileError& e) {
      return e.what();
    }
    return "no error";
  }

  mfa::Device device_ = mfa::Device::get(mfa::DeviceKind::cpu);

 private:
  unsigned seed_;
  std::mt19937 random_;
};

TEST_F(TrafficTest, ACopyReadsItsInputOnceAndWritesItsOutputOnce) {
  SCOPED_TRACE(trace());
  const std::string source = R"(
kernel void copy(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                 constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  if (i < n) out[i] = in[i];
}
)";
  const std::uint32_t threads = 32, groups = integer(2, 9);
  const std::uint32_t n = groups * threads - integer(0, threads - 1);
  std::vector<float> in = random_floats(n), out(n, kPoison);
  mfa::DispatchStats stats = run(source, "copy", groups, threads, [&](auto& d) {
    d.host(0, in.data(), n * 4, false).host(1, out.data(), n * 4, true).bytes(2, &n, sizeof n);
  });
  EXPECT_EQ(out, in);
  ASSERT_TRUE(stats.traffic);
  ASSERT_EQ(stats.traffic->size(), 2u);  // the reference `n` is not counted
  EXPECT_EQ((*stats.traffic)[0].index, 0);
  EXPECT_EQ((*stats.traffic)[0].name, "in");
  EXPECT_EQ((*stats.traffic)[1].index, 1);
  EXPECT_EQ((*stats.traffic)[1].name, "out");
  std::map<std::string, Traffic> traffic = traffic_of(stats);
  EXPECT_EQ(traffic["in"], (Traffic{4ull * n, 0}));
  EXPECT_EQ(traffic["out"], (Traffic{0, 4ull * n}));
}

TEST_F(TrafficTest, LocalPointersFromArithmeticKeepCounting) {
  SCOPED_TRACE(trace());
  const std::string source = R"(
kernel void rows(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
  device const float* row = in + ulong(i) * 4;
  device const float* last = row + 3;
  device float* slot = out;
  slot += i;
  *slot = row[0] + *last;
}
)";
  const std::uint32_t threads = integer(1, 64), groups = integer(1, 5), n = threads * groups;
  std::vector<float> in = random_floats(4 * n), out(n, kPoison);
  mfa::DispatchStats stats = run(source, "rows", groups, threads, [&](auto& d) {
    d.host(0, in.data(), in.size() * 4, false).host(1, out.data(), n * 4, true);
  });
  for (std::uint32_t i = 0; i < n; ++i) EXPECT_EQ(out[i], in[4 * i] + in[4 * i + 3]) << i;
  std::map<std::string, Traffic> traffic = traffic_of(stats);
  EXPECT_EQ(traffic["in"], (Traffic{8ull * n, 0}));
  EXPECT_EQ(traffic["out"], (Traffic{0, 4ull * n}));
}

TEST_F(TrafficTest, ReadModifyWriteCountsBoth) {
  SCOPED_TRACE(trace());
  const std::string source = R"(
kernel void axpy(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                 device uint* hits [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  y[i] += x[i];
  hits[i]++;
  const float twice = y[i] * 2.0f;
  y[i] = twice - x[i];
}
)";
  const std::uint32_t threads = 32, groups = integer(1, 6), n = threads * groups;
  std::vector<float> x = random_floats(n), y = random_floats(n), expected(n);
  std::vector<std::uint32_t> hits(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    expected[i] = (y[i] + x[i]) * 2.0f - x[i];
    hits[i] = integer(0, 1000);
  }
  std::vector<std::uint32_t> expected_hits = hits;
  for (std::uint32_t& h : expected_hits) ++h;
  mfa::DispatchStats stats = run(source, "axpy", groups, threads, [&](auto& d) {
    d.host(0, x.data(), n * 4, false).host(1, y.data(), n * 4, true).host(2, hits.data(), n * 4, true);
  });
  EXPECT_EQ(y, expected);
  EXPECT_EQ(hits, expected_hits);
  std::map<std::string, Traffic> traffic = traffic_of(stats);
  EXPECT_EQ(traffic["x"], (Traffic{8ull * n, 0}));
  EXPECT_EQ(traffic["y"], (Traffic{8ull * n, 8ull * n}));  // += reads and writes; then a read and a write
  EXPECT_EQ(traffic["hits"], (Traffic{4ull * n, 4ull * n}));
}

TEST_F(TrafficTest, AStridedReadCountsOnlyTheElementsRead) {
  SCOPED_TRACE(trace());
  const std::string source = R"(
kernel void evens(device const half* in [[buffer(0)]], device float* out [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
  out[i] = float(in[2 * i]);
}
)";
  const std::uint32_t threads = 32, groups = integer(1, 6), n = threads * groups;
  std::vector<std::uint16_t> in(2 * n);
  for (std::uint16_t& h : in) h = std::uint16_t(0x3c00 + integer(0, 0x3ff));  // [1, 2) in half
  std::vector<float> out(n, kPoison);
  mfa::DispatchStats stats = run(source, "evens", groups, threads, [&](auto& d) {
    d.host(0, in.data(), in.size() * 2, false).host(1, out.data(), n * 4, true);
  });
  for (std::uint32_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(out[i], 1.0f + (in[2 * i] - 0x3c00) / 1024.0f) << i;
  std::map<std::string, Traffic> traffic = traffic_of(stats);
  EXPECT_EQ(traffic["in"], (Traffic{2ull * n, 0}));  // n of the 2n halves
  EXPECT_EQ(traffic["out"], (Traffic{0, 4ull * n}));
}

TEST_F(TrafficTest, HelperFunctionsCastsAndConstantTablesCount) {
  SCOPED_TRACE(trace());
  const std::string source = R"(
#include <metal_stdlib>
using namespace metal;
void store_scaled(device float* p, uint i, float value, constant float* factor) {
  p[i] = value;
  p[i] *= factor[0];
}
float sum4(const device float4* v) {
  const float4 whole = v[0];
  return whole.x + whole.y + whole.z + whole.w;
}
kernel void helpers(device const float* in [[buffer(0)]], constant float* table [[buffer(1)]],
                    device float* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  const float total = sum4((device const float4*)(in + ulong(i) * 4));
  store_scaled(out, i, total + table[i % 2], table + 2);
}
)";
  const std::uint32_t threads = 16, groups = integer(1, 6), n = threads * groups;
  std::vector<float> in = random_floats(4 * n), table = random_floats(3), out(n, kPoison);
  mfa::DispatchStats stats = run(source, "helpers", groups, threads, [&](auto& d) {
    d.host(0, in.data(), in.size() * 4, false).bytes(1, table.data(), table.size() * 4).host(2, out.data(), n * 4, true);
  });
  for (std::uint32_t i = 0; i < n; ++i) {
    const float total = in[4 * i] + in[4 * i + 1] + in[4 * i + 2] + in[4 * i + 3];
    EXPECT_FLOAT_EQ(out[i], (total + table[i % 2]) * table[2]) << i;
  }
  std::map<std::string, Traffic> traffic = traffic_of(stats);
  EXPECT_EQ(traffic["in"], (Traffic{16ull * n, 0}));     // one float4 per thread
  EXPECT_EQ(traffic["table"], (Traffic{8ull * n, 0}));   // table[i % 2] and factor[0]
  EXPECT_EQ(traffic["out"], (Traffic{4ull * n, 8ull * n}));
}

TEST_F(TrafficTest, AtomicsAndMatricesCountTheirElements) {
  SCOPED_TRACE(trace());
  const std::string source = R"(
#include <metal_stdlib>
using namespace metal;
kernel void tiles(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                  device atomic_uint* count [[buffer(2)]], uint group [[threadgroup_position_in_grid]]) {
  simdgroup_float8x8 tile;
  simdgroup_load(tile, in + ulong(group) * 64, 8);
  simdgroup_store(tile, out + ulong(group) * 64, 8);
  atomic_fetch_add_explicit(&count[0], 1u, memory_order_relaxed);
  if (atomic_load_explicit(count, memory_order_relaxed) == 0u) out[0] = 0.0f;
}
)";
  const std::uint32_t groups = integer(1, 8);
  std::vector<float> in = random_floats(64 * groups), out(in.size(), kPoison);
  std::uint32_t count = integer(1, 1000);
  const std::uint32_t count_before = count;
  mfa::DispatchStats stats = run(source, "tiles", groups, 32, [&](auto& d) {
    d.host(0, in.data(), in.size() * 4, false).host(1, out.data(), out.size() * 4, true).host(2, &count, 4, true);
  });
  EXPECT_EQ(out, in);
  EXPECT_EQ(count, count_before + 32 * groups);
  std::map<std::string, Traffic> traffic = traffic_of(stats);
  EXPECT_EQ(traffic["in"], (Traffic{256ull * groups, 0}));
  EXPECT_EQ(traffic["out"], (Traffic{0, 256ull * groups}));
  EXPECT_EQ(traffic["count"], (Traffic{8ull * 32 * groups, 4ull * 32 * groups}));  // fetch_add: both; load: read
}

TEST_F(TrafficTest, BoundsChecksStillCatchAccessesThroughLocalPointers) {
  const std::string source = R"(
kernel void past(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
  device const float* shifted = in + 1;
  out[i] = shifted[i];
}
)";
  mfa::CompileOptions options;
  options.bounds_check = true;
  std::vector<float> in = random_floats(32), out(32, kPoison);
  mfa::CommandBatch batch(device_);
  batch.dispatch(device_.pipeline(source, "past", {}, options), {1}, {32})
      .host(0, in.data(), in.size() * 4, false)
      .host(1, out.data(), out.size() * 4, true);
  try {
    batch.run();
    ADD_FAILURE() << "no DispatchError";
  } catch (const mfa::DispatchError& e) {
    EXPECT_NE(std::string(e.what()).find("out-of-bounds access to buffer(0): byte offset 128"), std::string::npos)
        << e.what();
  }
}

TEST_F(TrafficTest, MembersOfAWritableElementAreACompileErrorThatSaysWhy) {
  const std::string swizzle = R"(
kernel void set_x(device float4* v [[buffer(0)]]) { v[0].x = 1.0f; }
)";
  EXPECT_NE(compile_error(swizzle, "set_x").find("writable_element"), std::string::npos);
  const std::string arrow = R"(
struct Pair { float a, b; };
kernel void set_a(device Pair* p [[buffer(0)]]) { p->a = 1.0f; }
)";
  EXPECT_NE(compile_error(arrow, "set_a").find("can be counted neither as a read nor as a write"),
            std::string::npos);
}

}  // namespace
