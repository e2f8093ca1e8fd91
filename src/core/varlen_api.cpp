// mfa::attention_varlen and its backward: python/mfa_native/ops/varlen.py (and
// varlen_keys.py, pages.py) in C++, with its messages, in its order: q's rank, cu_seqlens_q's
// form, the keys' shapes (packed rows, or pages and the block table's form) and cu_seqlens_k's
// and seqused_k's forms, then attention's checks (q, k and v bound as one bshd batch of
// total_q queries and total_k keys; pages as their rows), then the contents of cu_seqlens,
// seqused_k and the block table and the max_seqlen hints (every call, before anything is
// written). The pass reads q, k, v, o and lse
// without their batch axis, and the unit tables (codegen/attention/sequences.py's
// unit_table), built here every call into pool buffers (a CommandBatch keeps them alive).
// The per-sequence query bound (max_seqlen_q, else total_q) is the runtime size "Qb": the
// entry's templates are guarded by it (bundle/writer.py's VARLEN_BOUND), and the chosen
// template's "Qu" is the queries of a forward unit, the table's unit.
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>

#include "attention_runner.hpp"
#include "mfa/varlen.hpp"
#include "pass_template.hpp"
#include "view_packing.hpp"

namespace mfa {

namespace {

using attention_problem::Problem;
using namespace attention_runner;

constexpr std::int64_t kMaxSequences = std::int64_t(1) << 24;  // varlen_keys.py's MAX_SEQUENCES
constexpr const char* kBound = "Qb";                           // writer.py's VARLEN_BOUND
constexpr const char* kUnit = "Qu";                            // the chosen template's forward unit

std::int64_t element(const Checked& view, std::int64_t i) {
  return static_cast<const std::int32_t*>(view.view->data)[i * view.strides[0]];
}

// varlen_keys.cu_form: int32, one axis of at least one entry, at most 2**24 + 1 entries.
void check_cu_form(const TensorView& cu, const std::string& name) {
  if (cu.dtype != DType::int32)
    throw ArgumentError(name + " must be int32, got dtype " + to_string(cu.dtype));
  if (cu.shape.size() != 1 || cu.shape[0] < 1)
    throw ArgumentError(name + " must have shape (B + 1,), one axis of at least one entry, got " +
                        shape_text(cu.shape));
  if (cu.shape[0] > kMaxSequences + 1)
    throw ArgumentError(name + " has " + std::to_string(cu.shape[0]) +
                        " entries: at most 2**24 sequences (2**24 + 1 entries) per call");
}

// varlen_keys.check_cu: from 0, ending at `total`, non-decreasing; the lengths.
std::vector<std::int64_t> check_cu(const TensorView& given, const std::string& name, std::optional<std::int64_t> total) {
  const Checked cu = checked(given, name);
  const std::int64_t n = cu.shape[0];
  if (element(cu, 0) != 0) throw ArgumentError(name + " must start at 0, got " + std::to_string(element(cu, 0)));
  if (total && element(cu, n - 1) != *total)
    throw ArgumentError(name + " must end at the total row count " + std::to_string(*total) + " (" +
                        (name.back() == 'q' ? "q" : "k") + "'s first axis), got " +
                        std::to_string(element(cu, n - 1)));
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(n - 1));
  for (std::int64_t s = 0; s + 1 < n; ++s) lengths[s] = element(cu, s + 1) - element(cu, s);
  if (!lengths.empty()) {
    const auto at = std::min_element(lengths.begin(), lengths.end()) - lengths.begin();  // numpy's argmin: the first
    if (lengths[at] < 0)
      throw ArgumentError(name + " must be non-decreasing, but " + name + "[" + std::to_string(at + 1) + "] = " +
                          std::to_string(element(cu, at + 1)) + " < " + name + "[" + std::to_string(at) +
                          "] = " + std::to_string(element(cu, at)));
  }
  return lengths;
}

// varlen_keys.check_hint: a hint at least the longest sequence's count.
void check_hint(const std::optional<std::int64_t>& hint, const std::string& name,
                const std::vector<std::int64_t>& lengths, const std::string& what) {
  if (!hint) return;
  const auto longest = std::max_element(lengths.begin(), lengths.end());  // numpy's argmax: the first
  const std::int64_t most = longest == lengths.end() ? 0 : *longest;
  if (*hint < most)
    throw ArgumentError(name + " is " + std::to_string(*hint) + ", but sequence " +
                        std::to_string(longest - lengths.begin()) + " has " + std::to_string(most) + " " + what);
}

// A (rows, heads, dim) view with a leading batch axis of one: how attention's checks take it
// (an empty one's strides, which address nothing, as contiguous ones).
TensorView batched(const TensorView& view) {
  TensorView out = view;
  const bool empty = std::find(view.shape.begin(), view.shape.end(), 0) != view.shape.end();
  if (out.strides.empty() || empty) out.strides = contiguous(view.shape);
  out.shape.insert(out.shape.begin(), 1);
  out.strides.insert(out.strides.begin(), 0);
  return out;
}

// The call: Python's checks, the unit tables, the entry's pass.
class VarlenCall {
 public:
  // validate_varlen's checks (the forward's `out` and `lse` too, when given).
  VarlenCall(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
             const TensorView& v, const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
             const VarlenOptions& o, const TensorView* out, const TensorView* lse)
      : device_(device), options_(o) {
    if (q.shape.size() != 3)
      throw ArgumentError("q must have 3 dimensions (total_q, heads, head dim), got shape " + shape_text(q.shape));
    check_cu_form(cu_seqlens_q, "cu_seqlens_q");
    sequences_ = cu_seqlens_q.shape[0] - 1;
    paged_ = o.block_table != nullptr;
    if (paged_) check_pages(k, v);
    else check_packed(k, v, cu_seqlens_k);
    if (cu_seqlens_k) {
      check_cu_form(*cu_seqlens_k, "cu_seqlens_k");
      if (cu_seqlens_k->shape[0] != sequences_ + 1)
        throw ArgumentError("cu_seqlens_q and cu_seqlens_k must have one entry per sequence and one more, alike; "
                            "got (" + std::to_string(sequences_ + 1) + ",) and " + shape_text(cu_seqlens_k->shape));
    }
    if (o.seqused_k &&
        (o.seqused_k->dtype != DType::int32 || o.seqused_k->shape != std::vector<std::int64_t>{sequences_}))
      throw ArgumentError("seqused_k must be int32 (B,) = (" + std::to_string(sequences_) + ",), got " +
                          to_string(o.seqused_k->dtype) + " " + shape_text(o.seqused_k->shape));
    if (out) check_output(*out, "out", "(total_q, Hq, Dv)", {q.shape[0], q.shape[1], v.shape.back()}, q.dtype);
    if (lse) check_output(*lse, "lse", "(Hq, total_q)", {q.shape[1], q.shape[0]}, DType::float32);
    attention_.scale = o.scale, attention_.causal = o.causal, attention_.window = o.window;
    attention_.sinks = o.sinks, attention_.layout = Layout::bshd, attention_.softcap = o.softcap;
    attention_.alibi_slopes = o.alibi_slopes;
    attention_.score_mod = o.score_mod, attention_.score_mod_tensors = o.score_mod_tensors;
    attention_.deterministic = o.deterministic;
    binder_.emplace(bundle.contents().declaration("attention"), "bshd",
                    given({{"q", &q}, {"k", paged_ ? &rows_[0] : &k}, {"v", paged_ ? &rows_[1] : &v}, {"out", out},
                           {"lse", lse}}),
                    SizeEnv{{"slope_rows", sequences_}});  // a per-batch ALiBi table's rows: the sequences
    problem_ = attention_problem::checked_problem(*binder_, attention_);
    // check_sequences: the contents (every call), the hints.
    cu_q_ = checked(cu_seqlens_q, "cu_seqlens_q");
    check_hint(o.max_seqlen_q, "max_seqlen_q", check_cu(cu_seqlens_q, "cu_seqlens_q", problem_.R), "rows");
    std::vector<std::int64_t> rows;
    if (cu_seqlens_k) {
      cu_k_ = checked(*cu_seqlens_k, "cu_seqlens_k");
      rows = check_cu(*cu_seqlens_k, "cu_seqlens_k", paged_ ? std::nullopt : std::optional(problem_.C));
    }
    lengths_ = used_keys(cu_seqlens_k ? &rows : nullptr);
    check_hint(o.max_seqlen_k, "max_seqlen_k", lengths_, "keys");
    if (paged_) check_pages_read();
    if (paged_ && page_rows_ != page_)   // C++'s own, after every check of Python's
      throw ArgumentError("k's pages are " + std::to_string(page_rows_) + " rows apart; a bundle entry reads pages "
                          "that follow each other (page_size " + std::to_string(page_) + " rows apart)");
  }

