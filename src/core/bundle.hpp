// The parsed payload of a bundle file (python/mfa_native/bundle/): the
// declarations of the ops it serves (what the binder checks a call by) and its
// entries, each the facts its kernels bake and its forward and backward pass
// templates. Read once by Bundle::load / from_memory; immutable afterwards.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attention_problem.hpp"
#include "declaration.hpp"
#include "mfa/attention.hpp"
#include "pass_template.hpp"

namespace mfa {

constexpr std::uint32_t kBundleFormatVersion = 4;

struct BundleFacts {
  std::string dtype;       // float32, float16, bfloat16
  std::int64_t head_dim = 0, value_dim = 0, gqa_ratio = 1;
  std::string causal;      // none, lower_right, upper_left
  std::string mask;        // none, bool, additive
  std::string mask_dtype;  // "" without a mask, "bool", or a float dtype
  bool window = false;     // its kernels take the window's sides at run time (every window)
  bool sinks = false;
  std::string layout;      // bhsd, bshd
  std::optional<double> softcap;  // the score transforms: a cap (none: no cap),
  std::string alibi = "none";     // none, per_head or per_batch slopes,
  std::string score_mod;          // a score_mod's text ("": none) and its tensors
  std::vector<attention_problem::ScoreModTensor> score_mod_tensors;
  std::string family;
  bool backward = false;
  bool batch_invariant = false;   // deterministic: batch_invariant (attention, the KV cache, varlen)
  std::string op = "attention";   // or attention_with_kvcache, whose entries also bake:
  std::int64_t page_size = 0;     // 0: a contiguous cache; else rows a page
  std::string cache = "plain";    // k_cache's storage: plain, a GGUF format, affine (bits, group_size
  std::string v_cache = "plain";  // below) or a float8 dtype; and v_cache's
  bool append = false;            // whether a call writes k and v into the cache
  bool seqused_k = false;          // attention_varlen: whether calls give seqused_k
  std::int64_t rotary_dim = 0;    // the rotation of q and the appended k: features that turn (0: none),
  bool rotary_interleaved = true; // GPT-J pairs (else GPT-NeoX halves), and where
  std::string rotary_starts;      // positions start: "cache_seqlens" or "rotary_seqlens"
  bool topk_length = false;       // sparse_attention: whether a call gives the lists' lengths,
  bool shared_latent = false;     // and whether v is a view of k's first Dv features
  std::string precision = "float";  // sparse_topk: "float" or "int8" scores (family "any")
  std::string qk_scale = "token";  // an int8_attention entry's quantization (Int8Problem's):
  bool smooth_k = true;            // token or tile scales of q and k, K's mean subtracted,
  std::string pv = "int8";         // P and V as int8 or float
  std::int64_t parts = 0;          // a merge_attention entry's part count (its other facts:
                                   // dtype, value_dim, layout)
  std::string format;              // a quantize entry's format (its dtype x's), bits and
  std::int64_t bits = 0, group_size = 0;  // group size (a KV-cache entry's affine cache's)
  std::int64_t q_block = 0, k_block = 0;  // block_sparse_attention: the block size (Qb, Kb),
  bool shared_batch = false;       // whether the lists' batch and head axes have extent 1,
  bool shared_heads = false;
  bool full_blocks = false;        // whether the mask has full lists and mask bits, and
  bool mask_bits = false;
  bool q_lists = false;            // whether backward calls give the transposed lists
};

struct BundleEntry {
  BundleFacts facts;
  std::vector<PassTemplate> forward;
  std::vector<PassTemplate> backward;
  std::string line;  // Bundle::entries()'s line
};

struct Bundle::Contents {
  std::map<std::string, Declaration> declarations;  // by op name
  std::vector<BundleEntry> entries;

  // The declaration of `op`; BundleError when the bundle carries none.
  const Declaration& declaration(const std::string& op) const;
};

// Decodes the payload's "metallibs" (sha256 of a kernel source -> its Metal
// library, base64: `bundle --metallib`), if any, and gives every kernel of
// `entries` (parsed from `payload`) whose source has one that library as its
// binary. BundleError for a value that is not base64 (or is empty) and for a
// key that is the sha256 of no kernel source in the payload.
void attach_metallibs(std::vector<BundleEntry>& entries, const json::Value& payload);

// The line `python -m mfa_native bundle --list` prints for an entry.
std::string entry_line(const BundleFacts& facts, std::size_t forward, std::size_t backward);

}  // namespace mfa
