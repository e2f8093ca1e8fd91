// The attention family's pass runner, shared by the ops whose pass is an
// attention pass (attention, attention_backward, attention_with_kvcache,
// sparse_attention, block_sparse_attention and their backwards, int8_attention; sparse_topk uses its
// entries, PassViews and run, merge_attention and quantize its entries, PassViews::add and
// run, binding their views and sizes themselves): the bundle entry a call's
// facts need, the runtime sizes of its template, the caller's views bound by the
// pass's buffer names, and the pass run (or encoded into the caller's batch).
// The views' strides and a window entry's sides are runtime sizes of the
// template; views the kernels cannot address in place are packed first
// (view_packing.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attention_problem.hpp"
#include "binder.hpp"
#include "bundle.hpp"
#include "mfa/command_batch.hpp"

namespace mfa::attention_runner {

// The facts of the entry a call of `p` needs on a device of GPU `family` (an attention entry;
// the KV-cache call sets its own on top).
BundleFacts facts_of(const attention_problem::Problem& p, const std::string& family, bool backward);

// The bundle's entry serving `want` (NoBundleEntryError listing the bundle's entries otherwise).
const BundleEntry& entry_for(const Bundle& bundle, const BundleFacts& want);
// The same, or null when the bundle holds none.
const BundleEntry* find_entry(const Bundle& bundle, const BundleFacts& want);

// One array of the call, by the pass's buffer name.
struct Bound {
  const Checked* view = nullptr;       // caller memory
  bool scratch = false;                // an output the caller did not ask for: pool memory
};

// The arrays a pass binds, by buffer name: the inputs the binder checked, made addressable
// (packed where the kernels cannot read them in place; a broadcast one read as its target
// shape), and the outputs (an output not given: scratch memory); `strided` holds the logical
// strides of those the kernels read with runtime strides (the feature axis, unit, left out).
struct PassViews {
  std::map<std::string, Checked> views;
  std::map<std::string, Bound> arrays;
  std::map<std::string, std::vector<std::int64_t>> strided;
  std::map<std::string, std::vector<std::string>> stride_axes;  // their names, when not batch, head, row, key

  PassViews(const Device& device, const Binder& binder, const AttentionOptions& options);
  PassViews() = default;  // an op without a declaration adds its arrays itself
  PassViews(const PassViews&) = delete;  // arrays point into views
  PassViews& operator=(const PassViews&) = delete;
  // Binds `view` as pass buffer `buffer` (in place of what the binder gave, if anything).
  void add(const std::string& buffer, Checked view);
};

// The runtime sizes of a call of `p` (lengths and counts, the device's parallel threadgroups,
// a window entry's sides, the strided views' strides, the scale's float32 bits).
SizeEnv sizes_of(const attention_problem::Problem& p, const Device& device, const BundleEntry& entry,
                 const PassViews& views);
// Adds the strided views' logical strides ({buffer}_{axis}_stride; axes batch, head, row, key
// unless the view's rule names its own).
void add_strides(SizeEnv& sizes, const PassViews& views);

// The first of `templates` whose guards hold for `sizes` (NoBundleEntryError naming the entry otherwise).
const PassTemplate& template_for(const std::vector<PassTemplate>& templates, const SizeEnv& sizes,
                                 const std::string& entry_line_text);

// `pass` evaluated for `sizes`, run on `views` (or encoded into `batch`).
void run(const Device& device, CommandBatch* batch, const PassTemplate& pass, const SizeEnv& sizes,
         const PassViews& views);

// The first of `templates` whose guards hold for `sizes`, evaluated, run on `views` (or encoded into `batch`).
void run(const Device& device, CommandBatch* batch, const std::vector<PassTemplate>& templates,
         const std::string& entry_line_text, const SizeEnv& sizes, const PassViews& views);

// The pass of the entry serving `want` (its backward with want.backward) for a call of `p`
// checked by `binder`, on the call's views: what attention, attention_backward and
// int8_attention run, each with its own facts.
void run_entry(const Device& device, CommandBatch* batch, const Bundle& bundle, const BundleFacts& want,
               const Binder& binder, const attention_problem::Problem& p, const AttentionOptions& options);

// Writes zeros over a contiguous written view.
void zero(const Checked& view);

// What a backward with nothing to compute gives, as Python: gradients of zeros (dq, dk, dv, dsinks).
void write_empty_backward(const Binder& binder);

// What a forward with nothing to compute (B, Hq, R or C = 0) gives, as Python: out 0, lse -inf
// (the sink's logit with sinks).
void write_empty_forward(const Binder& binder, const attention_problem::Problem& p, const AttentionOptions& options);

}  // namespace mfa::attention_runner
