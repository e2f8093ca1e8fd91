// mfa::sparse_attention and sparse_attention_backward: their declarations'
// checks (attention's arrays, no causal, window or mask; then the token lists,
// indices and topk_length with its contents, every call; then score_mod), then
// the entry's pass (attention_runner.hpp) with the lists bound and their width
// and strides as runtime sizes. mfa::sparse_topk: its options, then its arrays by its
// declaration (python/mfa_native/ops/topk.py's order), then the indexer's pass (q, k and
// weights strides at run time).
#include <algorithm>
#include <limits>
#include <map>

#include "attention_runner.hpp"
#include "mfa/sparse.hpp"

namespace mfa {

namespace {

using attention_problem::Problem;
using namespace attention_runner;

constexpr const char* kSparse = "sparse_attention";
constexpr const char* kTopk = "sparse_topk";

// The element strides of `view` as given (row-major when it has none).
std::vector<std::int64_t> given_strides(const TensorView& view) {
  return view.strides.empty() ? contiguous(view.shape) : view.strides;
}

// sparse.py's _shared_latent: v is k's first Dv features (the same memory, rows and heads).
bool shared_latent(const TensorView& k, const TensorView& v) {
  if (k.dtype != v.dtype || k.shape.size() != 4 || v.shape.size() != 4 || k.data != v.data) return false;
  const std::vector<std::int64_t> ks = given_strides(k), vs = given_strides(v);
  return ks.size() == 4 && vs.size() == 4 && std::equal(k.shape.begin(), k.shape.begin() + 3, v.shape.begin()) &&
         v.shape[3] <= k.shape[3] && std::equal(ks.begin(), ks.begin() + 3, vs.begin());
}

AttentionOptions attention_options(const SparseOptions& o) {
  AttentionOptions a;
  a.scale = o.scale, a.sinks = o.sinks, a.layout = o.layout, a.softcap = o.softcap;
  a.alibi_slopes = o.alibi_slopes, a.score_mod = o.score_mod, a.score_mod_tensors = o.score_mod_tensors;
  return a;
}

// One call, checked by its declaration (sparse_attention's or its backward's: attention's
// arrays, then the lists', then score_mod's).
class SparseCall {
 public:
  SparseCall(const Device& device, const Bundle& bundle, const std::string& declaration, const TensorView& k,
             const TensorView& v, const SparseOptions& options, std::map<std::string, const TensorView*> given)
      : device_(device), bundle_(bundle), options_(options), attention_(attention_options(options)),
        shared_(declaration == kSparse && shared_latent(k, v)) {
    given = attention_problem::with_option_arrays(std::move(given), attention_);
    given["topk_length"] = options.topk_length ? &*options.topk_length : nullptr;
    binder_.emplace(bundle.contents().declaration(declaration), attention_problem::layout_name(options.layout),
                    std::move(given));
    problem_ = attention_problem::checked_problem(*binder_, attention_);
  }

  const Binder& binder() const { return *binder_; }
  const Problem& problem() const { return problem_; }
  const AttentionOptions& attention() const { return attention_; }

  // The entry's forward or backward pass for the call, run on its views (or encoded into `batch`).
  void run(CommandBatch* batch, bool backward) const {
    BundleFacts want = facts_of(problem_, device_.tuning().family, backward);
    want.op = kSparse;
    want.topk_length = options_.topk_length.has_value();
    // A forward whose v is a view of k prefers an entry staging one row for both; an entry reading
    // v on its own gives the same results. Every entry's backward reads v on its own (as Python's).
    want.shared_latent = shared_;
    const BundleEntry* entry = find_entry(bundle_, want);
    if (!entry && (shared_ || backward)) {
      BundleFacts other = want;
      other.shared_latent = !shared_;
      entry = find_entry(bundle_, other);
    }
    if (!entry) entry = &entry_for(bundle_, want);  // throws, listing the bundle's entries
    const PassViews views(device_, *binder_, attention_);
    SizeEnv sizes = sizes_of(problem_, device_, *entry, views);
    sizes["T"] = binder_->size("topk");
    attention_runner::run(device_, batch, backward ? entry->backward : entry->forward, entry->line, sizes, views);
  }