  // The forward's pass (or Python's empty outputs).
  void run(CommandBatch* batch, const Bundle& bundle) {
    if (problem_.empty()) return write_empty_forward(*binder_, problem_, attention_);
    const BundleEntry& entry = entry_for(bundle, wanted(false));
    PassViews views(device_, *binder_, attention_);
    for (const char* name : {"q", "k", "v", "o", "lse"}) views.drop_leading_axis(name);
    bind_contiguous(views, "cu_seqlens_q", cu_q_);
    if (paged_) {   // the keys each sequence uses, as the host computed them; its pages
      bind_contiguous(views, "block_table", checked(*options_.block_table, "block_table"));
      views.add("seqused_k", lengths_table());
    } else {
      bind_contiguous(views, "cu_seqlens_k", cu_k_);
      if (options_.seqused_k) bind_contiguous(views, "seqused_k", checked(*options_.seqused_k, "seqused_k"));
    }
    SizeEnv sizes = sizes_of(problem_, device_, entry, views);
    sizes["Ncu"] = sequences_ + 1;
    if (paged_) sizes["Wt"] = width_;
    sizes[kBound] = std::max<std::int64_t>(options_.max_seqlen_q.value_or(problem_.R), 1);
    const PassTemplate& pass = template_for(entry.forward, sizes, entry.line);
    const SizeEnv env = template_env(pass, sizes);
    views.add("q_units", unit_table(cu_q_, env.at("NQU"), env.at(kUnit), "q_units", tables_[0]));
    attention_runner::run(device_, batch, pass, sizes, views);
  }

