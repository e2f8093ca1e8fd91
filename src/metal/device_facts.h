// What the backend reports about its GPU: family, architecture, core count,
// limits, the macOS release and whether it runs Metal 4 tensor ops.
// Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <cstdint>
#include <optional>
#include <string>

#include "core/tensor_ops.hpp"
#include "mfa/types.hpp"
#include "metal/objc_util.h"

namespace mfa::metal {

struct DeviceFacts {
  std::string name;                        // e.g. "Apple M2 Pro"
  std::string gpu_family;                  // "apple7" .. "apple10"; empty for GPUs below Apple7
  std::string architecture;                // e.g. "applegpu_g14s"
  std::optional<std::uint32_t> gpu_cores;  // empty where the registry has no count
  DeviceLimits limits;
  std::uint64_t recommended_working_set = 0;  // bytes the GPU can use without hurting performance
  MacosVersion macos;                         // the running release: GPU binaries are valid for it only
  bool tensor_ops = false;                    // Apple10 on macOS 26.2+, unless MFA_NATIVE_TENSOR_OPS=off
};

MFA_METAL_AVAILABILITY DeviceFacts read_device_facts(id<MTLDevice> device);

}  // namespace mfa::metal
