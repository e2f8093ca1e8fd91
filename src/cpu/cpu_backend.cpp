// The cpu backend: MSL text -> C++ (msl_translate) -> shared object
// (kernel_compiler) -> fibers (executor). Host memory is used in place.
#include <algorithm>
#include <cstdlib>
#include <dlfcn.h>
#include <future>
#include <memory>
#include <thread>

#include "core/backends.hpp"
#include "core/tensor_ops.hpp"
#include "executor.hpp"
#include "kernel_compiler.hpp"
#include "mfa/errors.hpp"
#include "mfa/pipeline.hpp"
#include "msl_translate.hpp"

namespace mfa {
namespace {

constexpr std::size_t kPageSize = 4096;
static_assert(mfa_abi::kMaxBuffers == kMaxArgumentIndex + 1, "the kernel ABI holds every [[buffer(i)]] index");
// The cpu backend runs the kernels of the current GPU generation, and keeps
// each worker busy with two threadgroups (one runs while the other waits).
constexpr const char* kTuningFamily = "apple9";
constexpr std::uint32_t kThreadgroupsPerWorker = 2;

class HostStorage final : public BufferStorage {
 public:
  explicit HostStorage(std::size_t bytes)
      : memory_(static_cast<unsigned char*>(std::aligned_alloc(kPageSize, round_up(bytes)))), size_(bytes) {
    if (!memory_) throw std::bad_alloc();
  }
  void* contents() override { return memory_.get(); }
  std::size_t size() const override { return size_; }

 private:
  static std::size_t round_up(std::size_t bytes) { return (bytes + kPageSize - 1) / kPageSize * kPageSize; }
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char[], Free> memory_;
  std::size_t size_;
};

// Caller memory, bound in place: the cpu backend reads and writes it directly.
class WrappedStorage final : public BufferStorage {
 public:
  WrappedStorage(void* data, std::size_t bytes) : data_(data), size_(bytes) {}
  void* contents() override { return data_; }
  std::size_t size() const override { return size_; }

 private:
  void* data_;
  std::size_t size_;
};

struct CpuLibrary final : BackendLibrary {
  std::string source;
  CompileOptions options;
};

// sanitize="address": the kernel is built with AddressSanitizer, which only
// loads into a process the ASan runtime started (the child process of
// runtime/asan_child.py); elsewhere the pipeline has reflection but no binary.
const std::vector<std::string> kAddressFlags = {"-fsanitize=address", "-fno-omit-frame-pointer", "-g"};
bool asan_runtime_loaded() { return dlsym(RTLD_DEFAULT, "__asan_init") != nullptr; }

class CpuPipeline final : public BackendPipeline {
 public:
  // `declared_max` is the kernel's [[max_total_threads_per_threadgroup(N)]], 0 if absent;
  // `binary` is null for a sanitize="address" kernel outside the ASan child.
  CpuPipeline(std::shared_ptr<const cpu::KernelBinary> binary, std::uint32_t declared_max)
      : binary_(std::move(binary)),
        max_threads_(declared_max ? std::min(declared_max, DeviceLimits{}.max_threads_per_threadgroup)
                                  : DeviceLimits{}.max_threads_per_threadgroup) {}
  std::uint32_t max_total_threads_per_threadgroup() const override { return max_threads_; }
  std::size_t argument_size(int index) const override {
    return binary_ && index >= 0 && index < int(mfa_abi::kMaxBuffers) ? binary_->info().argument_bytes[index] : 0;
  }
  const cpu::KernelBinary& binary(const std::string& kernel) const {
    if (!binary_) {
      throw DispatchError(kernel, "built with sanitize='address', it runs in a child process when its "
                                  "mfa_native.Kernel is called, not in a command batch");
    }
    return *binary_;
  }

 private:
  std::shared_ptr<const cpu::KernelBinary> binary_;
  std::uint32_t max_threads_;
};

cpu::Launch make_launch(const Dispatch& dispatch, std::size_t threadgroup_memory_limit) {
  const auto& pipeline = static_cast<const CpuPipeline&>(dispatch.pipeline->backend());
  cpu::Launch launch;
  launch.kernel = dispatch.pipeline->name();
  launch.main = pipeline.binary(launch.kernel).main();
  launch.threadgroups = dispatch.threadgroups;
  launch.threads_per_threadgroup = dispatch.threads_per_threadgroup;
  for (const Binding& binding : dispatch.bindings) {
    if (binding.buffer) {
      launch.buffers[binding.index] = static_cast<unsigned char*>(binding.buffer.data()) + binding.offset;
      launch.buffer_sizes[binding.index] = binding.buffer.size() - binding.offset;
    } else {
      launch.buffers[binding.index] = const_cast<unsigned char*>(binding.bytes.data());
      launch.buffer_sizes[binding.index] = binding.bytes.size();
    }
  }
  launch.threadgroup_memory = dispatch.threadgroup_memory;
  launch.threadgroup_memory_limit = threadgroup_memory_limit;
  for (const ArgumentInfo& argument : dispatch.pipeline->function().arguments) {
    if (argument.kind == ArgumentKind::buffer && argument.is_pointer) {
      launch.traffic.push_back({argument.index, argument.name});
    }
  }
  return launch;
}

class CpuSubmission final : public Submission {
 public:
  explicit CpuSubmission(std::future<std::vector<DispatchStats>> done) : done_(std::move(done)) {}
  std::vector<DispatchStats> wait() override { return done_.get(); }

