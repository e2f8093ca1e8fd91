// The functions of include/mfa/metal.hpp.
#include "mfa/metal.hpp"

#include <string>

#include "mfa/command_batch.hpp"
#include "mfa/errors.hpp"
#include "metal/encoder.h"
#include "metal/metal_backend.h"
#include "metal/metal_objects.h"

namespace mfa::metal {

namespace {

const char* const kNeedsMacOS14 = "the Metal backend needs macOS 14 or later";

// The object behind `pointer` when it is of `protocol`; throws naming `what` otherwise.
id checked_object(void* pointer, Protocol* protocol, const std::string& what, const char* expected) {
  if (!pointer) throw ArgumentError(what + " is null; expected " + expected);
  id object = (__bridge id)pointer;
  if (![object conformsToProtocol:protocol]) throw TypeError(what + " is not " + expected);
  return object;
}

}  // namespace

void encode(const Device& device, std::vector<Dispatch> dispatches, void* command_buffer) {
  if (@available(macOS 14.0, *)) {
    with_autorelease_pool([&] {
      MetalBackend& backend = metal_backend_of(device, "mfa::metal::encode");
      id<MTLCommandBuffer> target = checked_object(command_buffer, @protocol(MTLCommandBuffer),
                                                   "mfa::metal::encode: command_buffer", "an id<MTLCommandBuffer>");
      if (target.device != backend.device())
        throw ArgumentError("mfa::metal::encode: command_buffer belongs to another Metal device");
      if (target.status > MTLCommandBufferStatusEnqueued)
        throw ArgumentError("mfa::metal::encode: command_buffer is already committed");
      for (const Dispatch& dispatch : dispatches) validate_dispatch(device, dispatch);
      encode_dispatches(target, dispatches);
      retain_until_completed(target, std::move(dispatches));
    });
    return;
  }
  throw UnavailableError(kNeedsMacOS14);
}

Buffer wrap_buffer(const Device& device, void* mtl_buffer, std::size_t byte_offset, std::size_t bytes) {
  if (@available(macOS 14.0, *)) {
    return with_autorelease_pool([&] {
      MetalBackend& backend = metal_backend_of(device, "mfa::metal::wrap_buffer");
      id<MTLBuffer> buffer = checked_object(mtl_buffer, @protocol(MTLBuffer), "mfa::metal::wrap_buffer: mtl_buffer",
                                            "an id<MTLBuffer> (a kDLMetal tensor's DLTensor::data)");
      if (buffer.device != backend.device())
        throw ArgumentError("mfa::metal::wrap_buffer: mtl_buffer belongs to another Metal device");
      const std::size_t length = buffer.length;
      if (bytes == 0) throw ArgumentError("mfa::metal::wrap_buffer: bytes must be at least 1");
      if (byte_offset > length || bytes > length - byte_offset)
        throw ArgumentError("mfa::metal::wrap_buffer: byte_offset " + std::to_string(byte_offset) + " + bytes " +
                            std::to_string(bytes) + " runs past the MTLBuffer's " + std::to_string(length) +
                            " bytes");
      return Buffer(std::make_shared<MetalStorage>(buffer, byte_offset, bytes), bytes);
    });
  }
  throw UnavailableError(kNeedsMacOS14);
}

}  // namespace mfa::metal
