// mfa::attention_varlen and its backward: their declarations' checks (the bundle's
// "attention_varlen" and "attention_varlen_backward", python/mfa_native/ops/varlen_rules.py):
// q, k and v packed, (total_q, Hq, D) and (total_k, Hkv, D|Dv), attention's checks, then the
// op's own arrays (the backward's o, lse and do; cu_seqlens, the block table, seqused_k) and
// their contents, those spanning several arrays included (the max_seqlen hints, seqused_k
// within each sequence's rows, the pages each sequence reads), every call, before anything
// is written. Paged k and v are bound as their rows (pages.py's as_rows) once their layout is
// checked (code, as varlen_keys.SequenceKeys does). The pass reads the packed arrays as given
// (one batch: batch strides 0), and the unit tables (codegen/attention/sequences.py's
// unit_table), built here every call into pool buffers (a CommandBatch keeps them alive).
// The per-sequence query bound (max_seqlen_q, else total_q) is the runtime size "Qb": the
// entry's templates are guarded by it (bundle/writer.py's VARLEN_BOUND), and the chosen
// template's "Qu" is the queries of a forward unit, the table's unit.
#include <algorithm>
#include <map>
#include <optional>

#include "attention_runner.hpp"
#include "mfa/varlen.hpp"
#include "pass_template.hpp"

namespace mfa {

namespace {

using attention_problem::Problem;
using namespace attention_runner;

constexpr const char* kBound = "Qb";  // writer.py's VARLEN_BOUND
constexpr const char* kUnit = "Qu";   // the chosen template's forward unit

// varlen._hint: a max_seqlen hint as the declaration's size (varlen_rules.NO_HINT, -1, where not
// given: not checked); ArgumentError when negative.
std::int64_t hint_size(const std::optional<std::int64_t>& hint, const std::string& name) {
  if (!hint) return -1;
  if (*hint < 0) throw ArgumentError(name + " must not be negative, got " + std::to_string(*hint));
  return *hint;
}

// The call: its declaration's checks and the rest of Python's, the unit tables, the entry's pass.
class VarlenCall {
 public:
  // validate_varlen's checks by `declaration` ("attention_varlen" or its backward's) of the
  // call's arrays `given` by declaration name (k and v as given; the options' added here).
  VarlenCall(const Device& device, const Bundle& bundle, const std::string& declaration, const VarlenOptions& o,
             std::map<std::string, const TensorView*> given)
      : device_(device), options_(o) {
    const SizeEnv hints = {{"max_seqlen_q", hint_size(o.max_seqlen_q, "max_seqlen_q")},
                           {"max_seqlen_k", hint_size(o.max_seqlen_k, "max_seqlen_k")}};
    const std::vector<std::int64_t>& cu_q = given.at("cu_seqlens_q")->shape;
    sequences_ = cu_q.empty() ? 0 : std::max<std::int64_t>(cu_q[0] - 1, 0);  // read before its rule checks it
    paged_ = o.block_table != nullptr;
    if (paged_) {
      check_pages(*given.at("k"), *given.at("v"));
      given["k"] = &rows_[0], given["v"] = &rows_[1];
    } else if (!given.at("cu_seqlens_k")) {
      throw ArgumentError("cu_seqlens_k is required without block_table: it says where each sequence's keys lie "
                          "in k");
    }
    given["block_table"] = o.block_table, given["seqused_k"] = o.seqused_k;
    attention_.scale = o.scale, attention_.causal = o.causal, attention_.window = o.window;
    attention_.sinks = o.sinks, attention_.layout = Layout::bshd, attention_.softcap = o.softcap;
    attention_.alibi_slopes = o.alibi_slopes;
    attention_.score_mod = o.score_mod, attention_.score_mod_tensors = o.score_mod_tensors;
    attention_.deterministic = o.deterministic;
    SizeEnv sizes = {{"sequences", sequences_}, {"paged", paged_}, {"page_size", page_}, {"blocks", blocks_}};
    sizes.insert(hints.begin(), hints.end());
    binder_.emplace(bundle.contents().declaration(declaration), "bshd",
                    attention_problem::with_option_arrays(std::move(given), attention_), std::move(sizes));
    problem_ = attention_problem::checked_problem(*binder_, attention_, [&](const Problem&) { keys_used(); });
  }

