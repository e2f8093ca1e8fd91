// mfa::quantize: python/mfa_native/ops/quantize.py in C++, with its messages,
// in its order: the format (quant_formats.py's QuantFormat), x's dtype, its
// last axis, the group count; then what only C++ takes, the caller's fields;
// then nothing to compute (no rows), else the entry's one-kernel pass
// (codegen/storage/quantize.py's quantize_template), which sees x as its groups
// (groups, group_size) and each field as one row per group: x made contiguous
// as Python makes it, `groups` the pass's one runtime size.
#include <numeric>
#include <string>
#include <vector>

#include "attention_runner.hpp"
#include "mfa/quantize.hpp"
#include "view_packing.hpp"

namespace mfa {

namespace {

using namespace attention_runner;

constexpr std::int64_t kMaxGroups = (std::int64_t(1) << 32) - 1;  // the kernel's runtime size, a 32-bit word
constexpr std::int64_t kGgufBlock = 32;

struct Gguf {
  const char* name;
  std::int64_t bits, bytes;  // per block of 32 values
};
// quant_formats.py's GGUF_BLOCKS, in its order.
constexpr Gguf kGguf[] = {{"q8_0", 8, 34}, {"q4_0", 4, 18}, {"q4_1", 4, 20}, {"q5_0", 5, 22}, {"q5_1", 5, 24}};

// quant_formats.py's QuantFormat: the name, bits and group size a call names, checked.
struct Format {
  std::string name;
  std::int64_t bits = 0, group_size = 0, block_bytes = 0;  // block_bytes: GGUF's (0: affine)

  bool affine() const { return name == "affine"; }
  std::string describe() const {
    return affine() ? name + " " + std::to_string(bits) + "-bit, groups of " + std::to_string(group_size) : name;
  }
  // data's elements per row of `features` values (uint32 words, or bytes of blocks).
  std::int64_t data_width(std::int64_t features) const {
    return affine() ? features * bits / 32 : features / kGgufBlock * block_bytes;
  }
};

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

bool is_float(DType dtype) { return dtype == DType::float32 || dtype == DType::float16 || dtype == DType::bfloat16; }

// A field the call writes: `dtype`, `shape`, contiguous (C++ only: Python returns new arrays).
void check_field(const TensorView& view, const std::string& name, DType dtype, const std::vector<std::int64_t>& shape,
                 const Format& f) {
  if (view.dtype != dtype || view.shape != shape)
    throw ArgumentError(name + " must be " + to_string(dtype) + " " + shape_text(shape) + " for " + f.describe() +
                        ", got " + to_string(view.dtype) + " " + shape_text(view.shape));
  require_contiguous(checked(view, name));
}

void run_quantize(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& x,
                  const QuantizeOutputs& out, const std::string& format, std::optional<std::int64_t> bits,
                  std::optional<std::int64_t> group_size) {
  const Format f = format_of(format, bits, group_size);
  if (!is_float(x.dtype))
    throw TypeError(std::string("x must be float32, float16 or bfloat16 (ml_dtypes), got ") + to_string(x.dtype));
  const std::int64_t features = x.shape.empty() ? 0 : x.shape.back();
  if (x.shape.empty() || features == 0 || features % f.group_size)
    throw ArgumentError("x's last axis must be a positive multiple of group_size (" + std::to_string(f.group_size) +
                        ") for " + f.describe() + ", got shape " + shape_text(x.shape));
  Checked values = checked(x, "x");
  const std::int64_t groups = values.elements / f.group_size;
  if (groups > kMaxGroups)
    throw ArgumentError("x has " + std::to_string(groups) + " groups; at most " + std::to_string(kMaxGroups) +
                        " fit one call");

  std::vector<std::int64_t> rows(x.shape.begin(), x.shape.end() - 1);
  rows.push_back(f.data_width(features));
  check_field(out.data, "data", f.affine() ? DType::uint32 : DType::uint8, rows, f);
  rows.back() = features / f.group_size;
  for (const auto& [field, name] : {std::pair(&out.scales, "scales"), std::pair(&out.biases, "biases")}) {
    if (!f.affine() && field->has_value())
      throw ArgumentError(f.name + " has no " + name + ": its scales live in its blocks (give data only)");
    if (f.affine() && !field->has_value())
      throw ArgumentError(std::string(name) + " is required for " + f.describe());
    if (field->has_value()) check_field(**field, name, x.dtype, rows, f);
  }
  if (groups == 0) return;  // no rows: nothing to write

  BundleFacts want;
  want.op = "quantize", want.dtype = to_string(x.dtype), want.format = f.name, want.bits = f.bits;
  want.group_size = f.group_size;
  const BundleEntry& entry = entry_for(bundle, want);
  view_packing::make_addressable(device, values, view_packing::Reads::contiguous);
  // Every array as the template's one row per group: x (groups, group_size), data (groups,
  // the group's width), scales and biases (groups, 1), over the same memory.
  const std::vector<TensorView> flat = {
      {x.data, x.dtype, {groups, f.group_size}, {}},
      {out.data.data, out.data.dtype, {groups, f.data_width(f.group_size)}, {}},
      {f.affine() ? out.scales->data : nullptr, x.dtype, {groups, 1}, {}},
      {f.affine() ? out.biases->data : nullptr, x.dtype, {groups, 1}, {}}};
  PassViews views;
  Checked flat_x = checked(flat[0], "x");
  flat_x.packed = values.packed;
  views.add("x", std::move(flat_x));
  views.add("data", checked(flat[1], "data"));
  if (f.affine()) {
    views.add("scales", checked(flat[2], "scales"));
    views.add("biases", checked(flat[3], "biases"));
  }
  run(device, batch, entry.forward, entry.line, {{"groups", groups}}, views);
}

}  // namespace

void quantize(const Device& device, const Bundle& bundle, const TensorView& x, const QuantizeOutputs& out,
              const std::string& format, std::optional<std::int64_t> bits, std::optional<std::int64_t> group_size) {
  run_quantize(device, nullptr, bundle, x, out, format, bits, group_size);
}

void quantize(CommandBatch& batch, const Bundle& bundle, const TensorView& x, const QuantizeOutputs& out,
              const std::string& format, std::optional<std::int64_t> bits, std::optional<std::int64_t> group_size) {
  run_quantize(batch.device(), &batch, bundle, x, out, format, bits, group_size);
}

}  // namespace mfa
