#include "metal/device_facts.h"

#include <IOKit/IOKitLib.h>

#include <utility>

namespace mfa::metal {

namespace {

// The newest Apple GPU family the device supports, from Apple10 down to
// Apple7 (M1). Older families lack what the generated kernels rely on.
MFA_METAL_AVAILABILITY std::string apple_gpu_family(id<MTLDevice> device) {
  if (@available(macOS 26.0, *)) {
    // MTLGPUFamilyApple10; not every macOS 26 SDK names it yet.
    if ([device supportsFamily:static_cast<MTLGPUFamily>(1010)]) return "apple10";
  }
  const std::pair<MTLGPUFamily, const char*> families[] = {
      {MTLGPUFamilyApple9, "apple9"}, {MTLGPUFamilyApple8, "apple8"}, {MTLGPUFamilyApple7, "apple7"}};
  for (const auto& [family, name] : families)
    if ([device supportsFamily:family]) return name;
  return "";
}

// The GPU core count is not in the Metal API; the GPU's IORegistry entry
// (the one registryID names, or a parent) carries it as "gpu-core-count".
MFA_METAL_AVAILABILITY std::optional<std::uint32_t> gpu_core_count(id<MTLDevice> device) {
  io_registry_entry_t entry =
      IOServiceGetMatchingService(kIOMainPortDefault, IORegistryEntryIDMatching(device.registryID));
  if (entry == IO_OBJECT_NULL) return std::nullopt;
  CFTypeRef value = IORegistryEntrySearchCFProperty(entry, kIOServicePlane, CFSTR("gpu-core-count"),
                                                    kCFAllocatorDefault,
                                                    kIORegistryIterateRecursively | kIORegistryIterateParents);
  IOObjectRelease(entry);
  id count = CFBridgingRelease(value);  // ARC owns it from here; nil stays nil
  if (![count isKindOfClass:[NSNumber class]]) return std::nullopt;
  return [static_cast<NSNumber*>(count) unsignedIntValue];
}

MacosVersion running_macos() {
  const NSOperatingSystemVersion os = NSProcessInfo.processInfo.operatingSystemVersion;
  return {static_cast<int>(os.majorVersion), static_cast<int>(os.minorVersion), static_cast<int>(os.patchVersion)};
}

}  // namespace

DeviceFacts read_device_facts(id<MTLDevice> device) {
  DeviceFacts facts;
  facts.name = to_std_string(device.name);
  facts.gpu_family = apple_gpu_family(device);
  facts.architecture = to_std_string(device.architecture.name);
  facts.gpu_cores = gpu_core_count(device);
  // maxThreadsPerThreadgroup is per axis; Apple GPUs allow the same total.
  facts.limits.max_threads_per_threadgroup = static_cast<std::uint32_t>(device.maxThreadsPerThreadgroup.width);
  facts.limits.max_threadgroup_memory = device.maxThreadgroupMemoryLength;
  facts.recommended_working_set = device.recommendedMaxWorkingSetSize;
  facts.macos = running_macos();
  facts.tensor_ops = metal_tensor_ops(facts.gpu_family == "apple10", facts.macos, tensor_ops_setting());
  return facts;
}

}  // namespace mfa::metal
