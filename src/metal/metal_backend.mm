#include "metal/metal_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "core/backends.hpp"
#include "core/tensor_ops.hpp"
#include "mfa/errors.hpp"
#include "mfa/pipeline.hpp"
#include "metal/dispatch_timer.h"
#include "metal/encoder.h"
#include "metal/metal_compiler.h"
#include "metal/metal_objects.h"
#include "metal/submission.h"

namespace mfa {

namespace metal {

namespace {

// Unified memory the CPU and GPU share. Tracked, so that batches on the
// queue see each other's writes; within a batch the encoder's barriers order
// the dispatches.
constexpr MTLResourceOptions kBufferOptions = MTLResourceStorageModeShared | MTLResourceHazardTrackingModeTracked;

// Threadgroups that keep one GPU core busy, and the core count assumed when
// the registry has none (a 10-core M-series GPU).
constexpr std::uint32_t kThreadgroupsPerCore = 16;
constexpr std::uint32_t kAssumedGpuCores = 10;

std::size_t round_up(std::size_t bytes, std::size_t multiple) { return (bytes + multiple - 1) / multiple * multiple; }

}  // namespace

MetalBackend::MetalBackend(id<MTLDevice> device, id<MTLCommandQueue> queue, DeviceFacts facts)
    : device_(device),
      queue_(queue),
      facts_(std::move(facts)),
      archive_(PipelineArchive::open(device, facts_.macos)),
      page_size_(static_cast<std::size_t>(::sysconf(_SC_PAGESIZE))) {}

std::vector<std::pair<std::string, std::string>> MetalBackend::properties() const {
  return {{"gpu_family", facts_.gpu_family},
          {"architecture", facts_.architecture},
          {"gpu_cores", facts_.gpu_cores ? std::to_string(*facts_.gpu_cores) : "unknown"},
          {"macos", facts_.macos.text()},
          {"metal_language", language_version_name()},
          {"recommended_working_set_mib", std::to_string(facts_.recommended_working_set >> 20)},
          {"page_size", std::to_string(page_size_)},
          {"pipeline_archive", archive_ ? archive_->path() : "off"}};
}

TuningFacts MetalBackend::tuning() const {
  // Families are cumulative: a GPU newer than Apple10 supports Apple10 and reports "apple10".
  const std::string model =
      facts_.gpu_cores ? facts_.name + ", " + std::to_string(*facts_.gpu_cores) + " GPU cores" : facts_.name;
  return {facts_.gpu_family, kThreadgroupsPerCore * facts_.gpu_cores.value_or(kAssumedGpuCores), model,
          facts_.tensor_ops};
}

std::shared_ptr<BackendLibrary> MetalBackend::compile_library(const std::string& source,
                                                              const CompileOptions& options) {
  const bool tensor_op_kernel = uses_tensor_ops(source);
  if (tensor_op_kernel && !facts_.tensor_ops)
    refuse_tensor_op_kernel(facts_.name + " (" + facts_.gpu_family + ", macOS " + facts_.macos.text() + ")",
                            tensor_ops_setting());
  return with_autorelease_pool([&] { return compile_msl(device_, source, options, tensor_op_kernel); });
}

std::shared_ptr<BackendLibrary> MetalBackend::load_library(const std::string& source,
                                                           const std::vector<unsigned char>& binary,
                                                           const CompileOptions& options) {
  // A tensor-op kernel's cooperative-tensor ABI follows the deployment target its
  // .metallib was built for, which a bundle does not record: compile it here instead.
  if (uses_tensor_ops(source)) return compile_library(source, options);
  return with_autorelease_pool([&] { return load_metallib(device_, binary); });
}

std::shared_ptr<BackendPipeline> MetalBackend::make_pipeline(const BackendLibrary& library,
                                                             const FunctionInfo& function,
                                                             const std::map<int, ConstantValue>& constants) {
  const auto* metal_library = dynamic_cast<const MetalLibrary*>(&library);
  if (!metal_library)
    throw ArgumentError("kernel '" + function.name + "': its library was compiled for another device, not metal");
  return with_autorelease_pool(
      [&] { return build_pipeline(device_, *metal_library, function, constants, archive_.get()); });
}

std::shared_ptr<BufferStorage> MetalBackend::allocate(std::size_t bytes) {
  const std::size_t length = round_up(std::max<std::size_t>(bytes, 1), page_size_);
  return with_autorelease_pool([&] {
    id<MTLBuffer> buffer = [device_ newBufferWithLength:length options:kBufferOptions];
    if (!buffer) throw Error("Metal could not allocate a buffer of " + std::to_string(length) + " bytes");
    return std::make_shared<MetalStorage>(buffer, 0, length);
  });
}

std::shared_ptr<BufferStorage> MetalBackend::wrap_host(void* data, std::size_t bytes) {
  if (!data || bytes == 0 || reinterpret_cast<std::uintptr_t>(data) % page_size_ != 0) return nullptr;
  return with_autorelease_pool([&]() -> std::shared_ptr<BufferStorage> {
    id<MTLBuffer> buffer = [device_ newBufferWithBytesNoCopy:data
                                                      length:round_up(bytes, page_size_)
                                                     options:kBufferOptions
                                                 deallocator:nil];
    if (!buffer) return nullptr;  // the core copies instead
    return std::make_shared<MetalStorage>(buffer, 0, bytes);
  });
}

std::size_t MetalBackend::recommended_pool_limit() const {
  return static_cast<std::size_t>(facts_.recommended_working_set / 4);
}

std::unique_ptr<Submission> MetalBackend::submit(std::vector<Dispatch> dispatches, bool time_each_dispatch) {
  return with_autorelease_pool([&]() -> std::unique_ptr<Submission> {
    // The submission keeps every buffer and pipeline alive until the GPU is
    // done, so Metal need not retain them again.
    id<MTLCommandBuffer> command_buffer = [queue_ commandBufferWithUnretainedReferences];
    if (!command_buffer) throw Error("Metal could not create a command buffer");
    command_buffer.label = @"mfa_native batch";
    std::unique_ptr<DispatchTimer> timer =
        time_each_dispatch ? DispatchTimer::make(device_, dispatches.size()) : nullptr;
    encode_dispatches(command_buffer, dispatches, timer.get());
    [command_buffer commit];
    return std::make_unique<MetalSubmission>(command_buffer, std::move(dispatches), std::move(timer));
  });
}

MetalBackend& metal_backend_of(const Device& device, const std::string& what) {
  auto* backend = dynamic_cast<MetalBackend*>(&device.backend());
  if (!backend)
    throw ArgumentError(what + " needs the metal device, but was given the " + to_string(device.kind()) + " device");
  return *backend;
}

}  // namespace metal

std::unique_ptr<Backend> make_metal_backend() {
  if (@available(macOS 14.0, *)) {
    return metal::with_autorelease_pool([]() -> std::unique_ptr<Backend> {
      id<MTLDevice> device = MTLCreateSystemDefaultDevice();
      if (!device) return nullptr;
      metal::DeviceFacts facts = metal::read_device_facts(device);
      // Below Apple7 (for instance the paravirtual GPU of a macOS VM) the
      // generated kernels cannot run: report no Metal device rather than fail later.
      if (facts.gpu_family.empty()) return nullptr;
      id<MTLCommandQueue> queue = [device newCommandQueue];
      if (!queue) return nullptr;
      return std::make_unique<metal::MetalBackend>(device, queue, std::move(facts));
    });
  }
  return nullptr;
}

}  // namespace mfa
