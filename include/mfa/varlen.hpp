// mfa::attention_varlen and attention_varlen_backward: attention over packed sequences
// (flash-attn's varlen layout), Python's mfa_native.attention_varlen and its backward run from
// a bundle's "attention_varlen" entries.
//
// q (total_q, Hq, D), k (total_k, Hkv, D) and v (total_k, Hkv, Dv) hold B sequences packed
// along their rows: sequence b is q's rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) attending
// k's and v's rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]). cu_seqlens_q and cu_seqlens_k are
// int32 (B + 1,), non-decreasing from 0 to total_q and total_k; their contents (and
// seqused_k's and the block table's) are checked, and the work tables built from them, on
// every call, before anything is written, with Python's messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfa/attention.hpp"

namespace mfa {

struct VarlenOptions {
  // Hints, as flash-attn takes them: if given, at least the longest sequence's query (key)
  // count. max_seqlen_q (else total_q) also bounds every sequence's queries, which decides
  // whether a forward packs grouped query heads, as Python does.
  std::optional<std::int64_t> max_seqlen_q;
  std::optional<std::int64_t> max_seqlen_k;
  std::optional<double> scale;              // default 1/sqrt(D); a runtime value
  Causal causal = Causal::none;             // lower_right: flash-attn's causal=True, per sequence
  std::optional<std::pair<std::int64_t, std::int64_t>> window;  // as AttentionOptions::window, per sequence
  std::optional<TensorView> sinks;          // float32 (Hq,)
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes;   // float32 (Hq,) or per sequence (B, Hq)
  // A traced score_mod and its tensors, as AttentionOptions' (b: the sequence; q_idx and
  // kv_idx: positions inside it).
  std::string score_mod;
  std::vector<TensorView> score_mod_tensors;
  Deterministic deterministic = Deterministic::run_to_run;  // as AttentionOptions'
  // int32 (B, max_blocks), forward only: k and v are pages (num_blocks, page_size, Hkv, D)
  // following each other and sequence b's key position p is row p % page_size of page
  // block_table[b, p / page_size]; its keys are cu_seqlens_k's count (which may then end
  // anywhere), seqused_k's, or (cu_seqlens_k null) every listed page's.
  const TensorView* block_table = nullptr;
  // int32 (B,), forward only (flash-attn 3's): sequence b uses its first seqused_k[b] keys of
  // its rows of k (an entry with seqused_k: true serves such calls).
  const TensorView* seqused_k = nullptr;
};

// Writes o (total_q, Hq, Dv) of q's dtype and, if `lse` is given, lse (Hq, total_q) float32
// (natural log of each row's softmax denominator; -inf for a row with no key and no sink).
void attention_varlen(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
                      const TensorView& out, const VarlenOptions& options = {}, const TensorView* lse = nullptr);
// The same encoded into `batch` (the work tables live in its pool buffers until it completes).
void attention_varlen(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
                      const TensorView& out, const VarlenOptions& options = {}, const TensorView* lse = nullptr);

// The gradients of attention_varlen (Python's attention_varlen_backward): given o and lse as
// the forward wrote them and do (the gradient of o, shaped and typed like o), writes dq, dk,
// dv (shaped like q, k and v, q's dtype, contiguous) and, with sinks, dsinks (Hq,) float32
// summed over every sequence. block_table and seqused_k are forward-only (NotImplementedError,
// with Python's message).
void attention_varlen_backward(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& o, const TensorView& lse, const TensorView& dout,
                               const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const VarlenOptions& options = {},
                               const TensorView* dsinks = nullptr);
void attention_varlen_backward(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& o, const TensorView& lse, const TensorView& dout,
                               const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const VarlenOptions& options = {},
                               const TensorView* dsinks = nullptr);

}  // namespace mfa
