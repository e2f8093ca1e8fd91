// mfa::int8_attention: python/mfa_native/ops/int8_attention.py in C++, with its
// messages, in its order: the quantization choices (int8_options), then q, k,
// v and the options by the op's declaration (attention's arrays and size checks,
// as Python's validate) and attention's options, then nothing to compute (attention's empty forward),
// then the head dimensions the int8 kernels take (describe_int8), then the
// entry's pass (attention_runner.hpp): the quantizer kernels, then attention
// on the int8 values they leave in device memory. The pass binds attention's
// buffer names, so attention's views serve it unchanged.
#include <algorithm>
#include <map>

#include "attention_runner.hpp"
#include "mfa/int8.hpp"

namespace mfa {

namespace {

using attention_problem::Problem;
using namespace attention_runner;

constexpr std::int64_t kInt8MaxHeadDim = 256;  // codegen/int8/problem.py's INT8_MAX_HEAD_DIM

// int8_options: Python's messages (the value as Python's repr of a str shows it).
void check_int8_options(const Int8AttentionOptions& o) {
  if (o.qk_scale != "token" && o.qk_scale != "tile")
    throw ArgumentError("qk_scale must be 'token' or 'tile', got '" + o.qk_scale + "'");
  if (o.pv != "int8" && o.pv != "float") throw ArgumentError("pv must be 'int8' or 'float', got '" + o.pv + "'");
}

AttentionOptions attention_options(const Int8AttentionOptions& o) {
  AttentionOptions a;
  a.scale = o.scale, a.causal = o.causal, a.window = o.window, a.mask = o.mask, a.sinks = o.sinks;
  a.layout = o.layout, a.softcap = o.softcap, a.alibi_slopes = o.alibi_slopes;
  return a;
}

void forward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
             const TensorView& k, const TensorView& v, const TensorView& out, const Int8AttentionOptions& o,
             const TensorView* lse) {
  check_int8_options(o);
  const AttentionOptions options = attention_options(o);
  Binder binder(bundle.contents().declaration("int8_attention"), attention_problem::layout_name(o.layout),
                attention_problem::with_option_arrays({{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", lse}},
                                                      options));
  const Problem p = attention_problem::checked_problem(binder, options);
  if (p.empty()) return write_empty_forward(binder, p, options);
  if (std::max(p.D, p.Dv) > kInt8MaxHeadDim)
    throw ArgumentError("int8 attention supports head dimensions 1.." + std::to_string(kInt8MaxHeadDim) +
                        ", got D=" + std::to_string(p.D) + ", Dv=" + std::to_string(p.Dv));
  BundleFacts want = facts_of(p, device.tuning().family, false);
  want.op = "int8_attention";
  want.qk_scale = o.qk_scale, want.smooth_k = o.smooth_k, want.pv = o.pv;
  run_entry(device, batch, bundle, want, binder, p, options);
}

}  // namespace

void int8_attention(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                    const TensorView& v, const TensorView& out, const Int8AttentionOptions& options,
                    const TensorView* lse) {
  forward(device, nullptr, bundle, q, k, v, out, options, lse);
}

void int8_attention(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                    const TensorView& v, const TensorView& out, const Int8AttentionOptions& options,
                    const TensorView* lse) {
  forward(batch.device(), &batch, bundle, q, k, v, out, options, lse);
}

}  // namespace mfa