 private:
  std::future<std::vector<DispatchStats>> done_;
};

class CpuBackend final : public Backend {
 public:
  DeviceKind kind() const override { return DeviceKind::cpu; }
  std::string name() const override {
    return "cpu (MSL on " + std::to_string(cpu::Executor::shared().workers()) + " threads)";
  }
  DeviceLimits limits() const override { return DeviceLimits{}; }
  std::vector<std::pair<std::string, std::string>> properties() const override {
    cpu::KernelCompiler& compiler = cpu::KernelCompiler::shared();
    const cpu::CompilerStats stats = compiler.stats();
    return {{"compiler", compiler.compiler()},
            {"cache_dir", compiler.cache_dir()},
            {"kernels_compiled", std::to_string(stats.compiles)},
            {"kernels_from_disk_cache", std::to_string(stats.disk_hits)},
            {"disk_cache_entries_rebuilt", std::to_string(stats.rebuilt)},
            {"disk_cache_entries_evicted", std::to_string(stats.evicted)},
            {"cache_max_bytes", std::to_string(compiler.max_bytes())},
            {"worker_threads", std::to_string(cpu::Executor::shared().workers())},
            {"fiber_switch", cpu::fiber_switch_implementation()}};
  }

  TuningFacts tuning() const override {
    // MFA_NATIVE_TENSOR_OPS=on has code generation write what an M5 runs; the family stays.
    return {kTuningFamily, kThreadgroupsPerWorker * cpu::Executor::shared().workers(), "cpu",
            cpu_tensor_ops(tensor_ops_setting())};
  }

  std::shared_ptr<BackendLibrary> compile_library(const std::string& source, const CompileOptions& options) override {
    // Translation needs the function-constant values, so the real work
    // happens per pipeline; the library only keeps what that needs.
    auto library = std::make_shared<CpuLibrary>();
    library->source = source;
    library->options = options;
    return library;
  }

  std::shared_ptr<BackendPipeline> make_pipeline(const BackendLibrary& library, const FunctionInfo& function,
                                                 const std::map<int, ConstantValue>& constants) override {
    const auto& cpu_library = static_cast<const CpuLibrary&>(library);
    cpu::TranslateOptions options;
    options.bounds_check = cpu_library.options.bounds_check;
    options.race_check = cpu_library.options.sanitize == "race";
    options.metal_path = function.name + ".metal";
    // Macros act like -D flags: defined before anything else in the unit.
    std::string unit;
    for (const auto& [name, value] : cpu_library.options.macros) unit += "#define " + name + " " + value + "\n";
    const bool address = cpu_library.options.sanitize == "address";
    if (address) unit += "#define MFA_SHIM_ADDRESS_CHECK 1\n";  // redzones after threadgroup variables
    unit += translate_msl(cpu_library.source, function, constants, options);
    std::shared_ptr<const cpu::KernelBinary> binary;
    if (!address) {
      binary = cpu::KernelCompiler::shared().compile(unit, function.name);
    } else if (asan_runtime_loaded()) {
      binary = cpu::KernelCompiler::shared().compile(unit, function.name, kAddressFlags);
    }
    return std::make_shared<CpuPipeline>(std::move(binary), function.max_total_threads_per_threadgroup);
  }

  std::shared_ptr<BufferStorage> allocate(std::size_t bytes) override { return std::make_shared<HostStorage>(bytes); }
  std::shared_ptr<BufferStorage> wrap_host(void* data, std::size_t bytes) override {
    return std::make_shared<WrappedStorage>(data, bytes);
  }
  std::size_t page_size() const override { return kPageSize; }
  std::size_t recommended_pool_limit() const override { return std::size_t(1) << 30; }

  // The work runs in wait(), on the waiting thread (which joins the
  // executor's workers): starting a thread per submission cost more than a
  // small dispatch. CommandBatch always waits, at the latest when destroyed.
  // Every dispatch is timed (its wall time), asked or not.
  std::unique_ptr<Submission> submit(std::vector<Dispatch> dispatches, bool /*time_each_dispatch*/) override {
    const std::size_t limit = limits().max_threadgroup_memory;
    auto run = [dispatches = std::move(dispatches), limit] {
      std::vector<DispatchStats> stats;
      for (const Dispatch& dispatch : dispatches)
        stats.push_back(cpu::Executor::shared().run(make_launch(dispatch, limit)));
      return stats;
    };
    return std::make_unique<CpuSubmission>(std::async(std::launch::deferred, std::move(run)));
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace mfa
