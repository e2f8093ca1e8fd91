#include "quant_format.hpp"

namespace mfa::quant_format {

namespace {

struct Gguf {
  const char* name;
  std::int64_t bits, bytes;  // per block of 32 values
};
// quant_formats.py's GGUF_BLOCKS, in its order.
constexpr Gguf kGguf[] = {{"q8_0", 8, 34}, {"q4_0", 4, 18}, {"q4_1", 4, 20}, {"q5_0", 5, 22}, {"q5_1", 5, 24}};

}  // namespace

Format format_of(const std::string& name, std::optional<std::int64_t> bits, std::optional<std::int64_t> group_size) {
  for (const Gguf& g : kGguf) {
    if (name != g.name) continue;
    Format f{name, bits.value_or(g.bits), group_size.value_or(kGgufBlock), g.bytes};
    if (f.bits != g.bits || f.group_size != kGgufBlock)
      throw ArgumentError(name + " has bits=" + std::to_string(g.bits) + " and group_size=" +
                          std::to_string(kGgufBlock) + ", got bits=" + std::to_string(f.bits) + ", group_size=" +
                          std::to_string(f.group_size));
    return f;
  }
  Format f{name, bits.value_or(8), group_size.value_or(64), 0};
  if (!f.affine())
    throw ArgumentError("format must be one of ('affine', 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1'), got '" + name +
                        "'");
  if (f.bits < 2 || f.bits > 8 || f.bits == 7)
    throw ArgumentError("bits must be one of (2, 3, 4, 5, 6, 8) for the affine format, got " + std::to_string(f.bits));
  if (f.group_size != 32 && f.group_size != 64 && f.group_size != 128)
    throw ArgumentError("group_size must be one of (32, 64, 128) for the affine format, got " +
                        std::to_string(f.group_size));
  return f;
}

}  // namespace mfa::quant_format
