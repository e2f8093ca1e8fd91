// Attention over a KV cache for C++ programs, without Python: Python's
// mfa_native.attention_with_kvcache (flash-attn's flash_attn_with_kvcache) run
// from a bundle whose spec has an "attention_with_kvcache" family.
//
//   mfa::attention_with_kvcache(device, bundle, q, k_pages, v_pages, out,
//                               {&seqlens, &k_new, &v_new, &block_table, {}, mfa::Causal::lower_right});
//
// Semantics, shapes and messages are Python's: q (B, R, Hq, D) ("bshd"); a
// contiguous cache (B, Cmax, Hkv, D), or with block_table its pages
// (num_blocks, page_size, Hkv, D); batch b attends the cache's first
// cache_seqlens[b] + Rn positions, after k and v (B, Rn, Hkv, D / Dv) are
// written into the cache IN PLACE at positions cache_seqlens[b] ..
// cache_seqlens[b] + Rn - 1 (page block_table[b, p / page_size], row
// p % page_size), quantized on the way for a quantized cache (a float8 one: k /
// k_descale rounded to float8). Every check runs
// before anything is written. On the cpu backend the results and the appended
// rows are bit-identical to Python's for the same inputs.
//
// What a bundle entry fixes (spec keys): the dtype, D, Dv, the GQA ratio,
// causal, whether it takes a window, sinks, softcap and ALiBi as for attention,
// the page size (contiguous or `page_size` rows a page), the caches' storage
// ("plain", a GGUF format, "affine" with its bits and group size, "float8_e4m3fn"
// or "float8_e5m2"; k's and v's may differ), whether the call appends, and its rotation (the
// rotary dim, interleaved or not, whether rotary_seqlens is given). Batch,
// heads, lengths, Rn, the block table's width, page counts, the tables'
// length, the window's sides, the scale and q's strides are runtime values. The caches are read and written in
// place and must be contiguous (pages following each other).
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "mfa/attention.hpp"

namespace mfa {

// A logical float tensor stored quantized along its last axis, in caller memory
// (Python's QuantizedTensor, checked as its constructor checks one, with its
// messages): `format` is MLX's "affine" (`data` uint32 words, shape[:-1] +
// (D * bits / 32,), the values a little-endian bit stream of `bits` each; `scales`
// and `biases` shape[:-1] + (D / group_size,) of q's dtype; value = scale * q +
// bias) or one of GGUF's "q8_0", "q4_0", "q4_1", "q5_0", "q5_1" (blocks of 32
// values: a float16 scale, for q4_1/q5_1 a float16 minimum, then the integers; 34,
// 18, 20, 22 or 24 bytes: `data` uint8, shape[:-1] + (D / 32 * block bytes,); no
// scales or biases); every field contiguous (a paged cache's pages following each
// other); `dtype` the logical dtype (q's); bits and group_size affine's (unset: 8
// and 64, Python's defaults; GGUF: unset or the format's own). A cache of zero bytes
// holds zeros; the append quantizes new rows on the device as Python's `quantize` does.
struct QuantizedTensor {
  std::string format;
  TensorView data;
  DType dtype = DType::float32;
  std::optional<TensorView> scales{}, biases{};       // affine only
  std::optional<std::int64_t> bits{}, group_size{};  // unset: Python's None
};

// A K or V cache argument: float elements of q's dtype, float8 elements
// (DType::float8_e4m3fn or float8_e5m2, contiguous: the values are the bytes times
// the descale), or quantized.
struct KVCache {
  KVCache(const TensorView& values) : plain(values) {}         // NOLINT: implicit, as Python takes either
  KVCache(const QuantizedTensor& stored) : quantized(stored) {}  // NOLINT
  std::optional<TensorView> plain;
  std::optional<QuantizedTensor> quantized;
};

// attention_with_kvcache's keyword arguments, Python's names and defaults.
struct KVCacheOptions {
  // int32 (B,): each batch's valid cache length before this call (not modified). Null:
  // every batch's is the capacity (Cmax, or max_blocks * page_size); required with k and v.
  const TensorView* cache_seqlens = nullptr;
  const TensorView* k = nullptr;            // (B, Rn, Hkv, D) of q's dtype, appended in place
  const TensorView* v = nullptr;            // (B, Rn, Hkv, Dv), given with k
  const TensorView* block_table = nullptr;  // int32 (B, max_blocks): the caches are pages
  // The rotary embedding of q and the appended k (flash-attn's): tables (seqlen_ro,
  // rotary_dim / 2) of q's dtype, given together and with k and v; row i of batch b turns at
  // position rotary_seqlens[b] (else cache_seqlens[b]) + i (q's rows all at the start unless
  // causal or a window); pairs (2j, 2j + 1) when interleaved, else (j, j + rotary_dim / 2).
  const TensorView* rotary_cos = nullptr;
  const TensorView* rotary_sin = nullptr;
  const TensorView* rotary_seqlens = nullptr;  // int32 (B,)
  bool rotary_interleaved = true;
  std::optional<double> scale;              // default 1/sqrt(D); a runtime value
  Causal causal = Causal::none;             // lower_right: flash-attn's causal=True
  std::optional<std::pair<std::int64_t, std::int64_t>> window;  // as AttentionOptions::window
  std::optional<TensorView> sinks;          // float32 (Hq,)
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes;   // float32 (Hq,) or (B, Hq)
  // A traced score_mod and its tensors, as AttentionOptions' (kv_idx: the key's row in the
  // cache, q_idx: the query's row of R).
  std::string score_mod;
  std::vector<TensorView> score_mod_tensors;
  // A float8 cache's factors (flash-attn 3's descales): float32 (B, Hkv), any strides
  // (read from a packed copy), or a single factor ((1,) or 0-d); null is 1. k_descale (v_descale) for a float8
  // k_cache (v_cache) only: its keys are k_cache * k_descale[b, kv head], and an appended k is
  // stored as float8(k / k_descale) (e4m3fn saturating at +-448, e5m2 overflowing to inf).
  // q_descale multiplies q (query head h by its kv head's factor), folded into K's factor: it
  // needs a float8 k_cache.
  const TensorView* q_descale = nullptr;
  const TensorView* k_descale = nullptr;
  const TensorView* v_descale = nullptr;
  Deterministic deterministic = Deterministic::run_to_run;  // as AttentionOptions'
};

// out (B, R, Hq, Dv), contiguous, of q's dtype; with `lse` the (B, Hq, R) float32
// log-sum-exp of each row. Throws TypeError / ArgumentError naming the argument
// (with Python's message) or NoBundleEntryError before anything is written;
// DispatchError / CompileError from the device.
void attention_with_kvcache(const Device& device, const Bundle& bundle, const TensorView& q, const KVCache& k_cache,
                            const KVCache& v_cache, const TensorView& out, const KVCacheOptions& options = {},
                            const TensorView* lse = nullptr);
// The same, encoded into the caller's batch (see attention's).
void attention_with_kvcache(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const KVCache& k_cache,
                            const KVCache& v_cache, const TensorView& out, const KVCacheOptions& options = {},
                            const TensorView* lse = nullptr);

}  // namespace mfa
