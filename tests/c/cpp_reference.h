/* The C++ API's results for the C ABI's test (cpp_reference.cpp): mfa::attention,
 * attention_backward, attention_with_kvcache, block_sparse_attention, int8_attention, merge_attention and quantize
 * called directly, on a bundle and device of their own, on the same
 * views (mfa.h's structs, converted here on their own) and options the test sets by name
 * through the C ABI. Each returns 0, or 1 with the exception's message in `error`. */
#ifndef MFA_TEST_CPP_REFERENCE_H
#define MFA_TEST_CPP_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

#include "mfa/mfa.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct reference_options {
  int has_scale;
  double scale;
  const char* causal; /* "none", "lower_right", "upper_left" */
  int has_window;
  int64_t window_left, window_right;
  const mfa_tensor_view* mask;  /* NULL: none */
  const mfa_tensor_view* sinks; /* NULL: none */
  const char* layout;           /* "bhsd", "bshd" */
  int has_softcap;
  double softcap;
  const mfa_tensor_view* alibi_slopes; /* NULL: none */
} reference_options;

int cpp_attention(const char* bundle, const reference_options* options, const mfa_tensor_view* q,
                  const mfa_tensor_view* k, const mfa_tensor_view* v, const mfa_tensor_view* out,
                  const mfa_tensor_view* lse, char* error, size_t error_size);
int cpp_attention_backward(const char* bundle, const reference_options* options, const mfa_tensor_view* q,
                           const mfa_tensor_view* k, const mfa_tensor_view* v, const mfa_tensor_view* o,
                           const mfa_tensor_view* lse, const mfa_tensor_view* dout, const mfa_tensor_view* dq,
                           const mfa_tensor_view* dk, const mfa_tensor_view* dv, const mfa_tensor_view* dsinks,
                           char* error, size_t error_size);
/* mfa::attention_with_kvcache (causal) on quantized caches (`format`'s blocks) or, with format
 * NULL, caches as their views give them (float8 with k_descale and v_descale, NULL: none),
 * paged with a block_table (NULL: contiguous), appending k and v. */
int cpp_attention_with_kvcache(const char* bundle, const char* format, const mfa_tensor_view* q,
                               const mfa_tensor_view* k_cache, const mfa_tensor_view* v_cache,
                               const mfa_tensor_view* cache_seqlens, const mfa_tensor_view* k,
                               const mfa_tensor_view* v, const mfa_tensor_view* block_table,
                               const mfa_tensor_view* k_descale, const mfa_tensor_view* v_descale,
                               const mfa_tensor_view* out, const mfa_tensor_view* lse, char* error,
                               size_t error_size);
/* mfa::sparse_topk (causal, float) of q_index, k_index, weights into `indices`, then
 * mfa::sparse_attention of q, k, v over those lists into out and lse. */
int cpp_sparse(const char* bundle, const mfa_tensor_view* q_index, const mfa_tensor_view* k_index,
               const mfa_tensor_view* weights, int64_t topk, const mfa_tensor_view* indices,
               const mfa_tensor_view* q, const mfa_tensor_view* k, const mfa_tensor_view* v,
               const mfa_tensor_view* out, const mfa_tensor_view* lse, char* error, size_t error_size);

/* mfa::block_sparse_attention (lower-right causal inside partial blocks) over `lists`: kv_num_blocks,
 * kv_indices, full_kv_num_blocks, full_kv_indices in blocks of (q_block, k_block), into out and
 * lse; then its backward for dout (against that out and lse) into dq, dk, dv. */
int cpp_block_sparse(const char* bundle, const mfa_tensor_view* lists, int64_t q_block, int64_t k_block,
                     const mfa_tensor_view* q, const mfa_tensor_view* k, const mfa_tensor_view* v,
                     const mfa_tensor_view* dout, const mfa_tensor_view* out, const mfa_tensor_view* lse,
                     const mfa_tensor_view* dq, const mfa_tensor_view* dk, const mfa_tensor_view* dv, char* error,
                     size_t error_size);

/* mfa::int8_attention with qk_scale, smooth_k and pv. */
int cpp_int8_attention(const char* bundle, const reference_options* options, const char* qk_scale, int smooth_k,
                       const char* pv, const mfa_tensor_view* q, const mfa_tensor_view* k, const mfa_tensor_view* v,
                       const mfa_tensor_view* out, const mfa_tensor_view* lse, char* error, size_t error_size);

/* mfa::merge_attention of `parts` parts (bhsd). */
int cpp_merge_attention(const char* bundle, const mfa_tensor_view* outputs, const mfa_tensor_view* lses, size_t parts,
                        const mfa_tensor_view* out, const mfa_tensor_view* lse, char* error, size_t error_size);
/* mfa::quantize into GGUF `format`'s blocks (scales and biases NULL), or 4-bit affine groups of 32. */
int cpp_quantize(const char* bundle, const mfa_tensor_view* x, const char* format, const mfa_tensor_view* data,
                 const mfa_tensor_view* scales, const mfa_tensor_view* biases, char* error, size_t error_size);

/* mfa::attention_varlen on packed sequences, lower-right causal, with max_seqlen_q. */
int cpp_attention_varlen(const char* bundle, const mfa_tensor_view* q, const mfa_tensor_view* k,
                         const mfa_tensor_view* v, const mfa_tensor_view* cu_seqlens_q,
                         const mfa_tensor_view* cu_seqlens_k, int64_t max_seqlen_q, const mfa_tensor_view* out,
                         const mfa_tensor_view* lse, char* error, size_t error_size);
/* mfa::attention_varlen_backward on the same sequences (lower-right causal). */
int cpp_attention_varlen_backward(const char* bundle, const mfa_tensor_view* q, const mfa_tensor_view* k,
                                  const mfa_tensor_view* v, const mfa_tensor_view* o, const mfa_tensor_view* lse,
                                  const mfa_tensor_view* dout, const mfa_tensor_view* cu_seqlens_q,
                                  const mfa_tensor_view* cu_seqlens_k, const mfa_tensor_view* dq,
                                  const mfa_tensor_view* dk, const mfa_tensor_view* dv, char* error, size_t error_size);

#ifdef __cplusplus
}
#endif

#endif