  // _prepare_backward's checks after validate_varlen's: o and do like the output, lse as the
  // forward returns it; then the gradients' shapes (C++'s own: Python returns them).
  void check_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                      const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                      const TensorView& dv, const TensorView* dsinks) const {
    const Problem& p = problem_;
    const std::vector<std::int64_t> shape = {p.R, p.Hq, p.Dv};
    for (const auto& [x, name] : {std::pair(&o, "o"), std::pair(&dout, "do")}) {
      if (x->dtype != q.dtype)
        throw TypeError(std::string(name) + " has dtype " + to_string(x->dtype) + " but q has " + to_string(q.dtype) +
                        "; " + name + " must have q's dtype, like the output");
      if (x->shape != shape)
        throw ArgumentError(std::string(name) + " must have the output's shape (total_q, Hq, Dv) = " +
                            shape_text(shape) + ", got " + shape_text(x->shape));
    }
    if (lse.dtype != DType::float32)
      throw TypeError(std::string("lse must be float32, as attention_varlen(..., return_lse=True) returns it, got ") +
                      to_string(lse.dtype));
    if (lse.shape != std::vector<std::int64_t>{p.Hq, p.R})
      throw ArgumentError("lse must have shape (Hq, total_q) = " + shape_text({p.Hq, p.R}) + ", got " +
                          shape_text(lse.shape));
    check_output(dq, "dq", "(total_q, Hq, D)", q.shape, q.dtype);
    check_output(dk, "dk", "(total_k, Hkv, D)", k.shape, q.dtype);
    check_output(dv, "dv", "(total_k, Hkv, Dv)", v.shape, q.dtype);
    if (dsinks && !options_.sinks) throw ArgumentError("dsinks is given without sinks");
    if (dsinks) check_output(*dsinks, "dsinks", "(Hq,)", {p.Hq}, DType::float32);
  }

  // The backward's pass (or Python's zeros for an empty problem).
  void run_backward(CommandBatch* batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                    const TensorView& v, const TensorView& o, const TensorView& lse, const TensorView& dout,
                    const TensorView& dq, const TensorView& dk, const TensorView& dv, const TensorView* dsinks) {
    Binder binder(bundle.contents().declaration("attention_backward"), "bshd",
                  given({{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}, {"lse", &lse}, {"do", &dout}, {"dq", &dq},
                         {"dk", &dk}, {"dv", &dv}, {"dsinks", nullptr}}),
                  SizeEnv{{"slope_rows", sequences_}});
    attention_problem::checked_problem(binder, attention_);  // passes (validated above); sizes the binder's views
    if (problem_.empty()) {
      for (const char* name : {"dq", "dk", "dv"}) zero(binder.view(name));
      if (dsinks) std::fill_n(static_cast<float*>(dsinks->data), problem_.Hq, 0.0f);
      return;
    }
    const BundleEntry& entry = entry_for(bundle, wanted(true));
    PassViews views(device_, binder, attention_);
    for (const char* name : {"q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv"}) views.drop_leading_axis(name);
    if (dsinks) views.add("dsinks", checked(*dsinks, "dsinks"));
    bind_contiguous(views, "cu_seqlens_q", cu_q_);
    bind_contiguous(views, "cu_seqlens_k", cu_k_);
    SizeEnv sizes = sizes_of(problem_, device_, entry, views);
    sizes["Ncu"] = sequences_ + 1;
    const PassTemplate& pass = template_for(entry.backward, sizes, entry.line);
    const SizeEnv env = template_env(pass, sizes);
    views.add("q_units", unit_table(cu_q_, env.at("NQU"), 8, "q_units", tables_[0]));
    views.add("k_units", unit_table(cu_k_, env.at("NKU"), 8, "k_units", tables_[1]));
    attention_runner::run(device_, batch, pass, sizes, views);
  }