  // The forward's pass (or Python's empty outputs).
  void run(CommandBatch* batch, const Bundle& bundle) {
    if (problem_.empty()) return write_empty_forward(*binder_, problem_, attention_);
    const BundleEntry& entry = entry_for(bundle, wanted(false));
    PassViews views(device_, *binder_, attention_);
    if (paged_) views.add("seqused_k", lengths_table());  // the keys each sequence uses, as the host computed them
    SizeEnv sizes = pass_sizes(entry, views);
    if (paged_) sizes["Wt"] = width_;
    sizes[kBound] = std::max<std::int64_t>(options_.max_seqlen_q.value_or(problem_.R), 1);
    const PassTemplate& pass = template_for(entry.forward, sizes, entry.line);
    const SizeEnv env = template_env(pass, sizes);
    views.add("q_units", unit_table("cu_seqlens_q", env.at("NQU"), env.at(kUnit), "q_units", tables_[0]));
    attention_runner::run(device_, batch, pass, sizes, views);
  }

  // The backward's pass (or Python's zeros for an empty problem).
  void run_backward(CommandBatch* batch, const Bundle& bundle) {
    if (problem_.empty()) return write_empty_backward(*binder_);
    const BundleEntry& entry = entry_for(bundle, wanted(true));
    PassViews views(device_, *binder_, attention_);
    const SizeEnv sizes = pass_sizes(entry, views);
    const PassTemplate& pass = template_for(entry.backward, sizes, entry.line);
    const SizeEnv env = template_env(pass, sizes);
    views.add("q_units", unit_table("cu_seqlens_q", env.at("NQU"), 8, "q_units", tables_[0]));
    views.add("k_units", unit_table("cu_seqlens_k", env.at("NKU"), 8, "k_units", tables_[1]));
    attention_runner::run(device_, batch, pass, sizes, views);
  }

 private:
  // The keys each paged sequence uses, once the declaration has checked the arrays: its "keys"
  // Lengths (seqused_k's, else cu_seqlens_k's steps, else every listed page), as Python binds
  // them; then C++'s own check.
  void keys_used() {
    if (!paged_) return;
    width_ = binder_->size("Wt");
    std::string source;
    lengths_ = *binder_->lengths("keys", source);  // the declaration's (varlen_rules' "keys"): with a fill
    if (page_rows_ != page_)   // C++'s own, after every check of Python's
      throw ArgumentError("k's pages are " + std::to_string(page_rows_) + " rows apart; a bundle entry reads pages "
                          "that follow each other (page_size " + std::to_string(page_) + " rows apart)");
  }

  // The pass's runtime sizes: attention's, the packed arrays' batch strides (0: one batch),
  // the sequences' count.
  SizeEnv pass_sizes(const BundleEntry& entry, const PassViews& views) const {
    SizeEnv sizes = sizes_of(problem_, device_, entry, views);
    for (const auto& [buffer, strides] : views.strided) sizes[buffer + "_batch_stride"] = 0;
    sizes["Ncu"] = sequences_ + 1;
    return sizes;
  }

