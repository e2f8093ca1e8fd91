// Attention for C++ programs, without Python: the pass templates of a bundle
// file (`python -m mfa_native bundle -o FILE --spec SPEC.json`) evaluated for
// each call's sizes and run on a device.
//
//   mfa::Bundle bundle = mfa::Bundle::load("attention.mfab");
//   mfa::Device device = mfa::Device::default_device();
//   mfa::TensorView q{q_data, mfa::DType::float16, {B, Hq, R, D}, {}};   // ... k, v, out
//   mfa::attention(device, bundle, q, k, v, out, {/*scale*/ {}, mfa::Causal::lower_right});
//
// Semantics, shapes, layouts and errors are those of Python's
// mfa_native.attention / attention_backward; on the cpu backend the results
// are bit-identical to Python's for the same inputs (the same kernels run).
//
// What a bundle entry fixes and what stays a runtime value: an entry's kernels
// bake the dtype, D, Dv (1..576), the GQA ratio Hq / Hkv, causal, the mask kind
// and its element type, whether it takes a window, sinks, the layout, the
// score transforms (the softcap, whether ALiBi slopes are per head or
// per batch, a score_mod's text and its tensors' shapes and element types) and
// the GPU family (the device's tile table); the scale, batch, head counts,
// sequence lengths and the views' strides are runtime values, so one entry
// serves every length and view. An entry with a window ("window=yes") serves
// every window: its sides are runtime values too (and it serves calls without
// a window when the bundle has no entry without one); it needs R + C below
// 2**31. A call the bundle holds no entry for throws NoBundleEntryError
// listing what it holds.
//
// Strides: q, k, v, the mask, and the backward's o and dout are read in place
// when their strides are non-negative (below 2**32) and their last axis is unit
// (transposed or padded views, slices of bigger buffers); a mask broadcast to
// (B, Hq, R, C) is read with stride 0 on its broadcast axes (its last axis may
// have stride 0 too). Other views (negative strides, a non-unit last axis), and
// lse or sinks that are not contiguous, are first copied into a contiguous
// buffer from the device's pool, as Python copies them. Strides of axes of
// extent 1 never matter. Outputs (out, lse, dq, dk, dv, dsinks) must be
// contiguous views of caller memory, written in place (ArgumentError naming them).
//
// Thread safety: a Bundle is immutable after loading; calls may run from
// several threads at once (the device's caches are thread-safe).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfa/command_batch.hpp"
#include "mfa/device.hpp"
#include "mfa/errors.hpp"

