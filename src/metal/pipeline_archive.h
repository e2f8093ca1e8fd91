// An on-disk MTLBinaryArchive of compiled pipelines: a later process that
// builds the same pipeline loads its GPU binary instead of compiling it again.
// Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "core/tensor_ops.hpp"
#include "metal/objc_util.h"

namespace mfa::metal {

class MFA_METAL_AVAILABILITY PipelineArchive {
 public:
  // The archive for this device and macOS release (major.minor.patch: a
  // pipeline compiled on 26.0 is never loaded on 26.2) under the user cache
  // directory ($MFA_NATIVE_CACHE_DIR/metal, else ~/Library/Caches/mfa_native/metal).
  // nullptr when MFA_NATIVE_METAL_ARCHIVE=0 or no archive can be made there.
  // A file Metal cannot load (corrupt, truncated) is deleted and started afresh.
  static std::unique_ptr<PipelineArchive> open(id<MTLDevice> device, const MacosVersion& macos);

  // The pipeline from the archive, or nil when the archive does not hold it.
  id<MTLComputePipelineState> find(MTLComputePipelineDescriptor* descriptor, MTLPipelineOption options,
                                   MTLAutoreleasedComputePipelineReflection* reflection);
  // Adds a pipeline that was just compiled and rewrites the file. A failure
  // only costs a compile in a later process, so it is not an error.
  void add(MTLComputePipelineDescriptor* descriptor);

  const std::string& path() const { return path_; }

 private:
  PipelineArchive(id<MTLDevice> device, id<MTLBinaryArchive> archive, std::string path)
      : device_(device), archive_(archive), path_(std::move(path)) {}

  id<MTLDevice> device_;
  id<MTLBinaryArchive> archive_;  // guarded by mutex_: Metal does not promise thread safety here
  std::string path_;
  std::mutex mutex_;
};

}  // namespace mfa::metal
