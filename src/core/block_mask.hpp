// A caller's mfa::BlockMask checked as python/mfa_native/ops/block_mask.py
// checks one, with its messages in its order: the constructor's checks (types,
// ranks, pairs, leading axes, mask bits), then for one problem the lists'
// shapes and counted entries by their declaration (every call: they are
// contents), and the lists
// bound as the kernels read them (C-contiguous, leading axes broadcast to the
// lists' joint ones, as Python's copies).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checked_view.hpp"
#include "declaration.hpp"
#include "mfa/block_sparse.hpp"
#include "mfa/device.hpp"

namespace mfa::block_mask {

// A block mask's lists and mask bits by name, in the order the passes bind them (block_mask.py's
// PAIRS, then BITS), each checked as BlockMask's constructor checks it.
class Lists {
 public:
  explicit Lists(const BlockMask& mask);

  // block_mask.checked's checks for a problem of these sizes: the mask's shape, then the lists
  // by `declaration` (the bundle's "block_lists", ops/block_lists.py): their shapes, counts,
  // counted entries and bits.
  void check(const Declaration& declaration, std::int64_t B, std::int64_t Hq, std::int64_t R, std::int64_t C) const;

  bool has(const std::string& name) const { return views_.count(name) != 0; }
  // The lists' joint leading axes (B|1, H|1).
  std::pair<std::int64_t, std::int64_t> lead() const { return lead_; }
  std::pair<std::int64_t, std::int64_t> block_size() const { return block_size_; }
  // The runtime sizes of the lists' widths and the bits' words (Wp, Wf, Wq, Wqf, Wb).
  std::map<std::string, std::int64_t> widths() const;
  // Each list as the kernels read it: its leading axes broadcast to lead(), C-contiguous
  // (packed into a pool buffer on `device` where the given view is not).
  std::map<std::string, Checked> bound(const Device& device) const;

 private:
  void add(const std::string& name, const TensorView& view, std::size_t rank);

  std::vector<std::string> names_;  // in binding order
  std::map<std::string, Checked> views_;
  std::pair<std::int64_t, std::int64_t> block_size_;
  std::optional<std::pair<std::int64_t, std::int64_t>> shape_;
  std::pair<std::int64_t, std::int64_t> lead_ = {1, 1};
};

// block_sparse.py's _with_rule: the call's causal, window and mask, the mask's rule filling
// those not given (ArgumentError naming one that contradicts it); without a rule, causal none.
void apply_rule(const BlockMask& mask, const BlockSparseOptions& given, AttentionOptions& options);

}  // namespace mfa::block_mask