namespace mfa {

// Element types of a TensorView. bool8: one byte per element, 0 or 1; uint8:
// bytes (a quantized tensor's blocks); uint32: words (affine quantized data);
// float8_e4m3fn, float8_e5m2: one byte per value (a float8 KV cache, ml_dtypes' formats).
enum class DType { float32, float16, bfloat16, bool8, int32, uint8, uint32, float8_e4m3fn, float8_e5m2 };

const char* to_string(DType dtype);
std::size_t dtype_size(DType dtype);

// A tensor in caller memory: nothing is copied unless a backend must stage it.
// `data` points at the first element (host memory; on Apple GPUs, unified).
struct TensorView {
  void* data;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  // in elements; empty: contiguous row-major
};

// Causal masking: none; lower_right (the last query lines up with the last
// key, MLX's and FlashAttention's); upper_left (query i sees keys j <= i,
// PyTorch's is_causal).
enum class Causal { none, lower_right, upper_left };

// bhsd: q (B, Hq, R, D), k (B, Hkv, C, D), v (B, Hkv, C, Dv), out (B, Hq, R, Dv).
// bshd: the sequence and head axes swapped. The mask is (B, Hq, R, C) in both.
enum class Layout { bhsd, bshd };

// Python's `deterministic`: run_to_run (False, True: two runs of a call give the same bits, as
// every kernel does) or batch_invariant (a row's bits do not depend on the rest of the call:
// its batch, lengths or split; an entry baked with "deterministic": "batch_invariant").
enum class Deterministic { run_to_run, batch_invariant };

struct AttentionOptions {
  std::optional<double> scale;                                  // default 1/sqrt(D); a runtime value
  Causal causal = Causal::none;
  // (left, right): key j is allowed for query i iff -left <= j - (i + C - R) <= right;
  // -1 leaves a side unbounded (a side >= C or >= R is unbounded too).
  std::optional<std::pair<std::int64_t, std::int64_t>> window;
  // bool8 (true = attend) or additive float (float32, float16, bfloat16), shape
  // broadcastable to (B, Hq, R, C), any strides (see Strides above).
  std::optional<TensorView> mask;
  std::optional<TensorView> sinks;                              // float32 (Hq,): one extra logit per head
  Layout layout = Layout::bhsd;
  // Score transforms, applied in this order to each scaled score s after the scale and before
  // the mask and sinks (an entry bakes them: the spec's "softcap", "alibi", "score_mod").
  // softcap c > 0: s -> c * tanh(s / c) (flash-attn's; Gemma 2).
  std::optional<double> softcap;
  // float32 (Hq,) or (B, Hq), any strides: s -> s - slope * |i + C - R - j| for query i, key j.
  std::optional<TensorView> alibi_slopes;
  // A traced FlexAttention score_mod's text (mfa_native.torch.score_mod.trace; empty: none)
  // and the tensors it reads, in the order the text numbers them: float32 or int32, any strides.
  std::string score_mod;
  std::vector<TensorView> score_mod_tensors;
  Deterministic deterministic = Deterministic::run_to_run;  // the forward's (the backward ignores it)
};

// A damaged, truncated or future-version bundle file (or one this build cannot read).
class BundleError : public Error {
 public:
  using Error::Error;
};

// The bundle holds no entry for a call's problem: the message names the problem
// and lists entries().
class NoBundleEntryError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

// The pass templates of a bundle file, read and checked (format version,
// length, sha256) at load time. Cheap to copy (shared, immutable).
class Bundle {
 public:
  // Throws BundleError (and nothing else for bad bytes; UnavailableError-free).
  static Bundle load(const std::string& path);
  static Bundle from_memory(const void* data, std::size_t size);

  // One readable line per family entry, as `python -m mfa_native bundle --list` prints.
  std::vector<std::string> entries() const;

  struct Contents;  // the parsed payload (src/core/bundle.hpp)
  const Contents& contents() const { return *contents_; }

 private:
  explicit Bundle(std::shared_ptr<const Contents> contents) : contents_(std::move(contents)) {}
  std::shared_ptr<const Contents> contents_;
};

// out = softmax(scale * q k^T + mask) v, and with `lse` the (B, Hq, R) float32
// natural log of each row's softmax denominator (sinks included). Runs the
// entry's pass in one CommandBatch and waits. A row with no allowed key (and
// no sink) gives 0 and lse -inf. Throws TypeError (a dtype) or ArgumentError (a
// shape, stride or option) naming the argument, NoBundleEntryError, before
// anything runs; DispatchError / CompileError from the device.
void attention(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
               const TensorView& v, const TensorView& out, const AttentionOptions& options = {},
               const TensorView* lse = nullptr);

// The gradients of attention: dq, dk, dv (laid out like q, k, v, contiguous, in
// q's dtype) and, with sinks, dsinks ((Hq,) float32; computed into device
// memory and dropped when dsinks is null). o and lse are what attention
// returned, dout the gradient of the output (o's shape and dtype). With GQA,
// dk and dv sum the query heads sharing each kv head. Errors as attention's.
void attention_backward(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& o, const TensorView& lse, const TensorView& dout,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options = {}, const TensorView* dsinks = nullptr);

// The same, encoded into the caller's batch (on its device) without committing:
// the caller commits and waits, and keeps every view alive until then. A call
// with nothing to compute (B, Hq, R or C = 0) writes its outputs at once.
void attention(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
               const TensorView& v, const TensorView& out, const AttentionOptions& options = {},
               const TensorView* lse = nullptr);
void attention_backward(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& o, const TensorView& lse, const TensorView& dout,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options = {}, const TensorView* dsinks = nullptr);

}  // namespace mfa
