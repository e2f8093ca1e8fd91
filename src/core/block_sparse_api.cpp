// mfa::block_sparse_attention and block_sparse_attention_backward:
// python/mfa_native/ops/block_sparse.py in C++, with its messages, in its
// order: the block mask as BlockMask's constructor checks it, its rule filling
// causal, window and mask (block_mask.hpp), attention's checks (the declaration
// of attention or attention_backward), the lists against the problem (every
// call), then score_mod; then the entry's pass runs (attention_runner.hpp) with
// the lists bound and their widths as runtime sizes. A backward given the
// transposed lists checks them against those its pass built, after it, as
// Python's does.
#include <algorithm>
#include <map>
#include <optional>
#include <tuple>
#include <vector>

#include "attention_runner.hpp"
#include "block_mask.hpp"
#include "mfa/block_sparse.hpp"

namespace mfa {

namespace {

using attention_problem::Problem;
using namespace attention_runner;

constexpr const char* kBlockSparse = "block_sparse_attention";
constexpr const char* kDiffer = "q_lists_differ";  // codegen.Q_LISTS_DIFFER

// The options of attention's checks: the call's, causal, window and mask resolved by the mask's rule.
AttentionOptions attention_options(const BlockMask& mask, const BlockSparseOptions& o) {
  AttentionOptions a;
  a.scale = o.scale, a.sinks = o.sinks, a.layout = o.layout, a.softcap = o.softcap;
  a.alibi_slopes = o.alibi_slopes, a.score_mod = o.score_mod, a.score_mod_tensors = o.score_mod_tensors;
  block_mask::apply_rule(mask, o, a);
  return a;
}

// One call: the mask's own checks, its rule, attention's checks by `declaration` on `given`,
// the lists against the problem, then score_mod's.
class BlockSparseCall {
 public:
  BlockSparseCall(const Device& device, const Bundle& bundle, const std::string& declaration, const BlockMask& mask,
                  const BlockSparseOptions& options, std::map<std::string, const TensorView*> given)
      : device_(device), bundle_(bundle), lists_(mask), attention_(attention_options(mask, options)) {
    binder_.emplace(bundle.contents().declaration(declaration), attention_problem::layout_name(options.layout),
                    attention_problem::with_option_arrays(std::move(given), attention_));
    problem_ = attention_problem::checked_problem(*binder_, attention_,
                                                  [&](const Problem& p) {
      lists_.check(bundle.contents().declaration("block_lists"), p.B, p.Hq, p.R, p.C);
    });
  }

  const Binder& binder() const { return *binder_; }
  const Problem& problem() const { return problem_; }
  const AttentionOptions& attention() const { return attention_; }

  // The entry's forward or backward pass for the call, run on its views (or encoded into `batch`).
  void run(CommandBatch* batch, bool backward) {
    const BundleFacts want = facts(backward);
    const BundleEntry& entry = entry_for(bundle_, want);
    PassViews views(device_, *binder_, attention_);
    for (auto& [name, view] : lists_.bound(device_)) views.add(name, std::move(view));
    SizeEnv sizes = sizes_of(problem_, device_, entry, views);
    for (const auto& [name, width] : lists_.widths()) sizes[name] = width;
    const bool check = want.q_lists && !batch;  // an encoded call cannot read the check before it runs
    if (want.q_lists) bind_differ(views, !check);
    attention_runner::run(device_, batch, backward ? entry.backward : entry.forward, entry.line, sizes, views);
    if (check) check_transposed();
  }

 private:
  // The entry facts the call needs: attention's and its block mask's.
  BundleFacts facts(bool backward) const {
    BundleFacts want = facts_of(problem_, device_.tuning().family, backward);
    want.op = kBlockSparse;
    std::tie(want.q_block, want.k_block) = lists_.block_size();
    want.shared_batch = lists_.lead().first == 1, want.shared_heads = lists_.lead().second == 1;
    want.full_blocks = lists_.has("full_kv_num_blocks"), want.mask_bits = lists_.has("kv_bits");
    want.q_lists = backward && lists_.has("q_num_blocks");
    return want;
  }

