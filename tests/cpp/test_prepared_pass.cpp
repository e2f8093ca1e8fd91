// PreparedPass: a two-kernel pass whose intermediate never leaves the device pool,
// run in one batch; slots checked at construction.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "mfa/errors.hpp"
#include "mfa/prepared_pass.hpp"

namespace {

// twice: t = 2 x (t an intermediate); plus: y = t + offset (offset inline bytes).
const char* kSource = R"(
#include <metal_stdlib>
using namespace metal;
kernel void twice(device const float* x [[buffer(0)]], device float* t [[buffer(1)]],
                  constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  if (i < n) t[i] = 2.0f * x[i];
}
kernel void plus(device const float* t [[buffer(0)]], device float* y [[buffer(1)]],
                 constant uint& n [[buffer(2)]], constant float& offset [[buffer(3)]],
                 uint i [[thread_position_in_grid]]) {
  if (i < n) y[i] = t[i] + offset;
}
)";

using Source = mfa::PassBinding::Source;

std::vector<unsigned char> bytes_of(const void* data, std::size_t size) {
  const auto* begin = static_cast<const unsigned char*>(data);
  return std::vector<unsigned char>(begin, begin + size);
}

class PreparedPassTest : public ::testing::Test {
 protected:
  static constexpr std::uint32_t kCount = 1000;
  mfa::Device device = mfa::Device::get(mfa::DeviceKind::cpu);

  mfa::PreparedPass make() {
    const std::uint32_t n = kCount;
    const float offset = 0.25f;
    std::vector<mfa::PassDispatch> dispatches(2);
    dispatches[0] = {device.pipeline(kSource, "twice"), {4}, {256},
                     {{0, Source::array, 0}, {1, Source::intermediate, 0}, {2, Source::constant, 0}}, {}};
    dispatches[1] = {device.pipeline(kSource, "plus"), {4}, {256},
                     {{0, Source::intermediate, 0}, {1, Source::array, 1}, {2, Source::constant, 0},
                      {3, Source::constant, 1}},
                     {}};
    return mfa::PreparedPass(device, std::move(dispatches), {{"x", false}, {"y", true}}, {kCount * 4},
                             {bytes_of(&n, 4), bytes_of(&offset, 4)});
  }
};

TEST_F(PreparedPassTest, RunsBothKernelsInOneBatchThroughAPooledIntermediate) {
  mfa::PreparedPass pass = make();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(kCount), y(kCount, std::nanf(""));
  for (float& e : x) e = normal(rng);
  const mfa::BatchStats before = device.batch_stats();
  std::vector<mfa::DispatchStats> stats = pass.run({{x.data(), x.size() * 4, {}, 0}, {y.data(), y.size() * 4, {}, 0}});
  const mfa::BatchStats after = device.batch_stats();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].kernel, "twice");
  EXPECT_EQ(stats[1].kernel, "plus");
  EXPECT_EQ(after.committed - before.committed, 1u);
  EXPECT_EQ(after.bytes_staged_in - before.bytes_staged_in, 0u);  // the cpu backend binds host memory in place
  EXPECT_EQ(after.bytes_host_bound - before.bytes_host_bound, 2u * kCount * 4);  // x and y, by address
  for (std::size_t i = 0; i < kCount; ++i) ASSERT_EQ(y[i], 2.0f * x[i] + 0.25f) << i;

  // y as a pool Buffer: only x is caller memory, and y's buffer holds the result.
  mfa::Buffer pooled = device.new_buffer(kCount * 4);
  const mfa::BatchStats pooled_before = device.batch_stats();
  pass.run({{x.data(), x.size() * 4, {}, 0}, {nullptr, 0, pooled, 0}});
  EXPECT_EQ(device.batch_stats().bytes_host_bound - pooled_before.bytes_host_bound, kCount * 4u);
  const auto* written = static_cast<const float*>(pooled.data());
  for (std::size_t i = 0; i < kCount; ++i) ASSERT_EQ(written[i], 2.0f * x[i] + 0.25f) << i;

  // Runs again with other arrays (a second, concurrent-safe run gets its own intermediate).
  std::vector<float> x2(kCount, 1.5f), y2(kCount, std::nanf(""));
  pass.run({{x2.data(), x2.size() * 4, {}, 0}, {y2.data(), y2.size() * 4, {}, 0}});
  for (float e : y2) ASSERT_EQ(e, 3.25f);
}

TEST_F(PreparedPassTest, RefusesBadSlotsAndArrayCounts) {
  std::vector<mfa::PassDispatch> dispatches(1);
  dispatches[0] = {device.pipeline(kSource, "twice"), {1}, {32},
                   {{0, Source::array, 0}, {1, Source::intermediate, 3}, {2, Source::constant, 0}}, {}};
  const std::uint32_t n = 1;
  EXPECT_THROW(mfa::PreparedPass(device, dispatches, {{"x", false}}, {4}, {bytes_of(&n, 4)}), mfa::ArgumentError);
  mfa::PreparedPass pass = make();
  EXPECT_THROW(pass.run({}), mfa::ArgumentError);
}

}  // namespace
