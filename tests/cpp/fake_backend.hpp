// A backend that compiles nothing and counts what it is asked to do, so the
// core's caches and pool can be tested on their own.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "mfa/backend.hpp"
#include "mfa/errors.hpp"

namespace mfa::testing {

class FakeStorage final : public BufferStorage {
 public:
  explicit FakeStorage(std::size_t bytes) : memory_(bytes) {}
  void* contents() override { return memory_.data(); }
  std::size_t size() const override { return memory_.size(); }

 private:
  std::vector<unsigned char> memory_;
};

class FakePipeline final : public BackendPipeline {
 public:
  std::uint32_t max_total_threads_per_threadgroup() const override { return 1024; }
  std::size_t argument_size(int) const override { return 0; }
};

class FakeBackend final : public Backend {
 public:
  std::atomic<int> libraries_compiled{0};
  std::atomic<int> pipelines_made{0};
  std::atomic<int> allocations{0};
  std::chrono::milliseconds compile_delay{0};

  DeviceKind kind() const override { return DeviceKind::cpu; }
  std::string name() const override { return "fake"; }
  DeviceLimits limits() const override { return {}; }
  std::vector<std::pair<std::string, std::string>> properties() const override { return {}; }
  TuningFacts tuning() const override { return {"apple9", 4, "fake"}; }
  std::shared_ptr<BackendLibrary> compile_library(const std::string& source, const CompileOptions&) override {
    std::this_thread::sleep_for(compile_delay);
    ++libraries_compiled;
    if (source.find("#error") != std::string::npos) throw CompileError("fake compile failed", "line 1: #error");
    return std::make_shared<BackendLibrary>();
  }
  std::atomic<int> libraries_loaded{0};
  std::shared_ptr<BackendLibrary> load_library(const std::string&, const std::vector<unsigned char>&,
                                               const CompileOptions&) override {
    ++libraries_loaded;
    return std::make_shared<BackendLibrary>();
  }
  std::shared_ptr<BackendPipeline> make_pipeline(const BackendLibrary&, const FunctionInfo&,
                                                 const std::map<int, ConstantValue>&) override {
    std::this_thread::sleep_for(compile_delay);
    ++pipelines_made;
    return std::make_shared<FakePipeline>();
  }
  std::shared_ptr<BufferStorage> allocate(std::size_t bytes) override {
    ++allocations;
    return std::make_shared<FakeStorage>(bytes);
  }
  std::shared_ptr<BufferStorage> wrap_host(void*, std::size_t) override { return nullptr; }
  std::size_t page_size() const override { return 4096; }
  std::size_t recommended_pool_limit() const override { return 1 << 20; }
  std::unique_ptr<Submission> submit(std::vector<Dispatch>, bool) override { return nullptr; }
};

}  // namespace mfa::testing