  // The pass's q_lists_differ output, (B|1, H|1, key blocks): host memory read after the pass,
  // or (`scratch`) pool memory nobody reads.
  void bind_differ(PassViews& views, bool scratch) {
    if (scratch) {
      views.arrays[kDiffer] = Bound{nullptr, true};
      return;
    }
    const std::int64_t key_blocks = (problem_.C + lists_.block_size().second - 1) / lists_.block_size().second;
    const auto [batch, heads] = lists_.lead();
    differ_.assign(std::size_t(batch * heads * key_blocks), 0);
    differ_view_ = TensorView{differ_.data(), DType::int32, {batch, heads, key_blocks}, {}};
    views.add(kDiffer, checked(differ_view_, kDiffer));
  }

  // block_sparse.py's _transpose_check: ArgumentError naming the first given q list (q_indices,
  // then full_q_indices) the pass found not the transpose of its kv list.
  void check_transposed() const {
    const std::int64_t heads = differ_view_.shape[1], blocks = differ_view_.shape[2];
    struct Given {
      std::int32_t bit;
      const char *given, *source;
    };
    for (const Given& list : {Given{1, "q_indices", "kv_indices"}, Given{2, "full_q_indices", "full_kv_indices"}}) {
      const auto wrong = [&](std::int32_t flags) { return (flags & list.bit) != 0; };
      const auto first = std::find_if(differ_.begin(), differ_.end(), wrong);
      if (first == differ_.end()) continue;
      const std::int64_t at = first - differ_.begin();
      throw ArgumentError(std::string(list.given) + " is not the transpose of " + list.source + " for " +
                          std::to_string(std::count_if(differ_.begin(), differ_.end(), wrong)) +
                          " key block(s), the first key block " + std::to_string(at % blocks) + " of list batch " +
                          std::to_string(at / blocks / heads) + ", head " + std::to_string(at / blocks % heads) +
                          ": the counted part of a key block's list must hold the query blocks whose " + list.source +
                          " list it, each as often as listed, in any order");
    }
  }

  const Device& device_;
  const Bundle& bundle_;
  block_mask::Lists lists_;
  AttentionOptions attention_;
  std::optional<Binder> binder_;
  Problem problem_;
  std::vector<std::int32_t> differ_;
  TensorView differ_view_{nullptr, DType::int32, {}, {}};
};

void forward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
             const TensorView& k, const TensorView& v, const BlockMask& mask, const TensorView& out,
             const BlockSparseOptions& options, const TensorView* lse) {
  BlockSparseCall call(device, bundle, "attention", mask, options,
                       {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", lse}});
  if (call.problem().empty()) return write_empty_forward(call.binder(), call.problem(), call.attention());
  call.run(batch, false);
}

void backward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
              const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
              const TensorView& dout, const BlockMask& mask, const TensorView& dq, const TensorView& dk,
              const TensorView& dv, const BlockSparseOptions& options, const TensorView* dsinks) {
  BlockSparseCall call(device, bundle, "attention_backward", mask, options,
                       {{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}, {"lse", &lse}, {"do", &dout}, {"dq", &dq},
                        {"dk", &dk}, {"dv", &dv}, {"dsinks", dsinks}});
  if (call.problem().empty()) return write_empty_backward(call.binder());
  call.run(batch, true);
}

}  // namespace

void block_sparse_attention(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                            const TensorView& v, const BlockMask& block_mask, const TensorView& out,
                            const BlockSparseOptions& options, const TensorView* lse) {
  forward(device, nullptr, bundle, q, k, v, block_mask, out, options, lse);
}

void block_sparse_attention(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                            const TensorView& v, const BlockMask& block_mask, const TensorView& out,
                            const BlockSparseOptions& options, const TensorView* lse) {
  forward(batch.device(), &batch, bundle, q, k, v, block_mask, out, options, lse);
}

void block_sparse_attention_backward(const Device& device, const Bundle& bundle, const TensorView& q,
                                     const TensorView& k, const TensorView& v, const TensorView& o,
                                     const TensorView& lse, const TensorView& dout, const BlockMask& block_mask,
                                     const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                     const BlockSparseOptions& options, const TensorView* dsinks) {
  backward(device, nullptr, bundle, q, k, v, o, lse, dout, block_mask, dq, dk, dv, options, dsinks);
}

void block_sparse_attention_backward(CommandBatch& batch, const Bundle& bundle, const TensorView& q,
                                     const TensorView& k, const TensorView& v, const TensorView& o,
                                     const TensorView& lse, const TensorView& dout, const BlockMask& block_mask,
                                     const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                     const BlockSparseOptions& options, const TensorView* dsinks) {
  backward(batch.device(), &batch, bundle, q, k, v, o, lse, dout, block_mask, dq, dk, dv, options, dsinks);
}

}  // namespace mfa
