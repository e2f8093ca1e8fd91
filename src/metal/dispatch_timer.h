// Each dispatch's GPU time, for batches committed while DispatchTiming is
// requested. Apple GPUs sample counters only at stage boundaries, so a timed
// batch gives every dispatch its own compute encoder, whose start and end
// sample the timestamp counter into one counter sample buffer. GPU ticks
// become seconds by the GPU clock's pace against the host's steady clock,
// both read when the batch is encoded and again once it completed
// (sampleTimestamps:gpuTimestamp:). Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <chrono>
#include <cstdint>
#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "metal/objc_util.h"

namespace mfa::metal {

class MFA_METAL_AVAILABILITY DispatchTimer {
 public:
  // nullptr when the device cannot sample timestamps at stage boundaries or
  // the sample buffer cannot be made: the batch then runs untimed.
  static std::unique_ptr<DispatchTimer> make(id<MTLDevice> device, std::size_t dispatches);

  DispatchTimer(id<MTLDevice> device, id<MTLCounterSampleBuffer> samples, std::size_t dispatches);

  // The pass of dispatch `index`'s own encoder: it samples the encoder's start and end.
  MTLComputePassDescriptor* pass(std::size_t index) const;

  // Once the command buffer completed: each dispatch's GPU seconds, empty
  // where the GPU did not sample it.
  std::vector<std::optional<double>> seconds() const;

 private:
  id<MTLDevice> device_;
  id<MTLCounterSampleBuffer> samples_;
  std::size_t dispatches_;
  MTLTimestamp gpu_start_ = 0;
  std::chrono::steady_clock::time_point host_start_;
};

}  // namespace mfa::metal
