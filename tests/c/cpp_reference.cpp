// The C++ API's side of the C ABI's test: see cpp_reference.h.
#include "cpp_reference.h"

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "mfa/attention.hpp"
#include "mfa/block_sparse.hpp"
#include "mfa/int8.hpp"
#include "mfa/kvcache.hpp"
#include "mfa/merge.hpp"
#include "mfa/quantize.hpp"
#include "mfa/sparse.hpp"
#include "mfa/varlen.hpp"

namespace {

mfa::TensorView view(const mfa_tensor_view& v) {
  static constexpr mfa::DType kDTypes[] = {mfa::DType::float32, mfa::DType::float16, mfa::DType::bfloat16,
                                           mfa::DType::bool8,   mfa::DType::int32,   mfa::DType::uint8,
                                           mfa::DType::uint32,  mfa::DType::float8_e4m3fn,
                                           mfa::DType::float8_e5m2};
  mfa::TensorView t{v.data, kDTypes[v.dtype], std::vector<std::int64_t>(v.shape, v.shape + v.ndim), {}};
  if (v.strides) t.strides.assign(v.strides, v.strides + v.ndim);
  return t;
}

std::optional<mfa::TensorView> optional_view(const mfa_tensor_view* v) {
  return v ? std::optional<mfa::TensorView>(view(*v)) : std::nullopt;
}

mfa::AttentionOptions options_of(const reference_options& r) {
  mfa::AttentionOptions options;
  if (r.has_scale) options.scale = r.scale;
  const std::string causal = r.causal;
  options.causal = causal == "lower_right" ? mfa::Causal::lower_right
                   : causal == "upper_left" ? mfa::Causal::upper_left
                                            : mfa::Causal::none;
  if (r.has_window) options.window = std::make_pair(r.window_left, r.window_right);
  options.mask = optional_view(r.mask);
  options.sinks = optional_view(r.sinks);
  options.layout = std::string(r.layout) == "bshd" ? mfa::Layout::bshd : mfa::Layout::bhsd;
  if (r.has_softcap) options.softcap = r.softcap;
  options.alibi_slopes = optional_view(r.alibi_slopes);
  return options;
}

template <class Body>
int reported(Body&& body, char* error, std::size_t error_size) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_size, "%s", e.what());
    return 1;
  }
}

}  // namespace

extern "C" int cpp_attention(const char* bundle, const reference_options* options, const mfa_tensor_view* q,
                             const mfa_tensor_view* k, const mfa_tensor_view* v, const mfa_tensor_view* out,
                             const mfa_tensor_view* lse, char* error, std::size_t error_size) {
  return reported([&] {
    const std::optional<mfa::TensorView> rows = optional_view(lse);
    mfa::attention(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(*q), view(*k), view(*v),
                   view(*out), options_of(*options), rows ? &*rows : nullptr);
  }, error, error_size);
}

extern "C" int cpp_attention_backward(const char* bundle, const reference_options* options, const mfa_tensor_view* q,
                                      const mfa_tensor_view* k, const mfa_tensor_view* v, const mfa_tensor_view* o,
                                      const mfa_tensor_view* lse, const mfa_tensor_view* dout,
                                      const mfa_tensor_view* dq, const mfa_tensor_view* dk, const mfa_tensor_view* dv,
                                      const mfa_tensor_view* dsinks, char* error, std::size_t error_size) {
  return reported([&] {
    const std::optional<mfa::TensorView> grad_sinks = optional_view(dsinks);
    mfa::attention_backward(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(*q), view(*k), view(*v),
                            view(*o), view(*lse), view(*dout), view(*dq), view(*dk), view(*dv), options_of(*options),
                            grad_sinks ? &*grad_sinks : nullptr);
  }, error, error_size);
}

