// The C++ API's side of the C ABI's test: see cpp_reference.h.
#include "cpp_reference.h"

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "mfa/attention.hpp"
#include "mfa/kvcache.hpp"
#include "mfa/varlen.hpp"

namespace {

mfa::TensorView view(const mfa_tensor_view& v) {
  static constexpr mfa::DType kDTypes[] = {mfa::DType::float32, mfa::DType::float16, mfa::DType::bfloat16,
                                           mfa::DType::bool8,   mfa::DType::int32,   mfa::DType::uint8};
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

extern "C" int cpp_attention_with_kvcache(const char* bundle, const char* format, const mfa_tensor_view* q,
                                          const mfa_tensor_view* k_cache, const mfa_tensor_view* v_cache,
                                          const mfa_tensor_view* cache_seqlens, const mfa_tensor_view* k,
                                          const mfa_tensor_view* v, const mfa_tensor_view* block_table,
                                          const mfa_tensor_view* out, const mfa_tensor_view* lse, char* error,
                                          std::size_t error_size) {
  return reported([&] {
    const mfa::TensorView lengths = view(*cache_seqlens), new_k = view(*k), new_v = view(*v);
    const mfa::TensorView table = view(*block_table), rows = view(*lse);
    mfa::KVCacheOptions options;
    options.cache_seqlens = &lengths, options.k = &new_k, options.v = &new_v, options.block_table = &table;
    options.causal = mfa::Causal::lower_right;
    mfa::attention_with_kvcache(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(*q),
                                mfa::QuantizedTensor{format, view(*k_cache), mfa::DType::float32},
                                mfa::QuantizedTensor{format, view(*v_cache), mfa::DType::float32}, view(*out), options,
                                &rows);
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
