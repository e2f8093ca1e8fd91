// mfa::sparse_attention and sparse_attention_backward: their declarations'
// checks (attention's arrays, no causal, window or mask; then the token lists,
// indices and topk_length with its contents, every call; then score_mod), then
// the entry's pass (attention_runner.hpp) with the lists bound and their width
// and strides as runtime sizes. mfa::sparse_topk: python/mfa_native/ops/topk.py's checks in
// its order, then the indexer's pass (q, k and weights strides at run time).
#include <algorithm>
#include <limits>
#include <map>

#include "attention_runner.hpp"
#include "mfa/sparse.hpp"
#include "view_packing.hpp"

namespace mfa {

namespace {

using attention_problem::Problem;
using namespace attention_runner;

constexpr const char* kSparse = "sparse_attention";

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
    given["mask"] = nullptr;
    given["sinks"] = options.sinks ? &*options.sinks : nullptr;
    given["alibi_slopes"] = options.alibi_slopes ? &*options.alibi_slopes : nullptr;
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
    std::vector<bool> candidates = {shared_};
    if (shared_ || backward) candidates.push_back(!shared_);
    const BundleEntry* entry = nullptr;
    for (std::size_t i = 0; i < candidates.size() && !entry; ++i) {
      want.shared_latent = candidates[i];
      entry = find_entry(bundle_, want);
    }
    want.shared_latent = shared_;
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

// ops/topk.py's _arrays and _candidates, and the entry's pass (its sizes and views).
class TopkCall {
 public:
  TopkCall(const Device& device, const TensorView& q, const TensorView& k, const TensorView& weights,
           std::int64_t topk, const TensorView& indices, const SparseTopkOptions& options,
           const TensorView* topk_scores)
      : device_(device), options_(options), bhsd_(options.layout == Layout::bhsd), K_(topk) {
    if (q.dtype != DType::float32 && q.dtype != DType::float16 && q.dtype != DType::bfloat16)
      throw TypeError(std::string("q must be float32, float16 or bfloat16 (ml_dtypes), got ") + to_string(q.dtype));
    if (k.dtype != q.dtype)
      throw TypeError(std::string("k has dtype ") + to_string(k.dtype) + " but q has " + to_string(q.dtype) +
                      "; q and k must share one dtype");
    if (weights.dtype != DType::float32)
      throw TypeError(std::string("weights must be float32, got ") + to_string(weights.dtype));
    if (topk < 0) throw ArgumentError("topk must not be negative, got " + std::to_string(topk));
    if (options.precision != "float" && options.precision != "int8")
      throw ArgumentError("precision must be 'float' or 'int8', got '" + options.precision + "'");
    for (const auto& [x, name] : {std::pair(&q, "q"), std::pair(&k, "k")})
      if (x->shape.size() != 4)
        throw ArgumentError(std::string(name) + " must have 4 dimensions, got shape " + shape_text(x->shape));
    const std::vector<std::int64_t> qs = logical(q.shape), ks = logical(k.shape);
    B_ = qs[0], Hi_ = qs[1], R_ = qs[2], Di_ = qs[3], C_ = ks[2];
    if (ks[0] != B_ || ks[1] != 1 || ks[3] != Di_)
      throw ArgumentError(std::string("k must have shape ") + (bhsd_ ? "(B, 1, C, Di)" : "(B, C, 1, Di)") +
                          " with q's B = " + std::to_string(B_) + " and Di = " + std::to_string(Di_) + ", got " +
                          shape_text(k.shape));
    const std::vector<std::int64_t> expected = bhsd_ ? std::vector<std::int64_t>{B_, Hi_, R_}
                                                     : std::vector<std::int64_t>{B_, R_, Hi_};
    if (weights.shape != expected)
      throw ArgumentError("weights must have shape " + shape_text(expected) + ", got " + shape_text(weights.shape));
    if (std::min(topk, C_) > kTopkLimit)
      throw ArgumentError("topk is " + std::to_string(topk) + " with " + std::to_string(C_) + " keys: at most " +
                          std::to_string(kTopkLimit) + " keys are kept per row (min(topk, C) must not exceed it; "
                          "the running top-k lives in threadgroup memory)");
    for (const auto& [name, size] : {std::pair("B (batch)", B_), std::pair("Hi (indexer heads)", Hi_),
                                     std::pair("R (query length)", R_), std::pair("C (key length)", C_),
                                     std::pair("topk", topk)})
      if (size > attention_problem::kMaxIndex)
        throw ArgumentError(std::string(name) + " is " + std::to_string(size) + "; it must be below 2**31");
    q_ = checked(q, "q"), k_ = checked(k, "k"), weights_ = checked(weights, "weights");
    outputs_["indices"] = output(indices, "indices", DType::int32);
    if (topk_scores) outputs_["topk_scores"] = output(*topk_scores, "topk_scores", DType::float32);
  }