 private:
  // SequenceKeys.check: the keys each sequence uses: seqused_k's (not negative; packed, within
  // each sequence's `rows`), else `rows`, else (paged, no cu_seqlens_k) every listed page's.
  std::vector<std::int64_t> used_keys(const std::vector<std::int64_t>* rows) const {
    if (!options_.seqused_k) return rows ? *rows : std::vector<std::int64_t>(std::size_t(sequences_), width_ * page_);
    const Checked used = checked(*options_.seqused_k, "seqused_k");
    std::vector<std::int64_t> lengths(static_cast<std::size_t>(sequences_));
    for (std::int64_t s = 0; s < sequences_; ++s) lengths[s] = element(used, s);
    if (!lengths.empty()) {
      const auto lowest = std::min_element(lengths.begin(), lengths.end());
      if (*lowest < 0)
        throw ArgumentError("seqused_k must not be negative, got seqused_k[" +
                            std::to_string(lowest - lengths.begin()) + "] = " + std::to_string(*lowest));
    }
    for (std::int64_t s = 0; !paged_ && s < sequences_; ++s)
      if (lengths[s] > (*rows)[s])
        throw ArgumentError("seqused_k[" + std::to_string(s) + "] = " + std::to_string(lengths[s]) +
                            " is beyond sequence " + std::to_string(s) + "'s keys, cu_seqlens_k[" +
                            std::to_string(s + 1) + "] - cu_seqlens_k[" + std::to_string(s) + "] = " +
                            std::to_string((*rows)[s]));
    return lengths;
  }

  // varlen_keys.check_packed's side of SequenceKeys: k and v (total_k, Hkv, D), cu_seqlens_k given.
  static void check_packed(const TensorView& k, const TensorView& v, const TensorView* cu_seqlens_k) {
    for (const auto& [x, name] : {std::pair(&k, "k"), std::pair(&v, "v")})
      if (x->shape.size() != 3)
        throw ArgumentError(std::string(name) + " must have 3 dimensions (total_k, heads, head dim), got shape " +
                            shape_text(x->shape));
    if (!std::equal(k.shape.begin(), k.shape.begin() + 2, v.shape.begin()))
      throw ArgumentError("v must have k's rows and heads: k " + shape_text(k.shape) + ", v " + shape_text(v.shape));
    if (!cu_seqlens_k)
      throw ArgumentError("cu_seqlens_k is required without block_table: it says where each sequence's keys lie "
                          "in k");
  }

  // SequenceKeys' paged side: k and v pages alike, whole rows apart, the block table's form; the
  // pages as the kernels read them (pages.py's as_rows: every page's rows, one run).
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
    const TensorView& table = *options_.block_table;
    if (table.dtype != DType::int32 || table.shape.size() != 2 || table.shape[0] != sequences_)
      throw ArgumentError("block_table must be int32 (B, max_blocks) with B = " + std::to_string(sequences_) +
                          ", got " + to_string(table.dtype) + " " + shape_text(table.shape));
    width_ = table.shape[1];
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

  // The capacity of each sequence's pages, and pages.py's check_pages_read: every page holding a
  // used key is one of k's.
  void check_pages_read() const {
    const std::int64_t capacity = width_ * page_;
    if (!lengths_.empty()) {
      const auto most = std::max_element(lengths_.begin(), lengths_.end());
      if (*most > capacity)
        throw ArgumentError(std::string(options_.seqused_k ? "seqused_k" : "cu_seqlens_k") + " gives sequence " +
                            std::to_string(most - lengths_.begin()) + " " + std::to_string(*most) +
                            " keys, beyond what its pages hold: max_blocks * page_size = " + std::to_string(width_) +
                            " * " + std::to_string(page_) + " = " + std::to_string(capacity));
    }
    const Checked table = checked(*options_.block_table, "block_table");
    for (std::int64_t s = 0; s < sequences_; ++s)
      for (std::int64_t i = 0; i < width_ && i < (lengths_[s] + page_ - 1) / page_; ++i) {
        const std::int64_t at = s * table.strides[0] + i * table.strides[1];
        if (const std::int64_t page = static_cast<const std::int32_t*>(table.view->data)[at]; page < 0 || page >= blocks_)
          throw ArgumentError("block_table[" + std::to_string(s) + ", " + std::to_string(i) + "] = " +
                              std::to_string(page) + " is not a page of k (0.." + std::to_string(blocks_ - 1) +
                              "), and sequence " + std::to_string(s) + " reads that page");
      }
  }

