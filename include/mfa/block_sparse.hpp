// Block-sparse attention for C++ programs, without Python: Python's
// mfa_native.block_sparse_attention (FlexAttention's BlockMask: each query block
// visits the key blocks its lists name) and block_sparse_attention_backward, run
// from a bundle whose spec has a "block_sparse_attention" family.
//
//   mfa::BlockMask mask{kv_num_blocks, kv_indices};   // int32 views of caller memory
//   mask.block_size = {64, 64};
//   mfa::block_sparse_attention(device, bundle, q, k, v, mask, out, {/*scale*/ {}, mfa::Causal::lower_right});
//
// Semantics, shapes and messages are Python's: q, k, v, out and lse as attention's. Query
// (b, h, r) sees key c iff c lies in a key block its query block (r / Qb) lists: in the full
// lists always, in the partial lists where causal, window, a boolean mask and the mask bits
// allow (r, c), as in attention. A block listed twice is visited twice. The lists are int32
// (B or 1, Hq or 1, ceil(R / Qb)[, width]), their leading axes of extent 1 shared (over the
// batch, over the query heads); their counts and counted entries are checked on every call,
// before anything runs. On the cpu backend the results are bit-identical to Python's.
//
// What a bundle entry fixes (spec keys): attention's facts (dtype, D, Dv, the GQA ratio,
// causal, the mask's kind, window, sinks, the layout, the score transforms), the block size,
// whether the lists' batch and head axes are shared (extent 1), whether the mask has full
// lists and mask bits, and for the backward whether calls give the transposed (q) lists.
// The lists' widths, the bits' length, the scale, every size and q, k, v's strides are
// runtime values. Lists that are not contiguous, or whose leading axes are 1 where another
// list's are not, are copied first (Python's BlockMask copies them too).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfa/attention.hpp"

namespace mfa {

// The rule of a block mask built from dense rules (Python's BlockMask.from_mask keeps it):
// what a call applies inside partial blocks when it gives no causal, window or mask itself.
struct BlockMaskRule {
  Causal causal = Causal::none;
  std::optional<std::pair<std::int64_t, std::int64_t>> window;  // as from_mask was given it
  std::optional<TensorView> mask;
};

// Python's mfa_native.BlockMask (FlexAttention's names and shapes), as views of caller memory:
// nothing is copied until a call binds it. Each optional pair comes together.
struct BlockMask {
  BlockMask(TensorView kv_num_blocks, TensorView kv_indices)
      : kv_num_blocks(std::move(kv_num_blocks)), kv_indices(std::move(kv_indices)) {}

  TensorView kv_num_blocks;  // int32 (B|1, H|1, ceil(R / Qb)): partial key blocks per query block
  TensorView kv_indices;     // int32 (B|1, H|1, ceil(R / Qb), W): their key blocks, counted part first
  std::optional<TensorView> full_kv_num_blocks, full_kv_indices;  // full blocks (no rule inside)
  // The transposed lists (per key block, its query blocks): the backward builds them on the
  // device and checks given ones against its build.
  std::optional<TensorView> q_num_blocks, q_indices, full_q_num_blocks, full_q_indices;
  // Mask bits of the partial blocks (FlexAttention's mask_mod, Python's from_torch): int32
  // (B|1, H|1, ceil(R / Qb)) first bit block of each list, and int32 (words,) bits.
  std::optional<TensorView> kv_bit_blocks, kv_bits;
  std::pair<std::int64_t, std::int64_t> block_size = {128, 128};  // (Qb, Kb)
  std::optional<std::pair<std::int64_t, std::int64_t>> seq_lengths;  // (R, C), Python's shape: checked when given
  std::optional<BlockMaskRule> rule;  // from_mask's; none for lists given as they are
};

// block_sparse_attention's keyword arguments, Python's names, order and defaults.
struct BlockSparseOptions {
  std::optional<double> scale;                              // default 1/sqrt(D); a runtime value
  std::optional<Causal> causal;                             // none given: the rule's, else Causal::none
  std::optional<TensorView> mask;                           // as attention's; none given: the rule's
  std::optional<std::pair<std::int64_t, std::int64_t>> window;  // as attention's; none given: the rule's
  std::optional<TensorView> sinks;                          // float32 (Hq,)
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes;
  std::vector<TensorView> score_mod_tensors;
  std::string score_mod;                                    // a traced score_mod's text ("": none)
  Layout layout = Layout::bhsd;
};

// out (q's layout, (B, Hq, R, Dv) in "bhsd"), contiguous, of q's dtype; with `lse` the (B, Hq, R)
// float32 natural log-sum-exp of each row. A row that sees nothing gives 0, and lse -inf (the
// sink's logit with sinks). Throws TypeError / ArgumentError with Python's message, in Python's
// order (the mask's lists as BlockMask's constructor checks them, causal, window or mask
// contradicting the rule, attention's checks, the lists against the problem, score_mod), or
// NoBundleEntryError, before anything runs; DispatchError / CompileError from the device.
void block_sparse_attention(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                            const TensorView& v, const BlockMask& block_mask, const TensorView& out,
                            const BlockSparseOptions& options = {}, const TensorView* lse = nullptr);

// The gradients of block_sparse_attention: dq, dk, dv (laid out like q, k, v, contiguous, of
// q's dtype) and with sinks dsinks ((Hq,) float32; dropped when null). o and lse are what the
// forward returned for the same mask, dout the output's gradient. Deterministic (no atomics):
// the dK/dV kernel walks the transposed lists the pass builds from the kv lists. Given q lists
// are checked against that build after the pass, as Python does (ArgumentError naming
// q_indices or full_q_indices; the outputs are written by then). Errors otherwise as the
// forward's, and the backward's own for o, lse and dout.
void block_sparse_attention_backward(const Device& device, const Bundle& bundle, const TensorView& q,
                                     const TensorView& k, const TensorView& v, const TensorView& o,
                                     const TensorView& lse, const TensorView& dout, const BlockMask& block_mask,
                                     const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                     const BlockSparseOptions& options = {}, const TensorView* dsinks = nullptr);

// The same, encoded into the caller's batch (see attention's). The backward cannot read the
// pass's check of given q lists before the caller's batch completes: encoded, it skips it (the
// gradients never depend on them).
void block_sparse_attention(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                            const TensorView& v, const BlockMask& block_mask, const TensorView& out,
                            const BlockSparseOptions& options = {}, const TensorView* lse = nullptr);
void block_sparse_attention_backward(CommandBatch& batch, const Bundle& bundle, const TensorView& q,
                                     const TensorView& k, const TensorView& v, const TensorView& o,
                                     const TensorView& lse, const TensorView& dout, const BlockMask& block_mask,
                                     const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                     const BlockSparseOptions& options = {}, const TensorView* dsinks = nullptr);

}  // namespace mfa