  // SequenceKeys' paged side: k and v pages alike, whole rows apart; the pages as the kernels read them (pages.py's as_rows: every page's rows, one run).
  void check_pages(const TensorView& k, const TensorView& v) {
    for (const auto& [x, name] : {std::pair(&k, "k"), std::pair(&v, "v")})
      if (x->shape.size() != 4)
        throw ArgumentError(std::string(name) + " must have 4 dimensions (num_blocks, page_size, Hkv, D) with "
                            "block_table, got shape " + shape_text(x->shape));
    if (!std::equal(k.shape.begin(), k.shape.begin() + 3, v.shape.begin()))
      throw ArgumentError("v must have k's pages, page size and heads: k " + shape_text(k.shape) + ", v " +
                          shape_text(v.shape));
    blocks_ = k.shape[0], page_ = k.shape[1];
    if (page_ == 0)
      throw ArgumentError("k's page_size (axis 1 of (num_blocks, page_size, Hkv, D)) must be at least 1, got shape " +
                          shape_text(k.shape));
    page_rows_ = page_rows(k, "k");
    const std::int64_t v_rows = page_rows(v, "v");
    if (v_rows != page_rows_)
      throw ArgumentError("v's pages must be as many rows apart as k's (" + std::to_string(page_rows_) + "), got " +
                          std::to_string(v_rows));
    const std::int64_t rows = blocks_ ? (blocks_ - 1) * page_rows_ + page_ : 0;
    for (int i = 0; i < 2; ++i) {
      const TensorView& pages = i ? v : k;
      const Checked given = checked(pages, i ? "v" : "k");
      rows_[i] = TensorView{pages.data, pages.dtype, {rows, pages.shape[2], pages.shape[3]},
                            {page_ == 1 ? given.strides[0] : given.strides[1], given.strides[2], given.strides[3]}};
    }
  }

  // pages.py's page_rows: how many rows one page's start is from the next's.
  static std::int64_t page_rows(const TensorView& view, const std::string& name) {
    const std::int64_t blocks = view.shape[0], page = view.shape[1];
    if (blocks <= 1 || page == 1) return page;
    const Checked pages = checked(view, name);
    const std::int64_t between = pages.strides[0], row = pages.strides[1];
    if (row <= 0 || between % row || between / row < page) {
      std::vector<std::int64_t> bytes;
      for (std::int64_t stride : pages.strides) bytes.push_back(stride * std::int64_t(dtype_size(view.dtype)));
      throw ArgumentError(name + "'s pages must be whole rows apart, without overlapping (stride of axis 0 a "
                          "multiple, at least page_size, of axis 1's), got strides " + shape_text(bytes));
    }
    return between / row;
  }

  // The keys each sequence uses as the paged kernels read them: int32 (Ns,) in a pool buffer.
  Checked lengths_table() {
    Checked table = pool_table(lengths_view_, "seqused_k", {sequences_});
    auto* values = static_cast<std::int32_t*>(table.packed.data());
    for (std::int64_t s = 0; s < sequences_; ++s) values[s] = std::int32_t(lengths_[s]);
    return table;
  }

  BundleFacts wanted(bool backward) const {
    BundleFacts want = facts_of(problem_, device_.tuning().family, backward);
    want.op = "attention_varlen";
    want.seqused_k = options_.seqused_k != nullptr && !paged_;   // paged kernels read the host's lengths
    want.page_size = paged_ ? page_ : 0;
    return want;
  }

  // A contiguous int32 table of `shape` the host fills, in a pool buffer (which a CommandBatch
  // holds until it completes); `holder` is its view.
  Checked pool_table(TensorView& holder, const std::string& name, const std::vector<std::int64_t>& shape) const {
    holder = TensorView{nullptr, DType::int32, shape, {}};
    std::vector<std::int64_t> strides = contiguous(shape);
    std::int64_t elements = 1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      elements *= shape[i];
      if (shape[i] == 1) strides[i] = 0;  // checked()'s form: 0 on axes of extent 1
    }
    return Checked{&holder, name, shape, strides, elements,
                   device_.new_buffer(std::size_t(std::max<std::int64_t>(elements, 1)) * sizeof(std::int32_t))};
  }