extern "C" int cpp_int8_attention(const char* bundle, const reference_options* options, const char* qk_scale,
                                  int smooth_k, const char* pv, const mfa_tensor_view* q, const mfa_tensor_view* k,
                                  const mfa_tensor_view* v, const mfa_tensor_view* out, const mfa_tensor_view* lse,
                                  char* error, std::size_t error_size) {
  return reported([&] {
    const mfa::AttentionOptions a = options_of(*options);
    mfa::Int8AttentionOptions o;
    o.scale = a.scale, o.causal = a.causal, o.window = a.window, o.mask = a.mask, o.sinks = a.sinks;
    o.layout = a.layout, o.softcap = a.softcap, o.alibi_slopes = a.alibi_slopes;
    o.qk_scale = qk_scale, o.smooth_k = smooth_k != 0, o.pv = pv;
    const std::optional<mfa::TensorView> rows = optional_view(lse);
    mfa::int8_attention(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(*q), view(*k), view(*v),
                        view(*out), o, rows ? &*rows : nullptr);
  }, error, error_size);
}

extern "C" int cpp_merge_attention(const char* bundle, const mfa_tensor_view* outputs, const mfa_tensor_view* lses,
                                   std::size_t parts, const mfa_tensor_view* out, const mfa_tensor_view* lse,
                                   char* error, std::size_t error_size) {
  return reported([&] {
    std::vector<mfa::TensorView> o, l;
    for (std::size_t i = 0; i < parts; ++i) o.push_back(view(outputs[i])), l.push_back(view(lses[i]));
    mfa::merge_attention(mfa::Device::default_device(), mfa::Bundle::load(bundle), o, l, view(*out), view(*lse));
  }, error, error_size);
}

extern "C" int cpp_quantize(const char* bundle, const mfa_tensor_view* x, const char* format,
                            const mfa_tensor_view* data, const mfa_tensor_view* scales,
                            const mfa_tensor_view* biases, char* error, std::size_t error_size) {
  return reported([&] {
    const bool affine = std::string(format) == "affine";
    mfa::quantize(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(*x),
                  {view(*data), optional_view(scales), optional_view(biases)}, format,
                  affine ? std::optional<std::int64_t>(4) : std::nullopt,
                  affine ? std::optional<std::int64_t>(32) : std::nullopt);
  }, error, error_size);
}

extern "C" int cpp_attention_with_kvcache(const char* bundle, const char* format, const mfa_tensor_view* q,
                                          const mfa_tensor_view* k_cache, const mfa_tensor_view* v_cache,
                                          const mfa_tensor_view* cache_seqlens, const mfa_tensor_view* k,
                                          const mfa_tensor_view* v, const mfa_tensor_view* block_table,
                                          const mfa_tensor_view* k_descale, const mfa_tensor_view* v_descale,
                                          const mfa_tensor_view* out, const mfa_tensor_view* lse, char* error,
                                          std::size_t error_size) {
  return reported([&] {
    const mfa::TensorView lengths = view(*cache_seqlens), new_k = view(*k), new_v = view(*v), rows = view(*lse);
    const std::optional<mfa::TensorView> table = optional_view(block_table), k_factors = optional_view(k_descale),
                                         v_factors = optional_view(v_descale);
    mfa::KVCacheOptions options;
    options.cache_seqlens = &lengths, options.k = &new_k, options.v = &new_v;
    options.block_table = table ? &*table : nullptr;
    options.k_descale = k_factors ? &*k_factors : nullptr, options.v_descale = v_factors ? &*v_factors : nullptr;
    options.causal = mfa::Causal::lower_right;
    const auto cache = [&](const mfa_tensor_view* given) {
      return format ? mfa::KVCache(mfa::QuantizedTensor{format, view(*given), mfa::DType::float32})
                    : mfa::KVCache(view(*given));
    };
    mfa::attention_with_kvcache(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(*q), cache(k_cache),
                                cache(v_cache), view(*out), options, &rows);
  }, error, error_size);
}

