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
#include "quant_format.hpp"
#include "view_packing.hpp"

namespace mfa {

namespace {

using namespace attention_runner;
using quant_format::Format;
using quant_format::format_of;

constexpr std::int64_t kMaxGroups = (std::int64_t(1) << 32) - 1;  // the kernel's runtime size, a 32-bit word
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