  // The keys each sequence uses as the paged kernels read them: int32 (Ns,) in a pool buffer.
  Checked lengths_table() {
    Checked table = pool_table(lengths_view_, "seqused_k", {sequences_});
    auto* values = static_cast<std::int32_t*>(table.packed.data());
    for (std::int64_t s = 0; s < sequences_; ++s) values[s] = std::int32_t(lengths_[s]);
    return table;
  }

  // An output (or an argument shaped like one) the caller gives: its shape and dtype.
  static void check_output(const TensorView& x, const std::string& name, const std::string& axes,
                           const std::vector<std::int64_t>& shape, DType dtype) {
    if (x.shape != shape || x.dtype != dtype)
      throw ArgumentError(name + " must be " + axes + " = " + shape_text(shape) + " " + to_string(dtype) + ", got " +
                          shape_text(x.shape) + " " + to_string(x.dtype));
  }

  // The call's arrays by attention's names, each with a leading batch axis of one, and the
  // options' (null when not given).
  std::map<std::string, const TensorView*> given(const std::map<std::string, const TensorView*>& arrays) {
    std::map<std::string, const TensorView*> named = {
        {"mask", nullptr}, {"sinks", options_.sinks ? &*options_.sinks : nullptr},
        {"alibi_slopes", options_.alibi_slopes ? &*options_.alibi_slopes : nullptr}};
    for (const auto& [name, view] : arrays)
      named[name] = view ? &(batched_[name] = batched(*view)) : nullptr;
    return named;
  }

  BundleFacts wanted(bool backward) const {
    BundleFacts want = facts_of(problem_, device_.tuning().family, backward);
    want.op = "attention_varlen";
    want.seqused_k = options_.seqused_k != nullptr && !paged_;   // paged kernels read the host's lengths
    want.page_size = paged_ ? page_ : 0;
    return want;
  }

  void bind_contiguous(PassViews& views, const std::string& buffer, Checked view) const {
    view_packing::make_addressable(device_, view, view_packing::Reads::contiguous);
    views.add(buffer, std::move(view));
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

  // sequences.unit_table: (entries, 2) int32 in a pool buffer, (sequence, first row) for each
  // `unit`-row unit of each sequence in order, then (-1, 0).
  Checked unit_table(const Checked& cu, std::int64_t entries, std::int64_t unit, const std::string& name,
                     TensorView& holder) const {
    Checked table = pool_table(holder, name, {entries, 2});
    auto* rows = static_cast<std::int32_t*>(table.packed.data());
    std::int64_t at = 0;
    for (std::int64_t s = 0; s < sequences_; ++s) {
      const std::int64_t first = element(cu, s), length = element(cu, s + 1) - first;
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
  std::map<std::string, TensorView> batched_;  // the arrays as attention's checks take them
  TensorView tables_[2], rows_[2], lengths_view_;  // unit tables; paged k and v as rows; the used keys
  bool paged_ = false;
  std::int64_t blocks_ = 0, page_ = 0, page_rows_ = 0, width_ = 0;
  std::vector<std::int64_t> lengths_;  // the keys each sequence uses
  std::optional<Binder> binder_;
  Problem problem_;
  Checked cu_q_, cu_k_;
};

void forward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
             const TensorView& k, const TensorView& v, const TensorView& cu_seqlens_q,
             const TensorView* cu_seqlens_k, const TensorView& out, const VarlenOptions& options,
             const TensorView* lse) {
  VarlenCall call(device, bundle, q, k, v, cu_seqlens_q, cu_seqlens_k, options, &out, lse);
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
  VarlenCall call(device, bundle, q, k, v, cu_seqlens_q, cu_seqlens_k, options, nullptr, nullptr);
  call.check_backward(q, k, v, o, lse, dout, dq, dk, dv, dsinks);
  call.run_backward(batch, bundle, q, k, v, o, lse, dout, dq, dk, dv, dsinks);
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
