// Metal tensors from other frameworks (PyTorch MPS, MLX) through DLPack: their
// DLTensor::data is an id<MTLBuffer>, used in place with no copy. (CPU DLPack
// tensors go through numpy on the Python side.)
#include <Python.h>

#include <cstdint>
#include <string>

#include "bindings.hpp"
#include "mfa/buffer.hpp"
#include "mfa/device.hpp"
#include "mfa/errors.hpp"
#if defined(MFA_HAVE_METAL)
#include "mfa/metal.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace mfa::bindings {

namespace {

// The DLPack ABI (dlpack.h, unversioned "dltensor" capsules), declared here
// to the letter: these structs are a stable C interface.
struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; null means row-major contiguous
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

// Bytes from the tensor's first element to one past its last.
std::size_t extent_bytes(const DLTensor& t) {
  const std::size_t item = (std::size_t(t.dtype.bits) * t.dtype.lanes + 7) / 8;
  std::size_t last = 0;
  std::int64_t contiguous = 1;
  for (std::int32_t axis = t.ndim - 1; axis >= 0; --axis) {
    const std::int64_t n = t.shape[axis];
    if (n == 0) return 0;
    const std::int64_t stride = t.strides ? t.strides[axis] : contiguous;
    if (stride < 0) throw ArgumentError("DLPack tensors with negative strides are not supported");
    last += std::size_t(n - 1) * std::size_t(stride);
    contiguous *= n;
  }
  return (last + 1) * item;
}

}  // namespace

void bind_dlpack(nb::module_& m) {
  m.attr("DLPACK_METAL") = kDLPackMetal;
  m.def(
      "metal_buffer_from_dlpack",
      [](const Device& device, nb::capsule capsule) -> Buffer {
        if (std::string(capsule.name() ? capsule.name() : "") != "dltensor")
          throw ArgumentError("expected an unconsumed DLPack 'dltensor' capsule");
        const auto* managed = static_cast<const DLManagedTensor*>(capsule.data());
        const DLTensor& tensor = managed->dl_tensor;
        if (tensor.device.device_type != kDLPackMetal)
          throw ArgumentError("DLPack tensor is on device type " + std::to_string(tensor.device.device_type) +
                              ", not Metal (" + std::to_string(kDLPackMetal) + ")");
        const std::size_t bytes = extent_bytes(tensor);
#if defined(MFA_HAVE_METAL)
        return mfa::metal::wrap_buffer(device, tensor.data, std::size_t(tensor.byte_offset), bytes);
#else
        (void)device;
        (void)bytes;
        throw UnavailableError("a Metal DLPack tensor needs the metal device, which this build does not have");
#endif
      },
      "device"_a, "capsule"_a,
      "A Buffer over a kDLMetal DLPack tensor's memory (its id<MTLBuffer> at byte_offset), with no copy.");
}

}  // namespace mfa::bindings
