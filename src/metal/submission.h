// A committed command buffer: waiting for it, turning its errors into
// DispatchError and its GPU timestamps into stats. Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <memory>
#include <string>
#include <vector>

#include "mfa/backend.hpp"
#include "metal/dispatch_timer.h"
#include "metal/objc_util.h"

namespace mfa::metal {

// What went wrong with a failed command buffer, in terms of the kernels
// (Metal's own text says little): the cause (GPU timeout, page fault, ...) and Metal's words.
MFA_METAL_AVAILABILITY std::string explain(NSError* error);

class MFA_METAL_AVAILABILITY MetalSubmission final : public Submission {
 public:
  // `command_buffer` is committed and runs `dispatches`, which this object
  // keeps alive (buffers, pipelines) until the GPU is done with them;
  // `timer`, when the batch is timed, is the one they were encoded with.
  MetalSubmission(id<MTLCommandBuffer> command_buffer, std::vector<Dispatch> dispatches,
                  std::unique_ptr<DispatchTimer> timer);
  // Waits if nobody did: the GPU must not outlive the buffers it uses.
  ~MetalSubmission() override;

  // Blocks until the GPU is done. `seconds`: a timed batch's come from each
  // dispatch's sampled timestamps; an untimed batch of one dispatch has the
  // command buffer's GPU start and end times (free), one of several none.
  std::vector<DispatchStats> wait() override;

 private:
  std::string kernel_names() const;

  id<MTLCommandBuffer> command_buffer_;
  std::vector<Dispatch> dispatches_;  // released once the GPU is done
  std::unique_ptr<DispatchTimer> timer_;
  std::vector<DispatchStats> stats_;
};

}  // namespace mfa::metal
