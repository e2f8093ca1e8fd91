// mfa::attention_with_kvcache: python/mfa_native/ops/kvcache.py in C++, with its
// messages, in its order. The bundle's "attention_with_kvcache" declaration
// (ops/kvcache_rules.py) binds q and the caches and checks every other array's form;
// the caches are then bound as the rows the kernels read (pages.py's as_rows: every
// page's rows, shared by every batch with stride 0; their layout is code, as in
// Python), and q, the rows and the options are checked by attention's declaration and
// options as Python's validate does; then the declaration's contents (the lengths,
// the room to append, the pages read, the rotary positions); then the entry's pass
// runs (attention_runner.hpp): the append kernels, then attention.
#include <algorithm>
#include <cstring>
#include <map>

#include "attention_runner.hpp"
#include "mfa/kvcache.hpp"
#include "quant_format.hpp"
#include "view_packing.hpp"

namespace mfa {

namespace {

using attention_problem::Problem;
using namespace attention_runner;

bool is_float8(DType dtype) { return dtype == DType::float8_e4m3fn || dtype == DType::float8_e5m2; }
bool is_float(DType dtype) { return dtype == DType::float32 || dtype == DType::float16 || dtype == DType::bfloat16; }

// One cache argument: what Python reads off it (its logical shape, how it is stored, the
// arrays it binds).
struct Cache {
  std::string name;                 // k_cache or v_cache
  const KVCache* given = nullptr;
  std::vector<std::int64_t> shape;  // logical: (B, Cmax, Hkv, D) or (num_blocks, page_size, Hkv, D)
  std::optional<quant_format::Format> format;  // a QuantizedTensor's
  const TensorView& stored() const { return given->plain ? *given->plain : given->quantized->data; }
  std::string field() const { return given->plain ? name : name + ".data"; }
  bool float8() const { return given->plain && is_float8(given->plain->dtype); }
  // Its storage as a bundle spec names it: plain, a float8 dtype or a QuantizedTensor's format.
  std::string storage() const {
    if (format) return format->name;
    return float8() ? to_string(given->plain->dtype) : "plain";
  }
  // The arrays it is stored in, by pass buffer suffix ("": the data or elements; "_scales", "_biases").
  std::vector<std::pair<std::string, const TensorView*>> fields() const {
    std::vector<std::pair<std::string, const TensorView*>> out = {{"", &stored()}};
    if (format && format->affine()) out.insert(out.end(), {{"_scales", &*given->quantized->scales},
                                                           {"_biases", &*given->quantized->biases}});
    return out;
  }
};

std::string bytes_text(const TensorView& view) {
  std::vector<std::int64_t> bytes;
  for (std::int64_t s : checked(view, "").strides) bytes.push_back(s * std::int64_t(dtype_size(view.dtype)));
  return shape_text(bytes);
}

// Python's QuantizedTensor constructor's checks (its messages, its order): the format, data's
// dtype and axes, the groups its last axis holds, an affine tensor's scales and biases. The
// logical shape.
std::vector<std::int64_t> quantized_shape(const QuantizedTensor& q, quant_format::Format& f) {
  f = quant_format::format_of(q.format, q.bits, q.group_size);
  if (q.data.dtype != f.data_dtype())
    throw TypeError("data of format '" + f.name + "' must be " + to_string(f.data_dtype()) + ", got " +
                    to_string(q.data.dtype));
  if (q.data.shape.empty()) throw ArgumentError("data must have at least one axis (the quantized one)");
  const std::int64_t width = q.data.shape.back(), features = f.features(width);
  if (features < f.group_size || features % f.group_size || f.data_width(features) != width)
    throw ArgumentError("data's last axis (" + std::to_string(width) + ") holds no whole number of groups of format " +
                        f.describe());
  std::vector<std::int64_t> shape = q.data.shape;
  shape.back() = features;
  if (!f.affine()) {
    if (q.scales || q.biases)
      throw ArgumentError("format '" + f.name + "' keeps its scales inside the blocks: scales and biases must be None");
    return shape;
  }
  if (!q.scales || !q.biases) throw ArgumentError("the affine format needs scales and biases");
  std::vector<std::int64_t> groups = q.data.shape;
  groups.back() = features / f.group_size;
  for (const auto& [name, x] : {std::pair("scales", &*q.scales), std::pair("biases", &*q.biases)}) {
    if (x->shape != groups)
      throw ArgumentError(std::string(name) + " must have shape " + shape_text(groups) + " (one per group of " +
                          std::to_string(f.group_size) + "), got " + shape_text(x->shape));
    if (!is_float(x->dtype))
      throw TypeError(std::string(name) + " must be float32, float16 or bfloat16, got " + to_string(x->dtype));
  }
  if (q.biases->dtype != q.scales->dtype)
    throw TypeError(std::string("scales (") + to_string(q.scales->dtype) + ") and biases (" +
                    to_string(q.biases->dtype) + ") must share a dtype");
  return shape;
}

Cache cache_of(const KVCache& given, const std::string& name) {
  Cache cache{name, &given, {}, {}};
  if (given.plain) {
    cache.shape = given.plain->shape;
  } else {
    cache.format.emplace();
    cache.shape = quantized_shape(*given.quantized, *cache.format);
  }
  return cache;
}

// The view the declaration checks a cache as: its own, or a QuantizedTensor's logical shape
// with q's dtype (Python checks no dtype of a QuantizedTensor cache).
TensorView declared_view(const Cache& cache, DType q_dtype) {
  if (cache.given->plain) return *cache.given->plain;
  return TensorView{cache.stored().data, q_dtype, cache.shape, {}};
}

// pages.py's page_rows: how many rows one page's start is from the next's.
std::int64_t page_rows(const Cache& cache) {
  const Checked pages = checked(cache.stored(), cache.field());
  const std::int64_t blocks = cache.shape[0], page = cache.shape[1];
  if (blocks <= 1 || page == 1) return page;
  const std::int64_t between = pages.strides[0], row = pages.strides[1];
  if (row <= 0 || between % row || between / row < page)
    throw ArgumentError(cache.field() + "'s pages must be whole rows apart, without overlapping (stride of axis 0 a "
                        "multiple, at least page_size, of axis 1's), got strides " + bytes_text(cache.stored()));
  return between / row;
}

// The call's cache facts and checks (Python's Cache), then its bound views.
class KVCall {
 public:
  KVCall(const Device& device, const Bundle& bundle, const TensorView& q, const KVCache& k_cache,
         const KVCache& v_cache, const TensorView& out, const KVCacheOptions& o, const TensorView* lse)
      : device_(device), options_(o) {
    bind_caches(bundle, q, k_cache, v_cache);
    rows_[0] = rows_view(k_), rows_[1] = rows_view(v_);
    bind_descales();
    attention_.scale = o.scale, attention_.causal = o.causal, attention_.window = o.window;
    attention_.sinks = o.sinks, attention_.layout = Layout::bshd, attention_.softcap = o.softcap;
    attention_.alibi_slopes = o.alibi_slopes;
    attention_.score_mod = o.score_mod, attention_.score_mod_tensors = o.score_mod_tensors;
    attention_.deterministic = o.deterministic;
    binder_.emplace(bundle.contents().declaration("attention"), "bshd",
                    attention_problem::with_option_arrays(
                        {{"q", &q}, {"k", &rows_[0]}, {"v", &rows_[1]}, {"out", &out}, {"lse", lse}}, attention_));
    problem_ = attention_problem::checked_problem(*binder_, attention_, [&](const Problem& p) {
      // The rows the rotation turns (the contents' rotary_ends), then the contents.
      cache_binder_->set_size("per_row", p.causal != Causal::none || p.window.has_value());
      cache_binder_->check_contents(false);
      check_apart();
    });
    if (o.cache_seqlens) {
      lengths_ = cache_binder_->view("cache_seqlens");
    } else {  // the capacity for every batch (flash-attn's rule)
      capacity_lengths_ = TensorView{nullptr, DType::int32, {batch_}, {1}};
      lengths_ = Checked{&capacity_lengths_, "cache_seqlens", {batch_}, {1}, batch_,
                         device_.new_buffer(std::size_t(std::max<std::int64_t>(batch_, 1)) * 4)};
      std::fill_n(static_cast<std::int32_t*>(lengths_.packed.data()), batch_, std::int32_t(capacity_));
    }
  }

