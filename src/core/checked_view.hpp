// A caller's TensorView made ready to bind: its element strides checked (or
// made contiguous), 0 on axes of extent 1, in memory order; once packed
// (view_packing.hpp), the contiguous copy the kernels read instead.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "mfa/buffer.hpp"
#include "mfa/attention.hpp"

namespace mfa {

struct Checked {
  const TensorView* view = nullptr;
  std::string name;
  std::vector<std::int64_t> shape;    // as the kernels read it: a broadcast view's target shape
  std::vector<std::int64_t> strides;
  std::int64_t elements = 0;
  Buffer packed;  // empty: the kernels read view->data in place
};

// "(1, 2, 3)" and "(3,)", as Python prints a tuple of ints.
std::string shape_text(const std::vector<std::int64_t>& shape);

// The element strides of a C-contiguous tensor of `shape`.
std::vector<std::int64_t> contiguous(const std::vector<std::int64_t>& shape);

// Strides of `view` (ArgumentError naming `name`: a negative extent, a wrong count of
// strides, or data null while the view has elements). Negative strides are allowed: such a view is packed.
Checked checked(const TensorView& view, const std::string& name);

// `given` read as `target` (numpy broadcasting: missing leading axes and axes of extent 1
// get stride 0); the caller has checked that it broadcasts.
Checked broadcast(const Checked& given, const std::vector<std::int64_t>& target);

// Whether `view` is C-contiguous (its strides as Checked holds them: 0 on axes of extent 1).
bool is_contiguous(const Checked& view);

// ArgumentError unless `view`, written in place, is C-contiguous (0 strides on axes of extent 1).
void require_contiguous(const Checked& view);

// The element of an int32 view at `index` (one entry per leading axis, any strides), read in place.
std::int64_t int32_at(const Checked& view, std::initializer_list<std::int64_t> index);

// An int32 view's entries in C order, read in place.
std::vector<std::int64_t> int32_entries(const Checked& view);

}  // namespace mfa
