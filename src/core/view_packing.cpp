#include "view_packing.hpp"

#include <cstring>
#include <limits>

namespace mfa::view_packing {


namespace {

std::vector<std::int64_t> normalized_contiguous(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> strides = contiguous(shape);
  for (std::size_t i = 0; i < shape.size(); ++i)
    if (shape[i] == 1) strides[i] = 0;
  return strides;
}

// Copies every element of `view` (any strides, negative included) in row-major order to `to`.
void copy_elements(const Checked& view, unsigned char* to) {
  const std::vector<std::int64_t>& shape = view.shape;
  const std::size_t item = dtype_size(view.view->dtype);
  const auto* base = static_cast<const unsigned char*>(view.view->data);
  std::vector<std::int64_t> index(shape.size(), 0);
  for (std::int64_t n = 0; n < view.elements; ++n) {
    std::int64_t at = 0;
    for (std::size_t i = 0; i < shape.size(); ++i) at += index[i] * view.strides[i];
    std::memcpy(to + std::size_t(n) * item, base + at * std::int64_t(item), item);
    for (std::size_t i = shape.size(); i-- > 0;) {
      if (++index[i] < shape[i]) break;
      index[i] = 0;
    }
  }
}

}  // namespace

bool in_place(const Checked& view, Reads reads) {
  if (reads == Reads::contiguous) return view.strides == normalized_contiguous(view.shape);
  for (std::int64_t s : view.strides)
    if (s < 0 || s > std::int64_t(std::numeric_limits<std::uint32_t>::max())) return false;
  const std::int64_t last = view.strides.empty() ? 1 : view.strides.back();
  return view.strides.empty() || view.shape.back() == 1 || last == 1 ||
         (reads == Reads::strided_broadcast && last == 0);
}

void make_addressable(const Device& device, Checked& view, Reads reads) {
  if (in_place(view, reads)) return;
  const std::size_t bytes = std::size_t(view.elements) * dtype_size(view.view->dtype);
  view.packed = device.new_buffer(bytes ? bytes : 1);
  if (bytes) copy_elements(view, static_cast<unsigned char*>(view.packed.data()));
  view.strides = normalized_contiguous(view.shape);
  for (std::int64_t s : view.strides)
    if (s > std::int64_t(std::numeric_limits<std::uint32_t>::max()))
      throw ArgumentError(view.name + " has " + std::to_string(view.elements) + " elements: its strides " +
                          shape_text(view.strides) +
                          " do not fit the kernels' 32-bit runtime sizes");
}

}  // namespace mfa::view_packing
