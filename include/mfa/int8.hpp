// int8 attention for C++ programs, without Python: Python's
// mfa_native.int8_attention run from a bundle whose spec has an
// "int8_attention" family.
//
//   mfa::Int8AttentionOptions o;
//   o.causal = mfa::Causal::lower_right, o.qk_scale = "tile";
//   mfa::int8_attention(device, bundle, q, k, v, out, o, &lse);
//
// Semantics, shapes and messages are Python's: float q, k, v and float outputs
// exactly as attention's (layouts, masks, window, sinks, softcap, ALiBi, GQA;
// no score_mod), q, k (and with pv "int8" v) quantized to int8 on the device
// and both products computed in exact integer arithmetic. The int8 values,
// scales and means are intermediates of the entry's pass (device memory): no
// argument is int8. On the cpu backend the results are bit-identical to
// Python's for the same inputs. D and Dv are 1..256.
//
// What a bundle entry fixes (spec keys): attention's facts (dtype, D, Dv, the
// GQA ratio, causal, mask, whether it takes a window, sinks, layout, softcap,
// ALiBi) and the quantization: qk_scale, smooth_k and pv. Batch, heads,
// lengths, the window's sides, the scale and the inputs' strides are runtime
// values.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "mfa/attention.hpp"

namespace mfa {

// int8_attention's keyword arguments, Python's names and defaults (return_lse:
// pass `lse`).
struct Int8AttentionOptions {
  std::optional<double> scale;          // default 1/sqrt(D); a runtime value
  Causal causal = Causal::none;
  std::optional<std::pair<std::int64_t, std::int64_t>> window;  // as AttentionOptions::window
  std::optional<TensorView> mask;       // as AttentionOptions::mask
  std::optional<TensorView> sinks;      // float32 (Hq,)
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes;  // float32 (Hq,) or (B, Hq)
  Layout layout = Layout::bhsd;
  // How Q and K are quantized: "token" (a scale per row) or "tile" (per 16 query rows and
  // 64 key rows); smooth_k: K minus its mean over the attended keys; pv: "int8" (V per
  // channel, P per block of 64 keys, as int8) or "float".
  std::string qk_scale = "token";
  bool smooth_k = true;
  std::string pv = "int8";
};

// out (layout's shape, q's dtype) and with `lse` the (B, Hq, R) float32 natural log of each
// row's denominator (of the quantized P with pv "int8"; sinks included). Throws TypeError /
// ArgumentError naming the argument (with Python's message) or NoBundleEntryError before
// anything runs; DispatchError / CompileError from the device.
void int8_attention(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                    const TensorView& v, const TensorView& out, const Int8AttentionOptions& options = {},
                    const TensorView* lse = nullptr);
// The same, encoded into the caller's batch (see attention's).
void int8_attention(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                    const TensorView& v, const TensorView& out, const Int8AttentionOptions& options = {},
                    const TensorView* lse = nullptr);

}  // namespace mfa