  // sequences.unit_table of cu_seqlens `cu_name`: (entries, 2) int32 in a pool buffer, (sequence,
  // first row) for each `unit`-row unit of each sequence in order, then (-1, 0).
  Checked unit_table(const std::string& cu_name, std::int64_t entries, std::int64_t unit, const std::string& name,
                     TensorView& holder) const {
    const Checked& cu = binder_->view(cu_name);
    Checked table = pool_table(holder, name, {entries, 2});
    auto* rows = static_cast<std::int32_t*>(table.packed.data());
    std::int64_t at = 0;
    for (std::int64_t s = 0; s < sequences_; ++s) {
      const std::int64_t first = int32_at(cu, {s}), length = int32_at(cu, {s + 1}) - first;
      for (std::int64_t start = 0; start < length && at < entries; start += unit, ++at)
        rows[2 * at] = std::int32_t(s), rows[2 * at + 1] = std::int32_t(first + start);
    }
    for (; at < entries; ++at) rows[2 * at] = -1, rows[2 * at + 1] = 0;
    return table;
  }

  const Device& device_;
  const VarlenOptions& options_;
  AttentionOptions attention_;
  std::int64_t sequences_ = 0;
  TensorView tables_[2], rows_[2], lengths_view_;  // unit tables; paged k and v as rows; the used keys
  bool paged_ = false;
  std::int64_t blocks_ = 0, page_ = 0, page_rows_ = 0, width_ = 0;
  std::vector<std::int64_t> lengths_;  // the keys each sequence uses
  std::optional<Binder> binder_;
  Problem problem_;
};

void forward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
             const TensorView& k, const TensorView& v, const TensorView& cu_seqlens_q,
             const TensorView* cu_seqlens_k, const TensorView& out, const VarlenOptions& options,
             const TensorView* lse) {
  VarlenCall call(device, bundle, "attention_varlen", options,
                  {{"q", &q}, {"k", &k}, {"v", &v}, {"cu_seqlens_q", &cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k},
                   {"out", &out}, {"lse", lse}});
  call.run(batch, bundle);
}

void backward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
              const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
              const TensorView& dout, const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
              const TensorView& dq, const TensorView& dk, const TensorView& dv, const VarlenOptions& options,
              const TensorView* dsinks) {
  // _forward_only's refusal, in its words.
  for (const auto& [given, name, what] : {std::tuple(options.block_table, "block_table", "paged K/V"),
                                          std::tuple(options.seqused_k, "seqused_k", "keys limited by seqused_k")})
    if (given)
      throw NotImplementedError(std::string("attention_varlen_backward: ") + name + " given, but " + what +
                          " is forward-only (as flash-attn's paged varlen): no gradient of such a call is computed");
  VarlenCall call(device, bundle, "attention_varlen_backward", options,
                  {{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}, {"lse", &lse}, {"do", &dout},
                   {"cu_seqlens_q", &cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k}, {"dq", &dq}, {"dk", &dk},
                   {"dv", &dv}, {"dsinks", dsinks}});
  call.run_backward(batch, bundle);
}

}  // namespace

void attention_varlen(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
                      const TensorView& out, const VarlenOptions& options, const TensorView* lse) {
  forward(device, nullptr, bundle, q, k, v, cu_seqlens_q, cu_seqlens_k, out, options, lse);
}

void attention_varlen(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
                      const TensorView& out, const VarlenOptions& options, const TensorView* lse) {
  forward(batch.device(), &batch, bundle, q, k, v, cu_seqlens_q, cu_seqlens_k, out, options, lse);
}

void attention_varlen_backward(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& o, const TensorView& lse, const TensorView& dout,
                               const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const VarlenOptions& options,
                               const TensorView* dsinks) {
  backward(device, nullptr, bundle, q, k, v, o, lse, dout, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, options, dsinks);
}

void attention_varlen_backward(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& o, const TensorView& lse, const TensorView& dout,
                               const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const VarlenOptions& options,
                               const TensorView* dsinks) {
  backward(batch.device(), &batch, bundle, q, k, v, o, lse, dout, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, options,
           dsinks);
}

}  // namespace mfa
