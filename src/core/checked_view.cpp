#include "checked_view.hpp"

namespace mfa {

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::float32: return "float32";
    case DType::float16: return "float16";
    case DType::bfloat16: return "bfloat16";
    case DType::bool8: return "bool";
    case DType::int32: return "int32";
    case DType::uint8: return "uint8";
    case DType::uint32: return "uint32";
    case DType::float8_e4m3fn: return "float8_e4m3fn";
    case DType::float8_e5m2: return "float8_e5m2";
  }
  return "?";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::float32: case DType::int32: case DType::uint32: return 4;
    case DType::float16: case DType::bfloat16: return 2;
    case DType::bool8: case DType::uint8: case DType::float8_e4m3fn: case DType::float8_e5m2: return 1;
  }
  return 0;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + (shape.size() == 1 ? ",)" : ")");
}

std::vector<std::int64_t> contiguous(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> strides(shape.size());
  std::int64_t running = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = running;
    running *= shape[i] > 0 ? shape[i] : 1;
  }
  return strides;
}

Checked checked(const TensorView& view, const std::string& name) {
  Checked out{&view, name, view.shape, {}, 1, {}};
  for (std::int64_t n : view.shape) {
    if (n < 0) throw ArgumentError(name + " has a negative extent: shape " + shape_text(view.shape));
    out.elements *= n;
  }
  if (view.strides.empty()) {
    out.strides = contiguous(view.shape);
  } else {
    if (view.strides.size() != view.shape.size())
      throw ArgumentError(name + " has " + std::to_string(view.strides.size()) + " strides for " +
                          std::to_string(view.shape.size()) + " dimensions");
    out.strides = view.strides;
  }
  for (std::size_t i = 0; i < view.shape.size(); ++i)
    if (view.shape[i] == 1) out.strides[i] = 0;
  if (out.elements > 0 && view.data == nullptr) throw ArgumentError(name + " has elements but its data is null");
  return out;
}

Checked broadcast(const Checked& given, const std::vector<std::int64_t>& target) {
  Checked out{given.view, given.name, target, std::vector<std::int64_t>(target.size(), 0), 1, given.packed};
  const std::size_t offset = target.size() - given.view->shape.size();
  for (std::size_t i = 0; i < target.size(); ++i) {
    out.elements *= target[i];
    if (i < offset) continue;
    const std::int64_t n = given.view->shape[i - offset];
    out.strides[i] = (n == 1 || target[i] == 1) ? 0 : given.strides[i - offset];
  }
  return out;
}

bool is_contiguous(const Checked& view) {
  std::vector<std::int64_t> dense = contiguous(view.shape);
  for (std::size_t i = 0; i < view.shape.size(); ++i)
    if (view.shape[i] == 1) dense[i] = 0;
  return view.strides == dense;
}

void require_contiguous(const Checked& view) {
  if (view.elements && !is_contiguous(view))  // an empty view is written nowhere: any strides (numpy gives 0s) do
    throw ArgumentError(view.name + " must be contiguous (it is written in place), got strides " +
                        shape_text(view.view->strides));
}

std::int64_t int32_at(const Checked& view, std::initializer_list<std::int64_t> index) {
  std::int64_t at = 0;
  std::size_t axis = 0;
  for (std::int64_t i : index) at += i * view.strides[axis++];
  return static_cast<const std::int32_t*>(view.view->data)[at];
}

std::vector<std::int64_t> int32_entries(const Checked& view) {
  const auto* values = static_cast<const std::int32_t*>(view.view->data);
  std::vector<std::int64_t> entries(static_cast<std::size_t>(view.elements));
  for (std::int64_t i = 0; i < view.elements; ++i) {
    std::int64_t offset = 0, rest = i;
    for (std::size_t axis = view.shape.size(); axis-- > 0;) {
      offset += (rest % view.shape[axis]) * view.strides[axis];
      rest /= view.shape[axis];
    }
    entries[std::size_t(i)] = values[offset];
  }
  return entries;
}

}  // namespace mfa