extern "C" int cpp_sparse(const char* bundle, const mfa_tensor_view* q_index, const mfa_tensor_view* k_index,
                          const mfa_tensor_view* weights, std::int64_t topk, const mfa_tensor_view* indices,
                          const mfa_tensor_view* q, const mfa_tensor_view* k, const mfa_tensor_view* v,
                          const mfa_tensor_view* out, const mfa_tensor_view* lse, char* error, std::size_t error_size) {
  return reported([&] {
    const mfa::Device device = mfa::Device::default_device();
    const mfa::Bundle loaded = mfa::Bundle::load(bundle);
    const mfa::TensorView rows = view(*lse);
    mfa::sparse_topk(device, loaded, view(*q_index), view(*k_index), view(*weights), topk, view(*indices));
    mfa::sparse_attention(device, loaded, view(*q), view(*k), view(*v), view(*indices), view(*out), {}, &rows);
  }, error, error_size);
}

extern "C" int cpp_block_sparse(const char* bundle, const mfa_tensor_view* lists, std::int64_t q_block,
                                std::int64_t k_block, const mfa_tensor_view* q, const mfa_tensor_view* k,
                                const mfa_tensor_view* v, const mfa_tensor_view* dout, const mfa_tensor_view* out,
                                const mfa_tensor_view* lse, const mfa_tensor_view* dq, const mfa_tensor_view* dk,
                                const mfa_tensor_view* dv, char* error, std::size_t error_size) {
  return reported([&] {
    const mfa::Device device = mfa::Device::default_device();
    const mfa::Bundle loaded = mfa::Bundle::load(bundle);
    mfa::BlockMask mask(view(lists[0]), view(lists[1]));
    mask.full_kv_num_blocks = view(lists[2]), mask.full_kv_indices = view(lists[3]);
    mask.block_size = {q_block, k_block};
    mfa::BlockSparseOptions options;
    options.causal = mfa::Causal::lower_right;
    const mfa::TensorView o = view(*out), rows = view(*lse);
    mfa::block_sparse_attention(device, loaded, view(*q), view(*k), view(*v), mask, o, options, &rows);
    mfa::block_sparse_attention_backward(device, loaded, view(*q), view(*k), view(*v), o, rows, view(*dout), mask,
                                         view(*dq), view(*dk), view(*dv), options);
  }, error, error_size);
}

extern "C" int cpp_attention_varlen(const char* bundle, const mfa_tensor_view* q, const mfa_tensor_view* k,
                                    const mfa_tensor_view* v, const mfa_tensor_view* cu_seqlens_q,
                                    const mfa_tensor_view* cu_seqlens_k, std::int64_t max_seqlen_q,
                                    const mfa_tensor_view* out, const mfa_tensor_view* lse, char* error,
                                    std::size_t error_size) {
  return reported([&] {
    const mfa::TensorView cu_k = view(*cu_seqlens_k), rows = view(*lse);
    mfa::VarlenOptions options;
    options.max_seqlen_q = max_seqlen_q;
    options.causal = mfa::Causal::lower_right;
    mfa::attention_varlen(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(*q), view(*k), view(*v),
                          view(*cu_seqlens_q), &cu_k, view(*out), options, &rows);
  }, error, error_size);
}

extern "C" int cpp_attention_varlen_backward(const char* bundle, const mfa_tensor_view* q, const mfa_tensor_view* k,
                                             const mfa_tensor_view* v, const mfa_tensor_view* o,
                                             const mfa_tensor_view* lse, const mfa_tensor_view* dout,
                                             const mfa_tensor_view* cu_seqlens_q, const mfa_tensor_view* cu_seqlens_k,
                                             const mfa_tensor_view* dq, const mfa_tensor_view* dk,
                                             const mfa_tensor_view* dv, char* error, std::size_t error_size) {
  return reported([&] {
    const mfa::TensorView cu_k = view(*cu_seqlens_k);
    mfa::VarlenOptions options;
    options.causal = mfa::Causal::lower_right;
    mfa::attention_varlen_backward(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(*q), view(*k),
                                   view(*v), view(*o), view(*lse), view(*dout), view(*cu_seqlens_q), &cu_k, view(*dq),
                                   view(*dk), view(*dv), options);
  }, error, error_size);
}
