// The C++ API's side of the C ABI's test: see cpp_reference.h.
#include "cpp_reference.h"

#include <cstdio>
#include <vector>

#include "mfa/attention.hpp"

namespace {

mfa::TensorView view(const float* data, std::vector<std::int64_t> shape) {
  return mfa::TensorView{const_cast<float*>(data), mfa::DType::float32, std::move(shape), {}};
}

mfa::AttentionOptions options_of(const reference_problem& p, const float* sinks) {
  mfa::AttentionOptions options;
  options.scale = float(p.scale);
  options.causal = p.causal ? mfa::Causal::lower_right : mfa::Causal::none;
  options.window = std::make_pair(p.window_left, p.window_right);
  options.sinks = view(sinks, {p.Hq});
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

extern "C" int cpp_attention(const char* bundle, const reference_problem* p, const float* q, const float* k,
                             const float* v, const float* sinks, float* out, float* lse, char* error,
                             std::size_t error_size) {
  return reported([&] {
    const mfa::TensorView rows = view(lse, {p->B, p->Hq, p->R});
    mfa::attention(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(q, {p->B, p->Hq, p->R, p->D}),
                   view(k, {p->B, p->Hkv, p->C, p->D}), view(v, {p->B, p->Hkv, p->C, p->D}),
                   view(out, {p->B, p->Hq, p->R, p->D}), options_of(*p, sinks), &rows);
  }, error, error_size);
}

extern "C" int cpp_attention_backward(const char* bundle, const reference_problem* p, const float* q, const float* k,
                                      const float* v, const float* sinks, const float* o, const float* lse,
                                      const float* dout, float* dq, float* dk, float* dv, float* dsinks, char* error,
                                      std::size_t error_size) {
  return reported([&] {
    const std::vector<std::int64_t> qs{p->B, p->Hq, p->R, p->D}, ks{p->B, p->Hkv, p->C, p->D};
    const mfa::TensorView grad_sinks = view(dsinks, {p->Hq});
    mfa::attention_backward(mfa::Device::default_device(), mfa::Bundle::load(bundle), view(q, qs), view(k, ks),
                            view(v, ks), view(o, qs), view(lse, {p->B, p->Hq, p->R}), view(dout, qs), view(dq, qs),
                            view(dk, ks), view(dv, ks), options_of(*p, sinks), &grad_sinks);
  }, error, error_size);
}