  void run(CommandBatch* batch, const Bundle& bundle) {
    if (problem_.empty()) {
      if (rotary_dim_)
        throw ArgumentError("rotary_cos with an empty problem (no queries or heads): the rotation runs on the device, "
                            "in the attention pass, which has nothing to compute");
      append_on_host();
      return write_empty_forward(*binder_, problem_, attention_);
    }
    BundleFacts want = facts_of(problem_, device_.tuning().family, false);
    want.op = "attention_with_kvcache";
    want.page_size = paged_ ? page_ : 0;
    want_storage(want);
    want.append = appended_ > 0;
    if (rotary_dim_) {
      want.rotary_dim = rotary_dim_;
      want.rotary_interleaved = options_.rotary_interleaved;
      want.rotary_starts = options_.rotary_seqlens ? "rotary_seqlens" : "cache_seqlens";
    }
    const BundleEntry& entry = entry_for(bundle, want);
    PassViews views(device_, *binder_, attention_);
    for (const Cache* cache : {&k_, &v_})
      if (cache->storage() != "plain")
        for (const auto& [suffix, field] : cache->fields())
          views.add(cache->name.substr(0, 1) + suffix, field_rows(*cache, suffix, *field));
    for (auto& [buffer, descale] : descales_) views.add(buffer, std::move(descale));
    bind_contiguous(views, "cache_seqlens", lengths_);
    if (paged_) bind_contiguous(views, "block_table", checked(*options_.block_table, "block_table"));
    if (appended_) {
      bind_contiguous(views, rotary_dim_ ? "k_new_unrotated" : "k_new", checked(*options_.k, "k"));
      bind_contiguous(views, "v_new", checked(*options_.v, "v"));
    }
    if (rotary_dim_) bind_rotary(views);
    SizeEnv sizes = sizes_of(problem_, device_, entry, views);
    sizes["Rn"] = appended_;
    if (paged_) sizes["Wt"] = width_;
    if (rotary_dim_) sizes["Lro"] = options_.rotary_cos->shape[0];
    attention_runner::run(device_, batch, entry.forward, entry.line, sizes, views);
  }

