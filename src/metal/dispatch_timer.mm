#include "metal/dispatch_timer.h"

namespace mfa::metal {

namespace {

// The device's timestamp counter set, or nil where it cannot be sampled at stage boundaries.
MFA_METAL_AVAILABILITY id<MTLCounterSet> timestamp_counters(id<MTLDevice> device) {
  if (![device supportsCounterSampling:MTLCounterSamplingPointAtStageBoundary]) return nil;
  for (id<MTLCounterSet> set in device.counterSets)
    if ([set.name isEqualToString:MTLCommonCounterSetTimestamp]) return set;
  return nil;
}

}  // namespace

std::unique_ptr<DispatchTimer> DispatchTimer::make(id<MTLDevice> device, std::size_t dispatches) {
  id<MTLCounterSet> counters = timestamp_counters(device);
  if (!counters || dispatches == 0) return nullptr;
  MTLCounterSampleBufferDescriptor* descriptor = [[MTLCounterSampleBufferDescriptor alloc] init];
  descriptor.counterSet = counters;
  descriptor.storageMode = MTLStorageModeShared;
  descriptor.sampleCount = 2 * dispatches;  // a start and an end per dispatch
  descriptor.label = @"mfa_native dispatch timestamps";
  NSError* error = nil;
  id<MTLCounterSampleBuffer> samples = [device newCounterSampleBufferWithDescriptor:descriptor error:&error];
  if (!samples) return nullptr;
  return std::make_unique<DispatchTimer>(device, samples, dispatches);
}

DispatchTimer::DispatchTimer(id<MTLDevice> device, id<MTLCounterSampleBuffer> samples, std::size_t dispatches)
    : device_(device), samples_(samples), dispatches_(dispatches) {
  MTLTimestamp cpu = 0;
  [device_ sampleTimestamps:&cpu gpuTimestamp:&gpu_start_];
  host_start_ = std::chrono::steady_clock::now();
}

MTLComputePassDescriptor* DispatchTimer::pass(std::size_t index) const {
  MTLComputePassDescriptor* pass = [MTLComputePassDescriptor computePassDescriptor];
  pass.dispatchType = MTLDispatchTypeSerial;
  MTLComputePassSampleBufferAttachmentDescriptor* attachment = pass.sampleBufferAttachments[0];
  attachment.sampleBuffer = samples_;
  attachment.startOfEncoderSampleIndex = 2 * index;
  attachment.endOfEncoderSampleIndex = 2 * index + 1;
  return pass;
}

std::vector<std::optional<double>> DispatchTimer::seconds() const {
  MTLTimestamp cpu = 0, gpu_end = 0;
  [device_ sampleTimestamps:&cpu gpuTimestamp:&gpu_end];
  const double host_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start_).count();
  std::vector<std::optional<double>> seconds(dispatches_);
  NSData* resolved = [samples_ resolveCounterRange:NSMakeRange(0, 2 * dispatches_)];
  if (!resolved || resolved.length < 2 * dispatches_ * sizeof(MTLCounterResultTimestamp) || gpu_end <= gpu_start_)
    return seconds;
  const double seconds_per_tick = host_seconds / static_cast<double>(gpu_end - gpu_start_);
  const auto* stamps = static_cast<const MTLCounterResultTimestamp*>(resolved.bytes);
  for (std::size_t i = 0; i < dispatches_; ++i) {
    const std::uint64_t start = stamps[2 * i].timestamp, end = stamps[2 * i + 1].timestamp;
    if (start == MTLCounterErrorValue || end == MTLCounterErrorValue || end < start) continue;
    seconds[i] = static_cast<double>(end - start) * seconds_per_tick;
  }
  return seconds;
}

}  // namespace mfa::metal
