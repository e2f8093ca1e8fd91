// mfa::merge_attention: python/mfa_native/ops/merge.py in C++, in its order:
// the lists' lengths (non-empty, as many lses as parts), then the arrays by the
// op's declaration (the first part binds B, Hq, R and Dv, every other part is
// like it, each lse (B, Hq, R) float32; then what only C++ takes, the caller's
// out and lse); then nothing to compute (out 0, lse -inf), else the entry's one-kernel pass
// (codegen/attention/merge.py) on the parts, each made contiguous as Python
// makes it, with B, Hq and R its runtime sizes.
#include <algorithm>
#include <limits>
#include <map>
#include <string>

#include "attention_runner.hpp"
#include "mfa/merge.hpp"
#include "view_packing.hpp"

namespace mfa {

namespace {

using namespace attention_runner;

constexpr const char* kMerge = "merge_attention";

void merge(const Device& device, CommandBatch* batch, const Bundle& bundle, const std::vector<TensorView>& outputs,
           const std::vector<TensorView>& lses, const TensorView& out, const TensorView& lse, Layout layout) {
  if (outputs.empty() || outputs.size() != lses.size())
    throw ArgumentError("outputs and lses must be non-empty and of one length, got " + std::to_string(outputs.size()) +
                        " and " + std::to_string(lses.size()));
  std::map<std::string, const TensorView*> given = {{"out", &out}, {"lse", &lse}};
  for (std::size_t i = 0; i < outputs.size(); ++i) {  // the lists' elements, as the declaration names them
    given["outputs[" + std::to_string(i) + "]"] = &outputs[i];
    given["lses[" + std::to_string(i) + "]"] = &lses[i];
  }
  Binder binder(bundle.contents().declaration(kMerge), attention_problem::layout_name(layout), std::move(given));
  binder.bind_sizes();    // the first part: B, Hq, R, Dv
  binder.check_others();  // the other parts, the lses, then the caller's out and lse
  const std::int64_t B = binder.size("B"), Hq = binder.size("Hq"), R = binder.size("R"), Dv = binder.size("Dv");
  PassViews views;
  views.add("o", binder.view("out"));
  views.add("lse", binder.view("lse"));
  if (B * Hq * R * Dv == 0) {
    zero(views.views.at("o"));
    std::fill_n(static_cast<float*>(lse.data), B * Hq * R, -std::numeric_limits<float>::infinity());
    return;
  }
  BundleFacts want;
  want.op = kMerge, want.dtype = to_string(outputs[0].dtype), want.value_dim = Dv;
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