 private:
  // The storage facts of the entry the caches need: k's and v's, an affine one's bits and group
  // size. What no entry bakes is refused here (ArgumentError): affine caches of two formats, or
  // scales of another dtype than q's.
  void want_storage(BundleFacts& want) const {
    want.cache = k_.storage(), want.v_cache = v_.storage();
    for (const Cache* cache : {&k_, &v_}) {
      if (!cache->format || !cache->format->affine()) continue;
      if (want.bits && (want.bits != cache->format->bits || want.group_size != cache->format->group_size))
        throw ArgumentError("k_cache and v_cache must share bits and group_size in a bundle call (an entry bakes "
                            "one affine format), got " + k_.format->describe() + " and " + v_.format->describe());
      want.bits = cache->format->bits, want.group_size = cache->format->group_size;
      if (const DType scales = cache->given->quantized->scales->dtype; scales != q_dtype_)
        throw ArgumentError(cache->name + ".scales must have q's dtype " + std::string(to_string(q_dtype_)) +
                            " in a bundle call (an entry bakes it), got " + to_string(scales));
    }
  }

  // Python's Cache: the declaration binds q and the caches (their logical shapes) and checks
  // every other array's form; then the pages' layout (code, as pages.py).
  void bind_caches(const Bundle& bundle, const TensorView& q, const KVCache& k_cache, const KVCache& v_cache) {
    const KVCacheOptions& o = options_;
    paged_ = o.block_table != nullptr;
    q_dtype_ = q.dtype;
    k_ = cache_of(k_cache, "k_cache"), v_ = cache_of(v_cache, "v_cache");
    declared_[0] = declared_view(k_, q.dtype), declared_[1] = declared_view(v_, q.dtype);
    std::map<std::string, const TensorView*> given = {
        {"q", &q}, {"k_cache", &declared_[0]}, {"v_cache", &declared_[1]}, {"cache_seqlens", o.cache_seqlens},
        {"k", o.k}, {"v", o.v}, {"block_table", o.block_table}, {"rotary_cos", o.rotary_cos},
        {"rotary_sin", o.rotary_sin}, {"rotary_seqlens", o.rotary_seqlens}, {"q_descale", o.q_descale},
        {"k_descale", o.k_descale}, {"v_descale", o.v_descale}};
    const SizeEnv sizes = {{"paged", paged_}, {"Rn", o.k && o.k->shape.size() > 1 ? o.k->shape[1] : 0},
                           {"k_float8", k_.float8()}, {"v_float8", v_.float8()}};
    const std::string axes = paged_ ? "(num_blocks, page_size, Hkv, D)" : "(B, Cmax, Hkv, D)";
    cache_binder_.emplace(bundle.contents().declaration("attention_with_kvcache"), "bshd", std::move(given), sizes,
                          std::map<std::string, std::string>{{"cache_axes", axes}});
    cache_binder_->bind_sizes();
    cache_binder_->check_forms(false);
    batch_ = cache_binder_->size("B"), appended_ = cache_binder_->size("Rn");
    if (o.rotary_cos) rotary_dim_ = 2 * cache_binder_->size("half");
    if (!paged_) {
      capacity_ = cache_binder_->size("P");
      return;
    }
    page_ = cache_binder_->size("P"), width_ = cache_binder_->size("Wt");
    capacity_ = width_ * page_;
    page_rows_ = page_rows(k_);
    const std::int64_t v_rows = page_rows(v_);
    if (v_rows != page_rows_)
      throw ArgumentError("v_cache's pages must be as many rows apart as k_cache's (" + std::to_string(page_rows_) +
                          "), got " + std::to_string(v_rows));
    if (page_rows_ != page_)
      throw ArgumentError("k_cache's pages are " + std::to_string(page_rows_) + " rows apart; a bundle entry "
                          "reads pages that follow each other (page_size " + std::to_string(page_) + " rows apart)");
  }

