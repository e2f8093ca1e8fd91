// mfa::merge_attention: python/mfa_native/ops/merge.py in C++, with its
// messages, in its order: the parts (non-empty, as many as the lses; the first
// a float dtype, all of its dtype and 4-d shape), then each lse ((B, Hq, R)
// float32); then what only C++ takes, the caller's out and lse; then nothing to
// compute (out 0, lse -inf), else the entry's one-kernel pass
// (codegen/attention/merge.py) on the parts, each made contiguous as Python
// makes it, with B, Hq and R its runtime sizes.
#include <algorithm>
#include <limits>
#include <string>

#include "attention_runner.hpp"
#include "mfa/merge.hpp"
#include "view_packing.hpp"

namespace mfa {

namespace {

using namespace attention_runner;

bool is_float(DType dtype) { return dtype == DType::float32 || dtype == DType::float16 || dtype == DType::bfloat16; }

std::string described(const TensorView& view) {
  return std::string(to_string(view.dtype)) + " " + shape_text(view.shape);
}

// The caller's output `view`: `dtype` and `shape`, contiguous (C++ only: Python returns new arrays).
Checked written(const TensorView& view, const std::string& name, DType dtype, const std::vector<std::int64_t>& shape,
                const std::string& what) {
  if (view.dtype != dtype || view.shape != shape)
    throw ArgumentError(name + " must be " + what + ", " + to_string(dtype) + " " + shape_text(shape) + ", got " +
                        described(view));
  Checked c = checked(view, name);
  require_contiguous(c);
  return c;
}

void merge(const Device& device, CommandBatch* batch, const Bundle& bundle, const std::vector<TensorView>& outputs,
           const std::vector<TensorView>& lses, const TensorView& out, const TensorView& lse, Layout layout) {
  if (outputs.empty() || outputs.size() != lses.size())
    throw ArgumentError("outputs and lses must be non-empty and of one length, got " + std::to_string(outputs.size()) +
                        " and " + std::to_string(lses.size()));
  const TensorView& first = outputs[0];
  if (!is_float(first.dtype))
    throw TypeError(std::string("outputs[0] must be float32, float16 or bfloat16 (ml_dtypes), got ") +
                    to_string(first.dtype));
  for (std::size_t i = 0; i < outputs.size(); ++i)
    if (outputs[i].dtype != first.dtype || outputs[i].shape != first.shape || outputs[i].shape.size() != 4)
      throw ArgumentError("outputs must be 4-d arrays of one dtype and shape: outputs[0] is " + described(first) +
                          ", outputs[" + std::to_string(i) + "] is " + described(outputs[i]));
  const std::vector<std::int64_t>& s = first.shape;
  const bool bshd = layout == Layout::bshd;
  const std::int64_t B = s[0], Hq = bshd ? s[2] : s[1], R = bshd ? s[1] : s[2], Dv = s[3];
  const std::vector<std::int64_t> rows = {B, Hq, R};
  for (const TensorView& part_lse : lses) {
    if (part_lse.dtype != DType::float32)
      throw TypeError(std::string("lse must be float32, as attention(..., return_lse=True) returns it, got ") +
                      to_string(part_lse.dtype));
    if (part_lse.shape != rows)
      throw ArgumentError("lse must have shape (B, Hq, R) = " + shape_text(rows) + ", got " +
                          shape_text(part_lse.shape));
  }
  PassViews views;
  views.add("o", written(out, "out", first.dtype, first.shape, "the merged output (the parts' dtype and shape)"));
  views.add("lse", written(lse, "lse", DType::float32, rows, "the merged lse (B, Hq, R)"));
  if (B * Hq * R * Dv == 0) {
    zero(views.views.at("o"));
    std::fill_n(static_cast<float*>(lse.data), B * Hq * R, -std::numeric_limits<float>::infinity());
    return;
  }
  BundleFacts want;
  want.op = "merge_attention", want.dtype = to_string(first.dtype), want.value_dim = Dv;
  want.parts = std::int64_t(outputs.size()), want.layout = attention_problem::layout_name(layout);
  const BundleEntry& entry = entry_for(bundle, want);
  const auto bind = [&](const std::string& buffer, const TensorView& view, const std::string& name) {
    Checked c = checked(view, name);
    view_packing::make_addressable(device, c, view_packing::Reads::contiguous);
    views.add(buffer, std::move(c));
  };
  for (std::size_t i = 0; i < outputs.size(); ++i) {  // merge.py's part(i), part_lse(i)
    bind("part" + std::to_string(i), outputs[i], "outputs[" + std::to_string(i) + "]");
    bind("part" + std::to_string(i) + "_lse", lses[i], "lses[" + std::to_string(i) + "]");
  }
  run(device, batch, entry.forward, entry.line, {{"B", B}, {"Hq", Hq}, {"R", R}}, views);
}

}  // namespace

void merge_attention(const Device& device, const Bundle& bundle, const std::vector<TensorView>& outputs,
                     const std::vector<TensorView>& lses, const TensorView& out, const TensorView& lse,
                     Layout layout) {
  merge(device, nullptr, bundle, outputs, lses, out, lse, layout);
}

void merge_attention(CommandBatch& batch, const Bundle& bundle, const std::vector<TensorView>& outputs,
                     const std::vector<TensorView>& lses, const TensorView& out, const TensorView& lse,
                     Layout layout) {
  merge(batch.device(), &batch, bundle, outputs, lses, out, lse, layout);
}

}  // namespace mfa