  bool empty() const { return B_ * Hi_ * R_ * C_ * K_ == 0 || Di_ == 0; }

  // _candidates: -1 (score -inf) everywhere; with no indexer head or feature (every score 0) each
  // row's first min(candidates, topk) keys in order, score 0.
  void write_candidates() const {
    auto* listed = static_cast<std::int32_t*>(outputs_.at("indices").view->data);
    float* scores = outputs_.count("topk_scores") ? static_cast<float*>(outputs_.at("topk_scores").view->data)
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

  void run(CommandBatch* batch, const Bundle& bundle) {
    if (options_.precision == "int8" && Di_ * 127 * 127 >= (std::int64_t(1) << 24))  // topk_scores.py's check_exact
      throw ArgumentError("precision='int8' needs Di * 127**2 < 2**24 (Di <= 1040), got Di = " + std::to_string(Di_));
    BundleFacts want;
    want.op = "sparse_topk";
    want.dtype = to_string(q_.view->dtype);
    want.head_dim = want.value_dim = Di_;
    want.causal = options_.causal ? "lower_right" : "none";
    want.mask = "none";
    want.layout = attention_problem::layout_name(options_.layout);
    want.family = "any";  // the indexer's kernels use no tile table
    want.precision = options_.precision;
    const BundleEntry& entry = entry_for(bundle, want);
    PassViews views;
    SizeEnv sizes = {{"B", B_}, {"Hi", Hi_}, {"R", R_}, {"C", C_}, {"K", K_},
                     {"P", std::int64_t(device_.tuning().parallel_threadgroups)}};
    add(views, sizes, "q", q_, view_packing::Reads::strided);
    add(views, sizes, "k", k_, view_packing::Reads::strided);
    add(views, sizes, "weights", weights_, view_packing::Reads::strided_broadcast);
    for (const auto& [name, view] : outputs_) views.arrays[name] = Bound{&view};
    if (!outputs_.count("topk_scores")) views.arrays["topk_scores"] = Bound{nullptr, true};
    attention_runner::run(device_, batch, entry.forward, entry.line, sizes, views);
  }

 private:
  static constexpr std::int64_t kTopkLimit = 2048;  // topk_stream.py's TOPK_LIMIT

  // Memory-order values of a (batch, head, row, ...) array in logical order.
  std::vector<std::int64_t> logical(std::vector<std::int64_t> memory) const {
    if (!bhsd_ && memory.size() >= 3) std::swap(memory[1], memory[2]);
    return memory;
  }

  // Binds `view` made addressable, its logical (batch, head, row) strides as runtime sizes.
  void add(PassViews& views, SizeEnv& sizes, const std::string& name, Checked view,
           view_packing::Reads reads) const {
    view_packing::make_addressable(device_, view, reads);
    const std::vector<std::int64_t> strides = logical(view.strides);
    const char* axes[3] = {"batch", "head", "row"};
    for (int i = 0; i < 3; ++i) sizes[name + "_" + axes[i] + "_stride"] = strides[i];
    views.add(name, std::move(view));
  }

  // An output the caller gives: `dtype`, the indices' shape, contiguous.
  Checked output(const TensorView& view, const std::string& name, DType dtype) const {
    if (view.dtype != dtype)
      throw TypeError(name + " must be " + to_string(dtype) + ", got " + to_string(view.dtype));
    const std::vector<std::int64_t> shape = bhsd_ ? std::vector<std::int64_t>{B_, 1, R_, K_}
                                                  : std::vector<std::int64_t>{B_, R_, 1, K_};
    if (view.shape != shape)
      throw ArgumentError(name + " must have shape " + (bhsd_ ? "(B, 1, R, topk)" : "(B, R, 1, topk)") + " = " +
                          shape_text(shape) + ", got " + shape_text(view.shape));
    Checked out = checked(view, name);
    if (out.elements) require_contiguous(out);  // an empty one's strides mean nothing
    return out;
  }

  const Device& device_;
  const SparseTopkOptions& options_;
  bool bhsd_;
  std::int64_t B_ = 0, Hi_ = 0, R_ = 0, C_ = 0, K_ = 0, Di_ = 0;
  Checked q_, k_, weights_;
  std::map<std::string, Checked> outputs_;
};

void run_topk(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
              const TensorView& k, const TensorView& weights, std::int64_t topk, const TensorView& indices,
              const SparseTopkOptions& options, const TensorView* topk_scores) {
  TopkCall call(device, q, k, weights, topk, indices, options, topk_scores);
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