  // The cache as the kernels read it: (B, rows, Hkv, D), a paged cache's rows shared by every
  // batch (stride 0). A quantized or float8 cache: its logical rows, contiguous (what the binder
  // checks; field_rows binds its fields).
  TensorView rows_view(const Cache& cache) const {
    const std::vector<std::int64_t> shape = {batch_, rows(cache), cache.shape[2], cache.shape[3]};
    // Python checks no dtype of a quantized or float8 cache here: the view has q's.
    if (cache.storage() != "plain") return TensorView{cache.stored().data, q_dtype_, shape, {}};
    const Checked pages = checked(cache.stored(), cache.name);
    const std::int64_t row = cache.shape[1] == 1 ? pages.strides[0] : pages.strides[1];
    std::vector<std::int64_t> strides = {paged_ ? 0 : pages.strides[0], row, pages.strides[2], pages.strides[3]};
    return TensorView{cache.stored().data, cache.stored().dtype, shape, strides};
  }

  std::int64_t rows(const Cache& cache) const {
    if (!paged_) return cache.shape[1];
    return cache.shape[0] ? (cache.shape[0] - 1) * page_rows_ + cache.shape[1] : 0;
  }

  // A field of a quantized or float8 cache as the pass binds it (`suffix` its buffer's, see
  // Cache::fields): (B, rows, Hkv, elements per row), contiguous or a paged cache's rows shared
  // by every batch (stride 0); float8 values as their bytes.
  Checked field_rows(const Cache& cache, const std::string& suffix, const TensorView& field) {
    const std::string name = suffix.empty() ? cache.field() : cache.name + "." + suffix.substr(1);
    const Checked given = checked(field, name);
    if (!is_contiguous(given))
      throw ArgumentError(name + " must be contiguous in a bundle call (its kernels read it at fixed strides), got "
                          "strides " + shape_text(given.strides));
    const std::int64_t width = field.shape[3], heads = field.shape[2];
    TensorView& view = field_rows_[cache.name.substr(0, 1) + suffix];
    view = TensorView{field.data, is_float8(field.dtype) ? DType::uint8 : field.dtype,
                      {batch_, rows(cache), heads, width}, {paged_ ? 0 : rows(cache) * heads * width, heads * width,
                                                            width, 1}};
    return checked(view, name);
  }

