// The Metal backend: mfa::Backend over one MTLDevice and its command queue.
// The core around it does caching, pooling, validation and host staging.
// Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mfa/backend.hpp"
#include "mfa/device.hpp"
#include "metal/device_facts.h"
#include "metal/objc_util.h"
#include "metal/pipeline_archive.h"

namespace mfa::metal {

class MFA_METAL_AVAILABILITY MetalBackend final : public Backend {
 public:
  MetalBackend(id<MTLDevice> device, id<MTLCommandQueue> queue, DeviceFacts facts);

  DeviceKind kind() const override { return DeviceKind::metal; }
  std::string name() const override { return facts_.name; }
  DeviceLimits limits() const override { return facts_.limits; }
  std::vector<std::pair<std::string, std::string>> properties() const override;
  TuningFacts tuning() const override;

  std::shared_ptr<BackendLibrary> compile_library(const std::string& source, const CompileOptions& options) override;
  // `binary` is a .metallib's bytes; the source is not compiled.
  std::shared_ptr<BackendLibrary> load_library(const std::string& source, const std::vector<unsigned char>& binary,
                                               const CompileOptions& options) override;
  std::shared_ptr<BackendPipeline> make_pipeline(const BackendLibrary& library, const FunctionInfo& function,
                                                 const std::map<int, ConstantValue>& constants) override;

  // Shared storage (unified memory), page-rounded; the core's pool buckets it.
  std::shared_ptr<BufferStorage> allocate(std::size_t bytes) override;
  // Page-aligned memory is wrapped with no copy; the wrapped length is
  // rounded up to whole pages, which lie in memory already mapped.
  std::shared_ptr<BufferStorage> wrap_host(void* data, std::size_t bytes) override;
  std::size_t page_size() const override { return page_size_; }
  // Free buffers the pool may keep: a quarter of the GPU's recommended working set.
  std::size_t recommended_pool_limit() const override;

  // One command buffer, one compute encoder, committed before returning.
  std::unique_ptr<Submission> submit(std::vector<Dispatch> dispatches, bool time_each_dispatch) override;

  id<MTLDevice> device() const { return device_; }

 private:
  id<MTLDevice> device_;
  id<MTLCommandQueue> queue_;
  DeviceFacts facts_;
  std::unique_ptr<PipelineArchive> archive_;  // nullptr when switched off
  std::size_t page_size_;
};

// The Metal backend behind `device`; throws ArgumentError saying that `what`
// needs the metal device when it is another.
MFA_METAL_AVAILABILITY MetalBackend& metal_backend_of(const Device& device, const std::string& what);

}  // namespace mfa::metal
