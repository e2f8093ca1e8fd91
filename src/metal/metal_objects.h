// The Metal objects behind the core's backend-neutral handles: a compiled
// library, a pipeline state and a buffer (storage). Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "mfa/backend.hpp"
#include "mfa/pipeline.hpp"
#include "metal/objc_util.h"

namespace mfa::metal {

class MFA_METAL_AVAILABILITY MetalLibrary final : public BackendLibrary {
 public:
  explicit MetalLibrary(id<MTLLibrary> library) : library_(library) {}
  id<MTLLibrary> library() const { return library_; }

 private:
  id<MTLLibrary> library_;
};

class MFA_METAL_AVAILABILITY MetalPipeline final : public BackendPipeline {
 public:
  // `argument_sizes` maps [[buffer(i)]] to the byte size of the type it points or refers to.
  MetalPipeline(id<MTLComputePipelineState> state, std::map<int, std::size_t> argument_sizes)
      : state_(state), argument_sizes_(std::move(argument_sizes)) {}

  std::uint32_t max_total_threads_per_threadgroup() const override {
    return static_cast<std::uint32_t>(state_.maxTotalThreadsPerThreadgroup);
  }
  std::size_t argument_size(int index) const override {
    auto found = argument_sizes_.find(index);
    return found == argument_sizes_.end() ? 0 : found->second;
  }
  id<MTLComputePipelineState> state() const { return state_; }

 private:
  id<MTLComputePipelineState> state_;
  std::map<int, std::size_t> argument_sizes_;
};

// A range of an MTLBuffer: the whole of a buffer the backend allocated or
// wrapped, or `size` bytes from `offset` of a buffer someone else made (a
// DLPack tensor of PyTorch MPS or MLX).
class MFA_METAL_AVAILABILITY MetalStorage final : public BufferStorage {
 public:
  MetalStorage(id<MTLBuffer> buffer, std::size_t offset, std::size_t size)
      : buffer_(buffer), offset_(offset), size_(size) {}

  // nullptr for GPU-private buffers, which the CPU cannot see.
  void* contents() override;
  std::size_t size() const override { return size_; }
  id<MTLBuffer> buffer() const { return buffer_; }
  std::size_t offset() const { return offset_; }

 private:
  id<MTLBuffer> buffer_;
  std::size_t offset_;
  std::size_t size_;
};

// The Metal side of a dispatch's pipeline and buffers. Throw ArgumentError
// naming the kernel when an object belongs to another backend.
MFA_METAL_AVAILABILITY const MetalPipeline& metal_pipeline(const Pipeline& pipeline);
MFA_METAL_AVAILABILITY const MetalStorage& metal_storage(const Binding& binding, const Pipeline& pipeline);

}  // namespace mfa::metal