  // float8_cache.bound_descales: each float8 cache's descale (1 when not given; q_descale's
  // 1 too: the same product), read as the (B, Hkv) contiguous factors the entry binds (the
  // declaration checked them).
  void bind_descales() {
    static float one = 1.0f;  // only read: packed into the call's factors
    static const TensorView kOne{&one, DType::float32, {}, {}};
    const KVCacheOptions& o = options_;
    for (const auto& [name, given, cache] : {std::tuple("q_descale", o.q_descale, &k_),
                                             std::tuple("k_descale", o.k_descale, &k_),
                                             std::tuple("v_descale", o.v_descale, &v_)})
      if (cache->float8()) descales_[name] = descale_rows(given ? *given : kOne, name);
  }

  // float8_cache.descale_rows: `x` as (B, Hkv) float32 factors packed contiguous.
  Checked descale_rows(const TensorView& x, const std::string& name) {
    const std::vector<std::int64_t> rows = {batch_, k_.shape[2]};
    TensorView& view = descale_views_[name];
    view = x.shape.size() < 2 ? TensorView{x.data, x.dtype, rows, {0, 0}} : x;  // a single factor: stride 0
    Checked factors = checked(view, name);
    view_packing::make_addressable(device_, factors, view_packing::Reads::contiguous);
    return factors;
  }

  void bind_contiguous(PassViews& views, const std::string& buffer, Checked view) const {
    view_packing::make_addressable(device_, view, view_packing::Reads::contiguous);
    views.add(buffer, std::move(view));
  }

  // rotary.bind: q read contiguous as the rotation kernel's input (its strides, the runtime
  // sizes, those of that copy), the tables and rotary_seqlens beside it.
  void bind_rotary(PassViews& views) const {
    Checked q = views.views.at("q");
    view_packing::make_addressable(device_, q, view_packing::Reads::contiguous);
    std::vector<std::int64_t> logical = binder_->logical(binder_->declaration().rule("q"), q.strides);
    logical.pop_back();
    views.strided["q"] = std::move(logical);
    views.add("q_unrotated", std::move(q));
    bind_contiguous(views, "rotary_cos", checked(*options_.rotary_cos, "rotary_cos"));
    bind_contiguous(views, "rotary_sin", checked(*options_.rotary_sin, "rotary_sin"));
    if (options_.rotary_seqlens) bind_contiguous(views, "rotary_seqlens", checked(*options_.rotary_seqlens, "rotary_seqlens"));
  }

  // Cache.apart_where_staged: on Metal, no append to k and v caches sharing memory.
  void check_apart() const {
    if (appended_ && device_.kind() == DeviceKind::metal && overlaps(k_, v_))
      throw ArgumentError("v_cache shares memory with k_cache (one stacked tensor): on Metal an append to them would "
                          "let one cache's staged copy overwrite the other's new rows; give separate k and v tensors "
                          "there (the cpu backend takes stacked ones)");
  }

