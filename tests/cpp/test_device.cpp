#include <gtest/gtest.h>

#include <cstdlib>

#include "executor.hpp"
#include "mfa/device.hpp"
#include "mfa/errors.hpp"

namespace {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(Device, CpuIsAlwaysAvailableWithMetalLimits) {
  mfa::Device cpu = mfa::Device::get(mfa::DeviceKind::cpu);
  EXPECT_EQ(cpu.kind(), mfa::DeviceKind::cpu);
  EXPECT_FALSE(cpu.name().empty());
  EXPECT_EQ(cpu.limits().max_threads_per_threadgroup, 1024u);
  EXPECT_EQ(cpu.limits().max_threadgroup_memory, 32u * 1024u);
  EXPECT_EQ(cpu.limits().simd_width, 32u);
  EXPECT_TRUE(mfa::Device::get(mfa::DeviceKind::cpu) == cpu);  // one state per kind
}

TEST(Device, CpuTunesForTheCurrentGenerationWithTwoThreadgroupsPerWorker) {
  const mfa::TuningFacts tuning = mfa::Device::get(mfa::DeviceKind::cpu).tuning();
  EXPECT_EQ(tuning.family, "apple9");
  EXPECT_EQ(tuning.parallel_threadgroups, 2 * mfa::cpu::Executor::shared().workers());
  EXPECT_EQ(tuning.model, "cpu");  // tuned tables are per model: the same whatever the thread count
}

#if !defined(MFA_HAVE_METAL)
TEST(Device, MetalIsCleanlyAbsentWithoutTheBackend) {
  EXPECT_FALSE(mfa::Device::is_available(mfa::DeviceKind::metal));
  const auto devices = mfa::Device::available();
  ASSERT_EQ(devices.size(), 1u);
  EXPECT_EQ(devices[0].kind(), mfa::DeviceKind::cpu);
  try {
    mfa::Device::get(mfa::DeviceKind::metal);
    FAIL() << "expected UnavailableError";
  } catch (const mfa::UnavailableError& e) {
    EXPECT_NE(std::string(e.what()).find("Metal"), std::string::npos);
  }
}

TEST(Device, DefaultIsCpuWhereMetalIsAbsent) {
  ScopedEnv env("MFA_NATIVE_DEVICE", nullptr);
  EXPECT_EQ(mfa::Device::default_device().kind(), mfa::DeviceKind::cpu);
}

TEST(Device, AskingForMetalThroughTheEnvironmentFailsClearly) {
  ScopedEnv env("MFA_NATIVE_DEVICE", "metal");
  EXPECT_THROW(mfa::Device::default_device(), mfa::UnavailableError);
}
#endif

TEST(Device, EnvironmentSelectsTheDefault) {
  ScopedEnv env("MFA_NATIVE_DEVICE", "cpu");
  EXPECT_EQ(mfa::Device::default_device().kind(), mfa::DeviceKind::cpu);
}

TEST(Device, AnUnknownEnvironmentValueIsNamed) {
  ScopedEnv env("MFA_NATIVE_DEVICE", "gpu");
  try {
    mfa::Device::default_device();
    FAIL() << "expected ArgumentError";
  } catch (const mfa::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("MFA_NATIVE_DEVICE"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("gpu"), std::string::npos);
  }
}

TEST(Device, KindNamesRoundTrip) {
  EXPECT_EQ(mfa::device_kind_from_string("cpu"), mfa::DeviceKind::cpu);
  EXPECT_EQ(mfa::device_kind_from_string("metal"), mfa::DeviceKind::metal);
  EXPECT_STREQ(mfa::to_string(mfa::DeviceKind::metal), "metal");
  EXPECT_THROW(mfa::device_kind_from_string("cuda"), mfa::ArgumentError);
}

}  // namespace
