// Validation of dispatches and the host-memory paths, on the cpu device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "mfa/command_batch.hpp"
#include "mfa/errors.hpp"

namespace {

const char* kSource = R"(
#include <metal_stdlib>
using namespace metal;
struct Params { float scale; uint count; };
kernel void scale(device const float* x [[buffer(0)]],
                  device float* y [[buffer(1)]],
                  constant Params& params [[buffer(2)]],
                  threadgroup float* scratch [[threadgroup(0)]],
                  uint i [[thread_position_in_grid]],
                  uint t [[thread_index_in_threadgroup]]) {
  scratch[t] = i < params.count ? x[i] : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (i < params.count) y[i] = scratch[t] * params.scale;
}
)";

struct Params {
  float scale;
  std::uint32_t count;
};

class CommandBatchTest : public ::testing::Test {
 protected:
  mfa::Device device = mfa::Device::get(mfa::DeviceKind::cpu);
  std::shared_ptr<const mfa::Pipeline> pipeline = device.pipeline(kSource, "scale");
  std::vector<float> x = random(300), y = std::vector<float>(300, std::nanf(""));
  Params params{1.5f, 300};

  static std::vector<float> random(std::size_t n) {
    std::mt19937 rng(42);
    std::normal_distribution<float> normal;
    std::vector<float> v(n);
    for (float& e : v) e = normal(rng);
    return v;
  }

  void bind_all(mfa::CommandBatch::DispatchRef ref) {
    ref.host(0, x.data(), x.size() * 4, false).host(1, y.data(), y.size() * 4, true).bytes(2, &params, sizeof params)
        .threadgroup_memory(0, 64 * 4);
  }

  template <class F>
  std::string error_of(F&& f) {
    try {
      f();
    } catch (const mfa::ArgumentError& e) {
      return e.what();
    }
    return "no error";
  }
};

TEST_F(CommandBatchTest, RunsWithHostMemoryInPlace) {
  mfa::CommandBatch batch(device);
  bind_all(batch.dispatch(pipeline, {5}, {64}));
  auto stats = batch.run();
  ASSERT_EQ(stats.size(), 1u);
  EXPECT_EQ(stats[0].kernel, "scale");
  EXPECT_EQ(stats[0].threadgroups, 5u);
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_FLOAT_EQ(y[i], x[i] * 1.5f) << i;
}

TEST_F(CommandBatchTest, DispatchesRunInOrderAndSeeEarlierWrites) {
  mfa::CommandBatch batch(device);
  bind_all(batch.dispatch(pipeline, {5}, {64}));
  std::vector<float> z(300, std::nanf(""));
  batch.dispatch(pipeline, {5}, {64})
      .host(0, y.data(), y.size() * 4, false)
      .host(1, z.data(), z.size() * 4, true)
      .bytes(2, &params, sizeof params)
      .threadgroup_memory(0, 64 * 4);
  EXPECT_EQ(batch.run().size(), 2u);
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_FLOAT_EQ(z[i], x[i] * 2.25f) << i;
}

TEST_F(CommandBatchTest, AnUnboundBufferIsNamed) {
  mfa::CommandBatch batch(device);
  batch.dispatch(pipeline, {5}, {64}).host(0, x.data(), 1200, false).bytes(2, &params, sizeof params)
      .threadgroup_memory(0, 256);
  const std::string message = error_of([&] { batch.commit(); });
  EXPECT_NE(message.find("buffer(1) 'y' is not bound"), std::string::npos) << message;
}

TEST_F(CommandBatchTest, TooManyThreadsPerThreadgroup) {
  mfa::CommandBatch batch(device);
  bind_all(batch.dispatch(pipeline, {1}, {64, 32}));
  const std::string message = error_of([&] { batch.commit(); });
  EXPECT_NE(message.find("2048 threads per threadgroup exceeds the limit of 1024"), std::string::npos) << message;
}

TEST_F(CommandBatchTest, ThreadgroupMemoryOverTheLimit) {
  mfa::CommandBatch batch(device);
  auto ref = batch.dispatch(pipeline, {1}, {64});
  bind_all(ref);
  ref.threadgroup_memory(0, 40000);
  const std::string message = error_of([&] { batch.commit(); });
  EXPECT_NE(message.find("over the limit of 32768"), std::string::npos) << message;
}

TEST_F(CommandBatchTest, MissingThreadgroupLength) {
  mfa::CommandBatch batch(device);
  batch.dispatch(pipeline, {1}, {64}).host(0, x.data(), 1200, false).host(1, y.data(), 1200, true)
      .bytes(2, &params, sizeof params);
  const std::string message = error_of([&] { batch.commit(); });
  EXPECT_NE(message.find("threadgroup(0) 'scratch' has no length"), std::string::npos) << message;
}

