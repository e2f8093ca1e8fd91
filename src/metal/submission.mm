#include "metal/submission.h"

#include <utility>

#include "mfa/errors.hpp"
#include "mfa/pipeline.hpp"

namespace mfa::metal {

std::string explain(NSError* error) {
  if (!error || ![error.domain isEqualToString:MTLCommandBufferErrorDomain]) return describe(error);
  std::string hint;
  switch (static_cast<MTLCommandBufferError>(error.code)) {
    case MTLCommandBufferErrorTimeout:
      hint = "the GPU timed out: a kernel ran too long or never finished (a loop that does not end?)";
      break;
    case MTLCommandBufferErrorPageFault:
      hint = "GPU page fault: a kernel read or wrote outside its buffers";
      break;
    case MTLCommandBufferErrorOutOfMemory:
      hint = "the GPU ran out of memory";
      break;
    case MTLCommandBufferErrorInvalidResource:
      hint = "a buffer was freed or made invalid while the GPU used it";
      break;
    case MTLCommandBufferErrorStackOverflow:
      hint = "a kernel overflowed its stack";
      break;
    default:
      break;
  }
  const std::string detail = describe(error);
  return hint.empty() ? detail : hint + " (" + detail + ")";
}

MetalSubmission::MetalSubmission(id<MTLCommandBuffer> command_buffer, std::vector<Dispatch> dispatches,
                                 std::unique_ptr<DispatchTimer> timer)
    : command_buffer_(command_buffer),
      dispatches_(std::move(dispatches)),
      timer_(std::move(timer)),
      stats_(dispatches_.size()) {
  for (std::size_t i = 0; i < dispatches_.size(); ++i) {
    stats_[i].kernel = dispatches_[i].pipeline->name();
    stats_[i].threadgroups = dispatches_[i].threadgroups.volume();
  }
}

MetalSubmission::~MetalSubmission() { [command_buffer_ waitUntilCompleted]; }

std::string MetalSubmission::kernel_names() const {
  std::string names;
  for (const DispatchStats& stats : stats_) names += (names.empty() ? "" : ", ") + stats.kernel;
  return names;
}

std::vector<DispatchStats> MetalSubmission::wait() {
  return with_autorelease_pool([&] {
    [command_buffer_ waitUntilCompleted];
    dispatches_.clear();  // the GPU is done: pooled buffers may go back
    if (command_buffer_.status == MTLCommandBufferStatusError) {
      // Metal reports failures per command buffer, so with several
      // dispatches the culprit is one of them.
      const std::string where = stats_.size() == 1
                                    ? std::string()
                                    : "one of the " + std::to_string(stats_.size()) + " dispatches of its batch: ";
      throw DispatchError(kernel_names(), where + explain(command_buffer_.error));
    }
    if (timer_) {
      const std::vector<std::optional<double>> seconds = timer_->seconds();
      for (std::size_t i = 0; i < stats_.size(); ++i) stats_[i].seconds = seconds[i];
    } else if (stats_.size() == 1) {
      stats_.front().seconds = command_buffer_.GPUEndTime - command_buffer_.GPUStartTime;
    }
    return stats_;
  });
}

}  // namespace mfa::metal