 private:
  const Device& device_;
  const Bundle& bundle_;
  const SparseOptions& options_;
  AttentionOptions attention_;
  bool shared_ = false;
  std::optional<Binder> binder_;
  Problem problem_;
};

void forward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
             const TensorView& k, const TensorView& v, const TensorView& indices, const TensorView& out,
             const SparseOptions& options, const TensorView* lse) {
  const SparseCall call(device, bundle, kSparse, k, v, options,
                        {{"q", &q}, {"k", &k}, {"v", &v}, {"indices", &indices}, {"out", &out}, {"lse", lse}});
  if (call.problem().empty()) return write_empty_forward(call.binder(), call.problem(), call.attention());
  call.run(batch, false);
}

void backward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
              const TensorView& k, const TensorView& v, const TensorView& indices, const TensorView& o,
              const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
              const TensorView& dv, const SparseOptions& options, const TensorView* dsinks) {
  const SparseCall call(device, bundle, "sparse_attention_backward", k, v, options,
                        {{"q", &q}, {"k", &k}, {"v", &v}, {"indices", &indices}, {"o", &o}, {"lse", &lse},
                         {"do", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dsinks", dsinks}});
  if (call.problem().empty()) return write_empty_backward(call.binder());
  call.run(batch, true);
}

// topk.py's options (topk, then precision), checked before its arrays; topk as the size the
// declaration names.
SizeEnv topk_size(std::int64_t topk, const SparseTopkOptions& options) {
  if (topk < 0) throw ArgumentError("topk must not be negative, got " + std::to_string(topk));
  if (options.precision != "float" && options.precision != "int8")
    throw ArgumentError("precision must be 'float' or 'int8', got '" + options.precision + "'");
  return {{"topk", topk}};
}

// ops/topk.py's _arrays (the options, then the arrays by sparse_topk's declaration) and
// _candidates, and the entry's pass (its sizes and views).
class TopkCall {
 public:
  TopkCall(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
           const TensorView& weights, std::int64_t topk, const TensorView& indices,
           const SparseTopkOptions& options, const TensorView* topk_scores)
      : device_(device), options_(options),
        binder_(bundle.contents().declaration(kTopk), attention_problem::layout_name(options.layout),
                {{"q", &q}, {"k", &k}, {"weights", &weights}, {"indices", &indices}, {"topk_scores", topk_scores}},
                topk_size(topk, options)) {
    binder_.bind_sizes();
    binder_.check_others();
    B_ = binder_.size("B"), Hi_ = binder_.size("Hi"), R_ = binder_.size("R"), C_ = binder_.size("C");
    K_ = topk, Di_ = binder_.size("Di");
  }

  bool empty() const { return B_ * Hi_ * R_ * C_ * K_ == 0 || Di_ == 0; }

  // _candidates: -1 (score -inf) everywhere; with no indexer head or feature (every score 0) each
  // row's first min(candidates, topk) keys in order, score 0.
  void write_candidates() const {
    auto* listed = static_cast<std::int32_t*>(binder_.view("indices").view->data);
    float* scores = binder_.given("topk_scores") ? static_cast<float*>(binder_.view("topk_scores").view->data)
                                                 : nullptr;
    for (std::int64_t b = 0; b < B_; ++b)
      for (std::int64_t r = 0; r < R_; ++r) {
        std::int64_t kept = 0;
        if (Hi_ == 0 || Di_ == 0)
          kept = std::min(std::max<std::int64_t>(std::min(options_.causal ? r + C_ - R_ + 1 : C_, C_), 0), K_);
        for (std::int64_t i = 0; i < K_; ++i) {
          const std::int64_t at = (b * R_ + r) * K_ + i;
          listed[at] = i < kept ? std::int32_t(i) : -1;
          if (scores) scores[at] = i < kept ? 0.0f : -std::numeric_limits<float>::infinity();
        }
      }
  }

  void run(CommandBatch* batch, const Bundle& bundle) const {
    if (options_.precision == "int8" && Di_ * 127 * 127 >= (std::int64_t(1) << 24))  // topk_scores.py's check_exact
      throw ArgumentError("precision='int8' needs Di * 127**2 < 2**24 (Di <= 1040), got Di = " + std::to_string(Di_));
    BundleFacts want;
    want.op = kTopk;
    want.dtype = to_string(binder_.view("q").view->dtype);
    want.head_dim = want.value_dim = Di_;
    want.causal = options_.causal ? "lower_right" : "none";
    want.mask = "none";
    want.layout = attention_problem::layout_name(options_.layout);
    want.family = "any";  // the indexer's kernels use no tile table
    want.precision = options_.precision;
    const BundleEntry& entry = entry_for(bundle, want);
    const PassViews views(device_, binder_, AttentionOptions{});  // q, k, weights: (batch, head, row) strides
    SizeEnv sizes = {{"B", B_}, {"Hi", Hi_}, {"R", R_}, {"C", C_}, {"K", K_},
                     {"P", std::int64_t(device_.tuning().parallel_threadgroups)}};
    add_strides(sizes, views);
    attention_runner::run(device_, batch, entry.forward, entry.line, sizes, views);
  }

 private:
  const Device& device_;
  const SparseTopkOptions& options_;
  Binder binder_;
  std::int64_t B_ = 0, Hi_ = 0, R_ = 0, C_ = 0, K_ = 0, Di_ = 0;
};

void run_topk(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
              const TensorView& k, const TensorView& weights, std::int64_t topk, const TensorView& indices,
              const SparseTopkOptions& options, const TensorView* topk_scores) {
  const TopkCall call(device, bundle, q, k, weights, topk, indices, options, topk_scores);
  if (call.empty()) return call.write_candidates();
  call.run(batch, bundle);
}

}  // namespace

void sparse_topk(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                 const TensorView& weights, std::int64_t topk, const TensorView& indices,
                 const SparseTopkOptions& options, const TensorView* topk_scores) {
  run_topk(device, nullptr, bundle, q, k, weights, topk, indices, options, topk_scores);
}

void sparse_topk(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                 const TensorView& weights, std::int64_t topk, const TensorView& indices,
                 const SparseTopkOptions& options, const TensorView* topk_scores) {
  run_topk(batch.device(), &batch, bundle, q, k, weights, topk, indices, options, topk_scores);
}

void sparse_attention(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& indices, const TensorView& out,
                      const SparseOptions& options, const TensorView* lse) {
  forward(device, nullptr, bundle, q, k, v, indices, out, options, lse);
}

void sparse_attention(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& indices, const TensorView& out,
                      const SparseOptions& options, const TensorView* lse) {
  forward(batch.device(), &batch, bundle, q, k, v, indices, out, options, lse);
}

void sparse_attention_backward(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& indices, const TensorView& o,
                               const TensorView& lse, const TensorView& dout, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const SparseOptions& options,
                               const TensorView* dsinks) {
  backward(device, nullptr, bundle, q, k, v, indices, o, lse, dout, dq, dk, dv, options, dsinks);
}

void sparse_attention_backward(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& indices, const TensorView& o,
                               const TensorView& lse, const TensorView& dout, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const SparseOptions& options,
                               const TensorView* dsinks) {
  backward(batch.device(), &batch, bundle, q, k, v, indices, o, lse, dout, dq, dk, dv, options, dsinks);
}

}  // namespace mfa
