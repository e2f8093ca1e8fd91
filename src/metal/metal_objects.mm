#include "metal/metal_objects.h"

#include "mfa/errors.hpp"

namespace mfa::metal {

void* MetalStorage::contents() {
  void* base = buffer_.contents;
  return base ? static_cast<unsigned char*>(base) + offset_ : nullptr;
}

const MetalPipeline& metal_pipeline(const Pipeline& pipeline) {
  const auto* metal = dynamic_cast<const MetalPipeline*>(&pipeline.backend());
  if (!metal)
    throw ArgumentError("kernel '" + pipeline.name() + "': its pipeline was built for another device, not metal");
  return *metal;
}

const MetalStorage& metal_storage(const Binding& binding, const Pipeline& pipeline) {
  const auto* metal = dynamic_cast<const MetalStorage*>(binding.buffer.storage());
  if (!metal)
    throw ArgumentError("kernel '" + pipeline.name() + "': buffer(" + std::to_string(binding.index) +
                        ") is not a Metal buffer (it belongs to another device)");
  return *metal;
}

}  // namespace mfa::metal
