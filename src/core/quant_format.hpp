// Quantized storage formats (python/mfa_native/quant_formats.py's QuantFormat) as
// the C++ ops check them: quantize's format argument and a KV cache's
// QuantizedTensor read the same table, with Python's messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mfa/attention.hpp"

namespace mfa::quant_format {

constexpr std::int64_t kGgufBlock = 32;  // values per GGUF block

// quant_formats.py's QuantFormat: the name, bits and group size a call names, checked.
struct Format {
  std::string name;
  std::int64_t bits = 0, group_size = 0, block_bytes = 0;  // block_bytes: GGUF's (0: affine)

  bool affine() const { return name == "affine"; }
  std::string describe() const {
    return affine() ? name + " " + std::to_string(bits) + "-bit, groups of " + std::to_string(group_size) : name;
  }
  DType data_dtype() const { return affine() ? DType::uint32 : DType::uint8; }
  // data's elements per row of `features` values (uint32 words, or bytes of blocks).
  std::int64_t data_width(std::int64_t features) const {
    return affine() ? features * bits / 32 : features / kGgufBlock * block_bytes;
  }
  // The values a row of `width` data elements holds (QuantizedTensor's `features`).
  std::int64_t features(std::int64_t width) const {
    return affine() ? width * 32 / bits : width / block_bytes * kGgufBlock;
  }
};

// The format `name` (GGUF's fix bits and group size: nullopt takes them; affine's default
// to 8 and 64); ArgumentError with QuantFormat's message for an unknown name, bits or group size.
Format format_of(const std::string& name, std::optional<std::int64_t> bits, std::optional<std::int64_t> group_size);

}  // namespace mfa::quant_format
