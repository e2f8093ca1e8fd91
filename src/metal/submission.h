// A committed command buffer: waiting for it, turning its errors into
// DispatchError and its GPU timestamps into stats. Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <string>
#include <vector>

#include "mfa/backend.hpp"
#include "metal/objc_util.h"

namespace mfa::metal {

// What went wrong with a failed command buffer, in terms of the kernels
// (Metal's own text says little): the cause (GPU timeout, page fault, ...) and Metal's words.
MFA_METAL_AVAILABILITY std::string explain(NSError* error);

class MFA_METAL_AVAILABILITY MetalSubmission final : public Submission {
 public:
  // `command_buffer` is committed and runs `dispatches`, which this object
  // keeps alive (buffers, pipelines) until the GPU is done with them.
  MetalSubmission(id<MTLCommandBuffer> command_buffer, std::vector<Dispatch> dispatches);
  // Waits if nobody did: the GPU must not outlive the buffers it uses.
  ~MetalSubmission() override;

  // Blocks until the GPU is done. `seconds` comes from the command buffer's
  // GPU start and end times, so it is exact for a batch of one dispatch and
  // left empty when several share the command buffer (Apple GPUs sample
  // timestamps per encoder, not per dispatch).
  std::vector<DispatchStats> wait() override;

 private:
  std::string kernel_names() const;

  id<MTLCommandBuffer> command_buffer_;
  std::vector<Dispatch> dispatches_;  // released once the GPU is done
  std::vector<DispatchStats> stats_;
};

}  // namespace mfa::metal
