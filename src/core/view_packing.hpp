// Which caller views the kernels read in place, and a contiguous copy of the
// others: the C++ twin of python/mfa_native/ops/arguments.py's usable_in_place /
// bindable (one rule). A bundle's kernels take q, k, v, the mask, o and dout
// strides at run time, so those views run in place when every stride is
// non-negative and fits the kernels' 32-bit sizes and the innermost axis is
// unit (a mask's may be 0: broadcast over the keys); lse and sinks are read
// contiguous. Any other view is copied into a buffer from the device's pool
// before the pass.
#pragma once

#include "checked_view.hpp"
#include "mfa/device.hpp"

namespace mfa::view_packing {

enum class Reads {
  strided,            // any non-negative strides, a unit innermost axis
  strided_broadcast,  // the same, or stride 0 on the innermost axis (a mask)
  contiguous,         // row-major only
};

// Whether the kernels address `view` (strides as Checked holds them) in place.
bool in_place(const Checked& view, Reads reads);

// Packs `view` into a contiguous pool buffer unless the kernels address it in
// place: afterwards view.packed holds the copy and view.strides its strides.
void make_addressable(const Device& device, Checked& view, Reads reads);

}  // namespace mfa::view_packing