TEST_F(CommandBatchTest, InlineBytesTooSmallForTheStruct) {
  mfa::CommandBatch batch(device);
  auto ref = batch.dispatch(pipeline, {1}, {64});
  bind_all(ref);
  ref.bytes(2, &params, 4);
  const std::string message = error_of([&] { batch.commit(); });
  EXPECT_NE(message.find("8 bytes, but 4 bytes were bound"), std::string::npos) << message;
}

TEST_F(CommandBatchTest, ReadOnlyMemoryForAWritableArgument) {
  mfa::CommandBatch batch(device);
  auto ref = batch.dispatch(pipeline, {1}, {64});
  bind_all(ref);
  ref.host(1, y.data(), 1200, false);
  const std::string message = error_of([&] { batch.commit(); });
  EXPECT_NE(message.find("buffer(1) 'y' is writable"), std::string::npos) << message;
}

TEST_F(CommandBatchTest, ABufferTheKernelDoesNotHave) {
  mfa::CommandBatch batch(device);
  auto ref = batch.dispatch(pipeline, {1}, {64});
  bind_all(ref);
  ref.bytes(5, &params, sizeof params);
  const std::string message = error_of([&] { batch.commit(); });
  EXPECT_NE(message.find("has no buffer(5)"), std::string::npos) << message;
}

TEST_F(CommandBatchTest, EmptyGridsAndOrderMistakes) {
  mfa::CommandBatch batch(device);
  bind_all(batch.dispatch(pipeline, {0}, {64}));
  EXPECT_NE(error_of([&] { batch.commit(); }).find("threadgroups must be at least 1"), std::string::npos);
  mfa::CommandBatch unused(device);
  EXPECT_THROW(unused.wait(), mfa::ArgumentError);
}

TEST_F(CommandBatchTest, TakenWorkIsValidatedAndRunsElsewhere) {
  mfa::CommandBatch unbound(device);
  unbound.dispatch(pipeline, {5}, {64}).host(0, x.data(), 1200, false).bytes(2, &params, sizeof params)
      .threadgroup_memory(0, 256);
  EXPECT_NE(error_of([&] { unbound.take_work(); }).find("buffer(1) 'y' is not bound"), std::string::npos);

  mfa::CommandBatch batch(device);
  bind_all(batch.dispatch(pipeline, {5}, {64}));
  mfa::BatchWork work = batch.take_work();
  EXPECT_THROW(batch.commit(), mfa::ArgumentError);  // spent
  EXPECT_THROW(batch.take_work(), mfa::ArgumentError);
  ASSERT_EQ(work.dispatches.size(), 1u);
  EXPECT_TRUE(work.staging.empty());  // the cpu backend binds host memory in place
  for (float value : y) ASSERT_TRUE(std::isnan(value));  // nothing ran yet
  device.backend().submit(std::move(work.dispatches), false)->wait();
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_FLOAT_EQ(y[i], x[i] * 1.5f) << i;
}

TEST_F(CommandBatchTest, CopyBackWritesOnlyWritableStaging) {
  mfa::Buffer written = device.new_buffer(x.size() * 4), read = device.new_buffer(x.size() * 4);
  std::memcpy(written.data(), x.data(), x.size() * 4);
  std::memcpy(read.data(), x.data(), x.size() * 4);
  std::vector<float> out(x.size(), std::nanf("")), in(x.size(), std::nanf(""));
  const std::vector<mfa::HostStaging> staging = {{out.data(), written, out.size() * 4, true},
                                                 {in.data(), read, in.size() * 4, false}};
  EXPECT_EQ(mfa::copy_back(staging), out.size() * 4);
  EXPECT_EQ(out, x);
  for (float value : in) ASSERT_TRUE(std::isnan(value));
}

}  // namespace

namespace {

TEST(CommandBatchLimits, TheKernelsDeclaredThreadLimitIsHonored) {
  const char* source = R"(
#include <metal_stdlib>
using namespace metal;
[[max_total_threads_per_threadgroup(128)]]
kernel void small(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) { y[i] = 1.0f; }
)";
  mfa::Device device = mfa::Device::get(mfa::DeviceKind::cpu);
  auto pipeline = device.pipeline(source, "small");
  EXPECT_EQ(pipeline->max_total_threads_per_threadgroup(), 128u);
  std::vector<float> y(256);
  mfa::CommandBatch batch(device);
  batch.dispatch(pipeline, {1}, {256}).host(0, y.data(), y.size() * 4, true);
  try {
    batch.commit();
    FAIL() << "expected ArgumentError";
  } catch (const mfa::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds the limit of 128"), std::string::npos) << e.what();
  }
}

}  // namespace
