// mfa::quantize: python/mfa_native/ops/quantize.py in C++, with its messages,
// in its order: the format (quant_formats.py's QuantFormat), then x by the op's
// declaration (its dtype, its last axis, the group count: the sizes and texts
// the format gives), then what only C++ takes, the caller's fields (those the
// format has, then by the declaration); then nothing to compute (no rows), else the entry's one-kernel pass
// (codegen/storage/quantize.py's quantize_template), which sees x as its groups
// (groups, group_size) and each field as one row per group: x made contiguous
// as Python makes it, `groups` the pass's one runtime size.
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "attention_runner.hpp"
#include "mfa/quantize.hpp"
#include "view_packing.hpp"

namespace mfa {

namespace {

using namespace attention_runner;

constexpr const char* kQuantize = "quantize";
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

// The fields the format has: scales and biases are affine's (GGUF's live in its blocks).
void check_presence(const QuantizeOutputs& out, const Format& f) {
  for (const auto& [field, name] : {std::pair(&out.scales, "scales"), std::pair(&out.biases, "biases")}) {
    if (!f.affine() && field->has_value())
      throw ArgumentError(f.name + " has no " + name + ": its scales live in its blocks (give data only)");
    if (f.affine() && !field->has_value())
      throw ArgumentError(std::string(name) + " is required for " + f.describe());
  }
}

void run_quantize(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& x,
                  const QuantizeOutputs& out, const std::string& format, std::optional<std::int64_t> bits,
                  std::optional<std::int64_t> group_size) {
  const Format f = format_of(format, bits, group_size);
  const std::int64_t elements =
      std::accumulate(x.shape.begin(), x.shape.end(), std::int64_t(1), std::multiplies<std::int64_t>());
  const std::int64_t groups = elements / f.group_size;
  // The sizes and texts the format gives (quantize.py's _binding).
  SizeEnv sizes = {{"group_size", f.group_size}, {"group_width", f.data_width(f.group_size)}, {"groups", groups}};
  Binder binder(bundle.contents().declaration(kQuantize), "none",
                {{"x", &x}, {"data", &out.data}, {"scales", out.scales ? &*out.scales : nullptr},
                 {"biases", out.biases ? &*out.biases : nullptr}},
                std::move(sizes), {{"format", f.describe()}, {"data_dtype", f.affine() ? "uint32" : "uint8"}});
  binder.bind_sizes();  // x: its dtype, its last axis D, the group count
  check_presence(out, f);
  binder.check_others();  // what only C++ takes: the caller's fields
  Checked values = binder.view("x");
  if (groups == 0) return;  // no rows: nothing to write

  BundleFacts want;
  want.op = kQuantize, want.dtype = to_string(x.dtype), want.format = f.name, want.bits = f.bits;
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
