/* The C++ API's results for the C ABI's test (cpp_reference.cpp): mfa::attention and
 * attention_backward called directly, on a bundle and device of their own, with the
 * options the test sets by name through the C ABI. Each returns 0, or 1 with the
 * exception's message in `error`. */
#ifndef MFA_TEST_CPP_REFERENCE_H
#define MFA_TEST_CPP_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct reference_problem {
  int64_t B, Hq, Hkv, R, C, D;
  double scale;
  int causal; /* 0: none, 1: lower_right */
  int64_t window_left, window_right;
} reference_problem;

int cpp_attention(const char* bundle, const reference_problem* p, const float* q, const float* k, const float* v,
                  const float* sinks, float* out, float* lse, char* error, size_t error_size);
int cpp_attention_backward(const char* bundle, const reference_problem* p, const float* q, const float* k,
                           const float* v, const float* sinks, const float* o, const float* lse, const float* dout,
                           float* dq, float* dk, float* dv, float* dsinks, char* error, size_t error_size);

#ifdef __cplusplus
}
#endif

#endif
