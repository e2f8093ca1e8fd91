// Encodes a batch of dispatches into a command buffer: one concurrent compute
// encoder, dispatches in order, a buffer barrier before each dispatch that
// depends on an earlier one (barriers_before); or, timed, one encoder per
// dispatch that a DispatchTimer samples. Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <vector>

#include "mfa/backend.hpp"
#include "metal/dispatch_timer.h"
#include "metal/objc_util.h"

namespace mfa::metal {

// Checks every dispatch first and throws ArgumentError naming the kernel (a
// pipeline or buffer of another device, a command buffer that cannot take an
// encoder) before anything is encoded. The caller keeps the dispatches (their
// buffers and pipelines) alive until the command buffer completes. With a
// `timer` (made for these dispatches), each dispatch gets its own encoder,
// sampled by it, ordered after the one before by a fence.
MFA_METAL_AVAILABILITY void encode_dispatches(id<MTLCommandBuffer> command_buffer,
                                              const std::vector<Dispatch>& dispatches,
                                              const DispatchTimer* timer = nullptr);

// For command buffers mfa does not wait for: a completion handler owns the
// dispatches, so their buffers go back to the pool once the GPU is done.
MFA_METAL_AVAILABILITY void retain_until_completed(id<MTLCommandBuffer> command_buffer,
                                                   std::vector<Dispatch> dispatches);

}  // namespace mfa::metal