  static bool overlaps(const Cache& a, const Cache& b) {
    auto range = [](const TensorView& view) {
      const Checked c = checked(view, "");
      std::int64_t last = 0;
      for (std::size_t i = 0; i < c.shape.size(); ++i) last += (c.shape[i] - 1) * c.strides[i];
      const auto* start = static_cast<const unsigned char*>(view.data);
      return std::make_pair(start, start + (last + 1) * std::int64_t(dtype_size(view.dtype)));
    };
    for (const auto& a_field : a.fields())
      for (const auto& b_field : b.fields()) {
        const auto [a0, a1] = range(*a_field.second);
        const auto [b0, b1] = range(*b_field.second);
        if (a0 < b1 && b0 < a1) return true;
      }
    return false;
  }

  // Cache.append_on_host: an empty problem runs no kernel, so plain rows are copied here.
  void append_on_host() const {
    if (!appended_) return;
    for (const Cache* cache : {&k_, &v_})
      if (cache->storage() != "plain")
        throw ArgumentError(cache->name + ": appending to a QuantizedTensor or float8 cache needs a non-empty problem "
                            "(queries and heads): the append kernels run in the attention pass");
    const Checked table = paged_ ? checked(*options_.block_table, "block_table") : Checked{};
    for (int i = 0; i < 2; ++i) {
      const Cache& cache = i ? v_ : k_;
      const Checked pages = checked(cache.stored(), cache.name), rows = checked(*(i ? options_.v : options_.k), "k");
      const std::size_t size = dtype_size(cache.stored().dtype);
      for (std::int64_t b = 0; b < batch_; ++b)
        for (std::int64_t r = 0; r < appended_; ++r) {
          const std::int64_t position = int32_at(lengths_, {b}) + r;
          const std::int64_t outer = paged_ ? int32_at(table, {b, position / page_}) : b;
          const std::int64_t row = paged_ ? position % page_ : position;
          for (std::int64_t h = 0; h < cache.shape[2]; ++h)
            for (std::int64_t d = 0; d < cache.shape[3]; ++d) {
              const std::int64_t to = outer * pages.strides[0] + row * pages.strides[1] + h * pages.strides[2] +
                                      d * pages.strides[3];
              const std::int64_t from = b * rows.strides[0] + r * rows.strides[1] + h * rows.strides[2] +
                                        d * rows.strides[3];
              std::memcpy(static_cast<unsigned char*>(cache.stored().data) + to * size,
                          static_cast<const unsigned char*>(rows.view->data) + from * size, size);
            }
        }
    }
  }

  const Device& device_;
  const KVCacheOptions& options_;
  AttentionOptions attention_;
  Cache k_, v_;
  bool paged_ = false;
  DType q_dtype_ = DType::float32;
  std::int64_t rotary_dim_ = 0;
  std::int64_t batch_ = 0, appended_ = 0, page_ = 0, page_rows_ = 0, width_ = 0, capacity_ = 0;
  TensorView declared_[2], rows_[2], capacity_lengths_;
  std::map<std::string, TensorView> field_rows_, descale_views_;  // by pass buffer; Checked views point here
  std::map<std::string, Checked> descales_;
  Checked lengths_;
  std::optional<Binder> cache_binder_, binder_;  // the cache's declaration's, attention's
  Problem problem_;
};

}  // namespace

void attention_with_kvcache(const Device& device, const Bundle& bundle, const TensorView& q, const KVCache& k_cache,
                            const KVCache& v_cache, const TensorView& out, const KVCacheOptions& options,
                            const TensorView* lse) {
  KVCall(device, bundle, q, k_cache, v_cache, out, options, lse).run(nullptr, bundle);
}

void attention_with_kvcache(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const KVCache& k_cache,
                            const KVCache& v_cache, const TensorView& out, const KVCacheOptions& options,
                            const TensorView* lse) {
  KVCall(batch.device(), bundle, q, k_cache, v_cache, out, options, lse).run(&batch, bundle);
}

}  // namespace mfa
