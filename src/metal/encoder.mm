#include "metal/encoder.h"

#include <memory>
#include <string>
#include <utility>

#include "core/dispatch_order.hpp"
#include "mfa/errors.hpp"
#include "mfa/pipeline.hpp"
#include "metal/metal_objects.h"

namespace mfa::metal {

namespace {

MTLSize to_mtl_size(const Size3& size) { return MTLSizeMake(size.x, size.y, size.z); }

MFA_METAL_AVAILABILITY void check_encodable(const Dispatch& dispatch, id<MTLDevice> device) {
  if (!dispatch.pipeline) throw ArgumentError("a dispatch has no pipeline");
  metal_pipeline(*dispatch.pipeline);
  for (const Binding& binding : dispatch.bindings) {
    if (!binding.buffer) continue;
    if (metal_storage(binding, *dispatch.pipeline).buffer().device != device)
      throw ArgumentError("kernel '" + dispatch.pipeline->name() + "': buffer(" + std::to_string(binding.index) +
                          ") lives on another Metal device than the command buffer");
  }
}

MFA_METAL_AVAILABILITY void encode_one(id<MTLComputeCommandEncoder> encoder, const Dispatch& dispatch) {
  [encoder setComputePipelineState:metal_pipeline(*dispatch.pipeline).state()];
  for (const Binding& binding : dispatch.bindings) {
    const auto index = static_cast<NSUInteger>(binding.index);
    if (binding.buffer) {
      const MetalStorage& storage = metal_storage(binding, *dispatch.pipeline);
      [encoder setBuffer:storage.buffer() offset:storage.offset() + binding.offset atIndex:index];
    } else {
      [encoder setBytes:binding.bytes.data() length:binding.bytes.size() atIndex:index];
    }
  }
  for (std::size_t index = 0; index < dispatch.threadgroup_memory.size(); ++index) {
    const NSUInteger length = dispatch.threadgroup_memory[index];
    if (length == 0) continue;  // an index the kernel does not use
    const NSUInteger granule = kThreadgroupMemoryGranule;
    const NSUInteger rounded = (length + granule - 1) / granule * granule;
    [encoder setThreadgroupMemoryLength:rounded atIndex:index];
  }
  [encoder dispatchThreadgroups:to_mtl_size(dispatch.threadgroups)
          threadsPerThreadgroup:to_mtl_size(dispatch.threads_per_threadgroup)];
}

id<MTLComputeCommandEncoder> checked(id<MTLComputeCommandEncoder> encoder) {
  if (!encoder)
    throw ArgumentError("the command buffer cannot take a compute encoder: it is already committed "
                        "or another encoder on it is still open");
  return encoder;
}

// Concurrent dispatch plus explicit barriers where a dispatch depends on an
// earlier one: the order then holds for untracked buffers (a framework may
// hand those over) as for tracked ones, and independent dispatches overlap.
MFA_METAL_AVAILABILITY void encode_concurrent(id<MTLCommandBuffer> command_buffer,
                                              const std::vector<Dispatch>& dispatches) {
  id<MTLComputeCommandEncoder> encoder =
      checked([command_buffer computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent]);
  const std::vector<bool> barriers = barriers_before(dispatches);
  for (std::size_t i = 0; i < dispatches.size(); ++i) {
    if (barriers[i]) [encoder memoryBarrierWithScope:MTLBarrierScopeBuffers];
    encode_one(encoder, dispatches[i]);
  }
  [encoder endEncoding];
}

// One encoder per dispatch, its start and end sampled by `timer`; each waits
// for the fence the one before updated, so the order holds for untracked
// buffers too and no two dispatches overlap (each sample pair brackets one).
MFA_METAL_AVAILABILITY void encode_timed(id<MTLCommandBuffer> command_buffer, const std::vector<Dispatch>& dispatches,
                                         const DispatchTimer& timer) {
  id<MTLFence> fence = [command_buffer.device newFence];
  if (!fence) throw Error("Metal could not create a fence for a timed batch");
  for (std::size_t i = 0; i < dispatches.size(); ++i) {
    id<MTLComputeCommandEncoder> encoder = checked([command_buffer computeCommandEncoderWithDescriptor:timer.pass(i)]);
    if (i > 0) [encoder waitForFence:fence];
    encode_one(encoder, dispatches[i]);
    [encoder updateFence:fence];
    [encoder endEncoding];
  }
}

}  // namespace

void encode_dispatches(id<MTLCommandBuffer> command_buffer, const std::vector<Dispatch>& dispatches,
                       const DispatchTimer* timer) {
  for (const Dispatch& dispatch : dispatches) check_encodable(dispatch, command_buffer.device);
  if (timer)
    encode_timed(command_buffer, dispatches, *timer);
  else
    encode_concurrent(command_buffer, dispatches);
}

void retain_until_completed(id<MTLCommandBuffer> command_buffer, std::vector<Dispatch> dispatches) {
  // The block holds this reference until Metal releases it after completion.
  auto in_flight = std::make_shared<const std::vector<Dispatch>>(std::move(dispatches));
  [command_buffer addCompletedHandler:^(id<MTLCommandBuffer>) {
    (void)in_flight;
  }];
}

}  // namespace mfa::metal
