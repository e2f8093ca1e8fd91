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
#include "quant_format.hpp"
#include "view_packing.hpp"

namespace mfa {

namespace {

using namespace attention_runner;
using quant_format::Format;
using quant_format::format_of;

constexpr const char* kQuantize = "quantize";

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
                std::move(sizes), {{"format", f.describe()}, {"data_dtype", to_string(f.data_dtype())}});
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
