// Sparse attention for C++ programs, without Python: Python's
// mfa_native.sparse_attention (DeepSeek sparse attention: each query row attends
// exactly the keys its token list names) and sparse_attention_backward, run from
// a bundle whose spec has a "sparse_attention" family; and sparse_topk (the
// indexer that makes such lists), from a "sparse_topk" family.
//
//   mfa::sparse_attention(device, bundle, q, k, v, indices, out, {/*scale*/ {}});
//
// Semantics, shapes and messages are Python's: q (B, Hq, R, D), k (B, Hkv, C, D),
// v (B, Hkv, C, Dv) ("bhsd"; "bshd" swaps the sequence and head axes), indices
// int32 (B, Hkv or 1, R, topk) ("bshd": (B, R, Hkv or 1, topk)): query row r of
// query head h attends keys indices[b, h / (Hq / Hkv), r, :]; an entry < 0 or
// >= C is skipped wherever it appears, a key listed twice counts twice. A
// kv-head axis of extent 1 (or stride 0) shares one list among the kv heads.
// topk_length int32 (B, R), optional: only the first topk_length[b, r] entries
// of each list are read (checked not negative on every call, before anything
// runs). v may be a view of k (MLA's shared latent, v = k[..., :Dv]). On the cpu
// backend the results are bit-identical to Python's for the same inputs.
//
// What a bundle entry fixes (spec keys): the dtype, D, Dv, the GQA ratio, sinks,
// the layout, softcap, ALiBi and score_mod as for attention, whether calls give
// topk_length, and whether v is a view of k (`shared_latent`: a call whose v is
// one is served by an entry without it too, with the same results). Batch,
// heads, lengths, topk (the lists' width), the views' and the lists' strides
// and the scale are runtime values. Views the kernels cannot address in place
// (a list whose slot axis is not unit, negative strides) are copied first.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mfa/attention.hpp"

namespace mfa {

// sparse_attention's keyword arguments, Python's names, order and defaults.
struct SparseOptions {
  std::optional<double> scale;               // default 1/sqrt(D); a runtime value
  std::optional<TensorView> sinks;           // float32 (Hq,): one extra logit per head
  std::optional<double> softcap;             // s -> c * tanh(s / c) on each listed key's scaled score
  std::optional<TensorView> alibi_slopes;    // float32 (Hq,) or (B, Hq): |r + C - R - j| to listed key j
  std::vector<TensorView> score_mod_tensors; // as AttentionOptions'
  std::string score_mod;                     // a traced score_mod's text ("": none); kv_idx is the listed key
  std::optional<TensorView> topk_length;     // int32 (B, R): how many entries of each list to read
  Layout layout = Layout::bhsd;
};

// out (q's layout, (B, Hq, R, Dv) in "bhsd"), contiguous, of q's dtype; with `lse` the
// (B, Hq, R) float32 natural log-sum-exp of each row. A row with no valid entry gives 0, and
// lse -inf (the sink's logit with sinks). Throws TypeError / ArgumentError naming the argument
// (with Python's message, in Python's order) or NoBundleEntryError before anything runs;
// DispatchError / CompileError from the device.
void sparse_attention(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& indices, const TensorView& out,
                      const SparseOptions& options = {}, const TensorView* lse = nullptr);

// The exact gradients of sparse_attention: dq, dk, dv (laid out like q, k, v, contiguous, of
// q's dtype) and with sinks dsinks ((Hq,) float32; dropped when null). o and lse are what
// sparse_attention returned, dout the output's gradient. dk and dv sum over the query heads of
// each kv head and over every listing of a key; deterministic (no atomics). When v is a view of
// k, dk and dv are separate: the caller sums them. Errors as sparse_attention's, and the
// backward's own for o, lse and dout (Python's).
void sparse_attention_backward(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& indices, const TensorView& o,
                               const TensorView& lse, const TensorView& dout, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const SparseOptions& options = {},
                               const TensorView* dsinks = nullptr);

// The same, encoded into the caller's batch (see attention's).
void sparse_attention(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& indices, const TensorView& out,
                      const SparseOptions& options = {}, const TensorView* lse = nullptr);
void sparse_attention_backward(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& indices, const TensorView& o,
                               const TensorView& lse, const TensorView& dout, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const SparseOptions& options = {},
                               const TensorView* dsinks = nullptr);

// sparse_topk's keyword arguments, Python's names and defaults (return_scores: pass topk_scores).
struct SparseTopkOptions {
  bool causal = true;               // key c is a candidate for row r iff c <= r + C - R (lower right)
  Layout layout = Layout::bhsd;
  std::string precision = "float";  // or "int8": q and k quantized per token, multiplied as integers
};

// DeepSeek's lightning indexer and top-k (Python's sparse_topk): q (B, Hi, R, Di), k (B, 1, C, Di)
// of q's float dtype, weights float32 (B, Hi, R) ("bshd": the sequence and head axes swapped);
// score[b, r, c] = sum over h of weights[b, h, r] * relu(q[b, h, r] . k[b, 0, c]) in float32. Writes
// `indices`, int32 (B, 1, R, topk) ("bshd": (B, R, 1, topk)), contiguous: each row's topk candidates
// by descending score (ties: the lower key first; NaN above every number), padded with -1 — the
// lists sparse_attention takes, shared by every kv head; with `topk_scores` (float32, the same
// shape, contiguous) their scores (-inf at padding). What a bundle entry fixes ("sparse_topk" spec
// keys): the dtype, Di, the layout, causal and the precision; B, Hi, R, C, topk and the strides of
// q, k and weights are runtime values. Errors as sparse_attention's, with Python's messages.
void sparse_topk(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                 const TensorView& weights, std::int64_t topk, const TensorView& indices,
                 const SparseTopkOptions& options = {}, const TensorView* topk_scores = nullptr);
void sparse_topk(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                 const TensorView& weights, std::int64_t topk, const TensorView& indices,
                 const SparseTopkOptions& options = {}, const TensorView* topk_scores = nullptr);

}  // namespace mfa
