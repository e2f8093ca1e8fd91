// quantize for C++ programs, without Python: Python's mfa_native.quantize run
// from a bundle whose spec has a "quantize" family.
//
//   mfa::quantize(device, bundle, x, {data}, "q8_0");                    // GGUF blocks
//   mfa::quantize(device, bundle, x, {data, scales, biases}, "affine", 4, 64);
//
// x quantized along its last axis, as MLX's mx.quantize ("affine") or GGUF's
// reference quantizers ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1") do, in float32
// on the device; formats, arguments and messages are Python's, and on the cpu
// backend the fields are bit-identical to Python's. A bundle entry fixes x's
// dtype and the format (with its bits and group size); x's shape is a runtime
// value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mfa/attention.hpp"

namespace mfa {

// The fields quantize writes (Python's QuantizedTensor's), caller memory, contiguous, rows
// x.shape[:-1]: `data` uint32 (rows..., D * bits / 32) for "affine", uint8 (rows..., D / 32 *
// block bytes: 34, 18, 20, 22, 24) for a GGUF format; `scales` and `biases` (rows...,
// D / group_size) in x's dtype for "affine" (required), absent for GGUF (its scales live in
// its blocks).
struct QuantizeOutputs {
  TensorView data;
  std::optional<TensorView> scales;
  std::optional<TensorView> biases;
};

// x: float32, float16 or bfloat16, any shape whose last axis is a positive multiple of the
// group size, any strides (copied to a contiguous pool buffer first where not contiguous, as
// Python copies it). bits: affine 2, 3, 4, 5, 6 or 8 (default 8), GGUF none or its own;
// group_size: affine 32, 64 or 128 (default 64), GGUF none or 32. Throws TypeError /
// ArgumentError (Python's message) or NoBundleEntryError before anything runs;
// DispatchError / CompileError from the device.
void quantize(const Device& device, const Bundle& bundle, const TensorView& x, const QuantizeOutputs& out,
              const std::string& format = "affine", std::optional<std::int64_t> bits = std::nullopt,
              std::optional<std::int64_t> group_size = std::nullopt);
// The same, encoded into the caller's batch (see attention's).
void quantize(CommandBatch& batch, const Bundle& bundle, const TensorView& x, const QuantizeOutputs& out,
              const std::string& format = "affine", std::optional<std::int64_t> bits = std::nullopt,
              std::optional<std::int64_t> group_size = std::nullopt);

}  // namespace mfa
