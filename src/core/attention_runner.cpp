#include "attention_runner.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "mfa/prepared_pass.hpp"
#include "pass_template.hpp"
#include "view_packing.hpp"

namespace mfa::attention_runner {

using attention_problem::Problem;

namespace {

constexpr double kLog2e = 1.4426950408889634;  // numpy's log2(e), a double

// The bits of `value` rounded to float32, as a runtime size (a uint32 word).
std::int64_t float32_bits(double value) {
  const float rounded = float(value);
  std::uint32_t bits = 0;
  std::memcpy(&bits, &rounded, sizeof bits);
  return bits;
}

// Whether entry `e` serves `want`; `any_window`: a window entry serving a call
// without a window (its unbounded sides remove no key; but a rotation turns q's rows at
// consecutive positions with a window, at one without it and causal: that must not change).
bool serves(const BundleFacts& e, const BundleFacts& want, bool any_window) {
  const bool window = any_window ? e.window && !want.window && (!e.rotary_dim || want.causal != "none")
                                 : e.window == want.window;
  return e.dtype == want.dtype && e.head_dim == want.head_dim && e.value_dim == want.value_dim &&
         e.gqa_ratio == want.gqa_ratio && e.causal == want.causal && e.mask == want.mask &&
         (e.mask != "additive" || e.mask_dtype == want.mask_dtype) && window &&
         e.sinks == want.sinks && e.layout == want.layout &&
         e.softcap.has_value() == want.softcap.has_value() &&
         (!e.softcap || float(*e.softcap) == float(*want.softcap)) &&
         e.alibi == want.alibi && e.score_mod == want.score_mod && e.score_mod_tensors == want.score_mod_tensors &&
         e.family == want.family && (!want.backward || e.backward) && e.op == want.op &&
         (want.backward || e.batch_invariant == want.batch_invariant) &&  // the backward's passes ignore it
         e.page_size == want.page_size && e.cache == want.cache && e.v_cache == want.v_cache &&
         e.append == want.append &&
         e.rotary_dim == want.rotary_dim && e.rotary_interleaved == want.rotary_interleaved &&
         e.rotary_starts == want.rotary_starts &&
         e.topk_length == want.topk_length && e.shared_latent == want.shared_latent &&
         e.precision == want.precision && e.qk_scale == want.qk_scale && e.smooth_k == want.smooth_k &&
         e.pv == want.pv && e.parts == want.parts && e.format == want.format && e.bits == want.bits &&
         e.group_size == want.group_size && e.seqused_k == want.seqused_k && e.q_block == want.q_block &&
         e.k_block == want.k_block && e.shared_batch == want.shared_batch && e.shared_heads == want.shared_heads &&
         e.full_blocks == want.full_blocks && e.mask_bits == want.mask_bits &&
         (e.q_lists == want.q_lists || !want.backward);  // a forward reads no q lists
}

[[noreturn]] void no_entry(const Bundle& bundle, const BundleFacts& want) {
  std::string line = entry_line(want, 0, 0);
  line = line.substr(0, line.rfind(" templates="));
  std::string message = std::string("the bundle holds no entry for ") +
                        (want.backward ? want.op + "_backward of " : "") + line + "; it holds:";
  const std::vector<std::string> entries = bundle.entries();
  for (const std::string& entry : entries) message += "\n  " + entry;
  if (entries.empty()) message += " nothing";
  throw NoBundleEntryError(message);
}

void run_pass(const Device& device, CommandBatch* batch, const EvaluatedPass& pass,
              const std::map<std::string, Bound>& arrays) {
  std::map<std::string, std::pair<PassBinding::Source, std::size_t>> slots;
  std::vector<PassArraySlot> array_slots;
  std::vector<PassArray> bound;
  std::vector<std::size_t> intermediates;
  std::vector<std::vector<unsigned char>> constants;
  for (const char* role : {"input", "inout", "output"})
    for (const EvaluatedBuffer& b : pass.buffers) {
      if (b.buffer->role != role) continue;
      const std::string& name = b.buffer->name;
      auto it = arrays.find(name);
      if (it == arrays.end())
        throw BundleError("the bundle's pass '" + pass.pass->name + "' binds '" + name + "', which this call lacks");
      if (it->second.view) {
        const Checked& view = *it->second.view;
        if (view.shape != b.shape)
          throw ArgumentError(view.name + " has shape " + shape_text(view.shape) + " but the pass expects " +
                              shape_text(b.shape));
        if (b.buffer->caller() && view.strides != b.strides)
          throw BundleError("the bundle's kernels read " + view.name + " with strides " + shape_text(b.strides) +
                            " but it has " + shape_text(view.strides) + " (0 on axes of extent 1): the bundle "
                            "predates runtime strides; write it again with python -m mfa_native bundle");
        if (view.packed) bound.push_back(PassArray{nullptr, 0, view.packed, 0});
        else bound.push_back(PassArray{view.view->data, b.nbytes, Buffer(), 0});
      } else {
        bound.push_back(PassArray{nullptr, 0, device.new_buffer(b.nbytes), 0});
      }
      slots[name] = {PassBinding::Source::array, array_slots.size()};
      array_slots.push_back(PassArraySlot{name, !(b.buffer->role == std::string("input"))});
    }
  for (const EvaluatedBuffer& b : pass.buffers) {
    if (b.buffer->role == "intermediate") {
      slots[b.buffer->name] = {PassBinding::Source::intermediate, intermediates.size()};
      intermediates.push_back(b.nbytes);
    } else if (b.buffer->role == "constant") {
      slots[b.buffer->name] = {PassBinding::Source::constant, constants.size()};
      std::vector<unsigned char> bytes(4 * b.value.size());
      if (!bytes.empty()) std::memcpy(bytes.data(), b.value.data(), bytes.size());
      constants.push_back(std::move(bytes));
    }
  }
  std::vector<PassDispatch> dispatches;
  for (const EvaluatedKernel& k : pass.kernels) {
    // Made from the bundle's metallib of the source where it has one (the metal device).
    const auto library = device.library(k.kernel->source, {}, k.kernel->binary.get());
    PassDispatch dispatch{device.pipeline(library, k.kernel->entry), k.threadgroups,
                          k.kernel->threads_per_threadgroup, {}, {}};
    for (std::size_t i = 0; i < k.kernel->buffers.size(); ++i) {
      const auto& [source, slot] = slots.at(k.kernel->buffers[i]);
      dispatch.bindings.push_back(PassBinding{int(i), source, slot});
    }
    dispatches.push_back(std::move(dispatch));
  }
  const PreparedPass prepared(device, std::move(dispatches), std::move(array_slots), std::move(intermediates),
                              std::move(constants));
  if (batch) prepared.encode(*batch, bound);
  else prepared.run(bound);
}

}  // namespace

const PassTemplate& template_for(const std::vector<PassTemplate>& templates, const SizeEnv& sizes,
                                 const std::string& entry_line_text) {
  for (const PassTemplate& t : templates)
    if (guards_hold(t, template_env(t, sizes))) return t;
  std::string given;
  for (const auto& [name, value] : sizes) given += (given.empty() ? "" : ", ") + name + "=" + std::to_string(value);
  throw NoBundleEntryError("the bundle entry '" + entry_line_text + "' has no template for sizes " + given);
}

BundleFacts facts_of(const Problem& p, const std::string& family, bool backward) {
  BundleFacts f;
  f.dtype = to_string(p.dtype);
  f.head_dim = p.D, f.value_dim = p.Dv, f.gqa_ratio = p.Hkv ? p.Hq / p.Hkv : 1;
  f.causal = attention_problem::causal_name(p.causal);
  f.mask = p.mask, f.mask_dtype = p.mask_dtype;
  f.window = p.window.has_value();
  f.sinks = p.sinks;
  f.layout = attention_problem::layout_name(p.layout);
  if (p.softcap) f.softcap = *p.softcap;
  f.alibi = p.alibi;
  f.score_mod = p.score_mod;
  f.score_mod_tensors = p.score_mod_tensors;
  f.family = family;
  f.backward = backward;
  f.batch_invariant = p.batch_invariant;
  return f;
}

const BundleEntry* find_entry(const Bundle& bundle, const BundleFacts& want) {
  for (bool any_window : {false, true})  // an entry without a window first: it skips the window's arithmetic
    for (const BundleEntry& entry : bundle.contents().entries)
      if (serves(entry.facts, want, any_window)) return &entry;
  return nullptr;
}

const BundleEntry& entry_for(const Bundle& bundle, const BundleFacts& want) {
  if (const BundleEntry* entry = find_entry(bundle, want)) return *entry;
  no_entry(bundle, want);
}

// The runtime sizes of a call: lengths and counts, the device's parallel
// threadgroups, a window entry's sides (descriptor.py's window_values: an
// unbounded side is C on the left, R on the right), and the strides of the
// views the kernels read (descriptor.py's stride names, logical axis order),
// and the float32 bits of the scale and of scale * log2(e) (attention/scale.py).
SizeEnv sizes_of(const Problem& p, const Device& device, const BundleEntry& entry,
                 const PassViews& views) {
  SizeEnv sizes = {{"B", p.B}, {"Hq", p.Hq}, {"Hkv", p.Hkv}, {"R", p.R}, {"C", p.C},
                   {"P", std::int64_t(device.tuning().parallel_threadgroups)},
                   {"scale_bits", float32_bits(p.scale)}, {"scale_log2e_bits", float32_bits(p.scale * kLog2e)}};
  if (entry.facts.window) {
    if (p.R + p.C > attention_problem::kMaxIndex)
      throw ArgumentError("R + C (query and key lengths, " + std::to_string(p.R) + " + " + std::to_string(p.C) +
                          ") must be below 2**31 for a bundle entry serving every window: its kernels compute "
                          "positions up to R + C in 32-bit integers");
    const auto [left, right] = p.window.value_or(std::make_pair<std::int64_t, std::int64_t>(-1, -1));
    sizes["window_left"] = left == -1 ? p.C : std::min(left, p.C);
    sizes["window_right"] = right == -1 ? p.R : std::min(right, p.R);
  }
  add_strides(sizes, views);
  return sizes;
}

void add_strides(SizeEnv& sizes, const PassViews& views) {
  const std::vector<std::string> axes = {"batch", "head", "row", "key"};
  for (const auto& [name, logical] : views.strided) {
    auto named = views.stride_axes.find(name);
    const std::vector<std::string>& names = named == views.stride_axes.end() ? axes : named->second;
    for (std::size_t i = 0; i < logical.size() && i < names.size(); ++i)
      sizes[name + "_" + names[i] + "_stride"] = logical[i];
  }
}

void run_entry(const Device& device, CommandBatch* batch, const Bundle& bundle, const BundleFacts& want,
               const Binder& binder, const Problem& p, const AttentionOptions& options) {
  const BundleEntry& entry = entry_for(bundle, want);
  const PassViews views(device, binder, options);
  run(device, batch, want.backward ? entry.backward : entry.forward, entry.line,
      sizes_of(p, device, entry, views), views);
}

void zero(const Checked& view) {
  if (view.elements) std::memset(view.view->data, 0, std::size_t(view.elements) * dtype_size(view.view->dtype));
}

void write_empty_backward(const Binder& binder) {
  for (const char* name : {"dq", "dk", "dv", "dsinks"})
    if (binder.given(name)) zero(binder.view(name));
}

void write_empty_forward(const Binder& binder, const Problem& p, const AttentionOptions& options) {
  zero(binder.view("out"));
  if (!binder.given("lse")) return;
  auto* values = static_cast<float*>(binder.view("lse").view->data);
  const auto* sink = options.sinks ? static_cast<const float*>(options.sinks->data) : nullptr;
  const std::int64_t step = options.sinks ? binder.view("sinks").strides[0] : 0;
  for (std::int64_t i = 0; i < binder.view("lse").elements; ++i)
    values[i] = sink ? sink[((i / p.R) % p.Hq) * step] : -std::numeric_limits<float>::infinity();
}

PassViews::PassViews(const Device& device, const Binder& binder, const AttentionOptions& options) {
    for (const ArrayRule& rule : binder.declaration().arrays) {
      if (rule.output) {
        arrays[rule.buffer] = binder.given(rule.name) ? Bound{&binder.view(rule.name)} : Bound{nullptr, true};
        continue;
      }
      if (!binder.given(rule.name)) continue;
      Checked view = binder.view(rule.name);
      view_packing::make_addressable(device, view, rule.reads);
      if (rule.broadcast || rule.expands) view = broadcast(view, binder.expected(rule.name));
      add(rule.buffer, std::move(view));
      if (rule.reads == view_packing::Reads::contiguous) continue;
      std::vector<std::int64_t> logical = binder.logical(rule, views[rule.buffer].strides);
      if (rule.reads == view_packing::Reads::strided) logical.pop_back();
      strided[rule.buffer] = std::move(logical);
      if (!rule.stride_axes.empty()) stride_axes[rule.buffer] = rule.stride_axes;
    }
    for (std::size_t i = 0; i < options.score_mod_tensors.size(); ++i) {  // what a score_mod reads, contiguous
      Checked view = checked(options.score_mod_tensors[i], "score_mod_tensors[" + std::to_string(i) + "]");
      view_packing::make_addressable(device, view, view_packing::Reads::contiguous);
      add("score_mod_" + std::to_string(i), std::move(view));
    }
  }
void PassViews::add(const std::string& buffer, Checked view) {
  views[buffer] = std::move(view);
  arrays[buffer] = {&views[buffer]};
}

void run(const Device& device, CommandBatch* batch, const PassTemplate& pass, const SizeEnv& sizes,
         const PassViews& views) {
  run_pass(device, batch, evaluate(pass, sizes), views.arrays);
}

void run(const Device& device, CommandBatch* batch, const std::vector<PassTemplate>& templates,
         const std::string& entry_line_text, const SizeEnv& sizes, const PassViews& views) {
  run_pass(device, batch, evaluate(template_for(templates, sizes, entry_line_text), sizes), views.arrays);
}

}  // namespace mfa::attention_runner
