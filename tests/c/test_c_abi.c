/* The C ABI (include/mfa/mfa.h) from C99: attention, attention_backward, attention_with_kvcache,
 * sparse_topk, sparse_attention, int8_attention, merge_attention, quantize, attention_varlen
 * and block_sparse_attention (+ backwards) set up by argument names on random inputs give the
 * C++ API's results bit for bit (cpp_reference.cpp calls mfa::attention directly on the same inputs), and bad
 * calls return their code with Python's message before writing anything.
 *   usage: test_c_abi BUNDLE   (written from tests/c/c_abi_spec.json) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpp_reference.h"
#include "mfa/mfa.h"

static int failures = 0;

#define CHECK(condition, ...)                                   \
  do {                                                          \
    if (!(condition)) {                                         \
      ++failures;                                               \
      fprintf(stderr, "%s:%d: FAILED %s: ", __FILE__, __LINE__, #condition); \
      fprintf(stderr, __VA_ARGS__);                             \
      fprintf(stderr, "\n");                                    \
    }                                                           \
  } while (0)

/* xorshift32: the same inputs on every machine; values in [-1, 1), none zero. */
static uint32_t state = 2463534242u;
static float uniform(void) {
  state ^= state << 13, state ^= state >> 17, state ^= state << 5;
  return (float)((state >> 8) | 1u) / 8388608.0f - 1.0f;
}

static float* random_floats(size_t n) {
  float* x = malloc(n * sizeof *x);
  for (size_t i = 0; i < n; ++i) x[i] = uniform();
  return x;
}

/* A NaN payload no kernel writes: an output still holding it was not written. */
static float* poisoned(size_t n) {
  float* x = malloc(n * sizeof *x);
  memset(x, 0xff, n * sizeof *x);
  return x;
}

/* The C++ API reference's poison: other bytes than poisoned()'s, so an element neither call
 * writes differs between the two. */
static float* reference_poisoned(size_t n) {
  float* x = malloc(n * sizeof *x);
  memset(x, 0xee, n * sizeof *x);
  return x;
}

/* Whether every element still holds the poison NaN: nothing wrote x. */
static int all_nan(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!isnan(x[i])) return 0;
  return 1;
}

static int any_nonzero(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (x[i] != 0.0f && !isnan(x[i])) return 1;
  return 0;
}

static mfa_tensor_view view(float* data, int32_t ndim, const int64_t* shape) {
  mfa_tensor_view v = {data, MFA_FLOAT32, ndim, shape, NULL};
  return v;
}

/* Expects `status` to be `want` with `text` in the message. */
static void expect(mfa_status status, mfa_status want, const char* text, const char* what) {
  CHECK(status == want, "%s: got %s (%s), want %s", what, mfa_status_name(status), mfa_last_error(),
        mfa_status_name(want));
  CHECK(strstr(mfa_last_error(), text) != NULL, "%s: message '%s' lacks '%s'", what, mfa_last_error(), text);
}

#define OK(call) CHECK((call) == MFA_OK, "%s", mfa_last_error())

/* The second bundle family: bshd, upper-left causal, a boolean mask broadcast from (R, C),
 * the default scale, no window or sinks, softcap 2 and per-head ALiBi slopes, and q read
 * through strides (padded rows). */
static void masked_bshd(const char* path, const mfa_device* device, const mfa_bundle* bundle) {
  enum { B = 2, R = 21, C = 13, H = 3, D = 16, PAD = 5 };
  const int64_t q_shape[] = {B, R, H, D}, q_strides[] = {R * H * (D + PAD), H * (D + PAD), D + PAD, 1};
  const int64_t k_shape[] = {B, C, H, D}, rows_shape[] = {B, H, R}, mask_shape[] = {R, C};
  const size_t nq = B * R * H * D, nk = B * C * H * D, nrows = B * H * R;
  float *q = random_floats(B * R * H * (D + PAD)), *k = random_floats(nk), *v = random_floats(nk);
  float *dout = random_floats(nq), *slopes = random_floats(H);
  const int64_t heads_shape[] = {H};
  const mfa_tensor_view vslopes = view(slopes, 1, heads_shape);
  unsigned char mask[R * C];
  for (size_t i = 0; i < sizeof mask; ++i) mask[i] = uniform() < 0.5f;
  float *out = poisoned(nq), *lse = poisoned(nrows), *dq = poisoned(nq), *dk = poisoned(nk), *dv = poisoned(nk);
  float *ref[5] = {reference_poisoned(nq), reference_poisoned(nrows), reference_poisoned(nq), reference_poisoned(nk),
                   reference_poisoned(nk)};
  mfa_tensor_view vq = {q, MFA_FLOAT32, 4, q_shape, q_strides}, vmask = {mask, MFA_BOOL, 2, mask_shape, NULL};
  mfa_tensor_view vk = view(k, 4, k_shape), vv = view(v, 4, k_shape), vdout = view(dout, 4, q_shape);
  mfa_tensor_view vout = view(out, 4, q_shape), vlse = view(lse, 3, rows_shape), vdq = view(dq, 4, q_shape);
  mfa_tensor_view vdk = view(dk, 4, k_shape), vdv = view(dv, 4, k_shape);
  mfa_tensor_view rout = view(ref[0], 4, q_shape), rlse = view(ref[1], 3, rows_shape), rdq = view(ref[2], 4, q_shape);
  mfa_tensor_view rdk = view(ref[3], 4, k_shape), rdv = view(ref[4], 4, k_shape);
  const char* names[] = {"q", "k", "v", "mask", "out", "lse", "o", "do", "dq", "dk", "dv"};
  const mfa_tensor_view* views[] = {&vq, &vk, &vv, &vmask, &vout, &vlse, &vout, &vdout, &vdq, &vdk, &vdv};
  mfa_call *call = NULL, *backward = NULL;
  OK(mfa_call_new(bundle, "attention", &call));
  OK(mfa_call_new(bundle, "attention_backward", &backward));
  for (size_t i = 0; i < sizeof names / sizeof *names; ++i) {
    const char* name = names[i];
    if (i < 6) OK(mfa_call_set_tensor(call, name, views[i]));
    if (i < 4 || i > 4) OK(mfa_call_set_tensor(backward, name, views[i]));
  }
  mfa_call* both[] = {call, backward};
  for (int i = 0; i < 2; ++i) {
    OK(mfa_call_set_string(both[i], "causal", "upper_left"));
    OK(mfa_call_set_string(both[i], "layout", "bshd"));
    OK(mfa_call_set_float(both[i], "softcap", 2.0));
    OK(mfa_call_set_tensor(both[i], "alibi_slopes", &vslopes));
  }
  OK(mfa_call_run(call, device));
  OK(mfa_call_run(backward, device));
  char error[4096] = "";
  const reference_options options = {0, 0.0, "upper_left", 0, 0, 0, &vmask, NULL, "bshd", 1, 2.0, &vslopes};
  CHECK(cpp_attention(path, &options, &vq, &vk, &vv, &rout, &rlse, error, sizeof error) == 0, "%s", error);
  CHECK(cpp_attention_backward(path, &options, &vq, &vk, &vv, &vout, &vlse, &vdout, &rdq, &rdk, &rdv, NULL, error,
                               sizeof error) == 0, "%s", error);
  const float* got[5] = {out, lse, dq, dk, dv};
  const size_t sizes[5] = {nq, nrows, nq, nk, nk};
  const char* outputs[5] = {"out", "lse", "dq", "dk", "dv"};
  for (int i = 0; i < 5; ++i) {
    CHECK(any_nonzero(got[i], sizes[i]), "bshd %s: nothing written", outputs[i]);
    CHECK(memcmp(got[i], ref[i], sizes[i] * sizeof(float)) == 0, "bshd %s differs from the C++ API's", outputs[i]);
    free(ref[i]);
  }
  mfa_call_free(call);
  mfa_call_free(backward);
  float* buffers[] = {q, k, v, dout, slopes, out, lse, dq, dk, dv};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) free(buffers[i]);
}

/* q8_0 blocks of random int8 values, each with the float16 scale 2**-7 (bits 0x2000). */
static unsigned char* q8_0_pages(size_t blocks) {
  unsigned char* x = malloc(blocks * 34);
  for (size_t b = 0; b < blocks; ++b) {
    x[34 * b] = 0x00, x[34 * b + 1] = 0x20;
    for (int i = 2; i < 34; ++i) x[34 * b + i] = (unsigned char)(signed char)(uniform() * 127.0f);
  }
  return x;
}

/* The third bundle family: attention_with_kvcache on paged q8_0 caches (pages of 4 rows)
 * with GQA, appending one row per batch: the C ABI gives the C++ API's output, lse and
 * cache bytes; a call beyond the cache's capacity is refused before writing. */
static void paged_decode(const char* path, const mfa_device* device, const mfa_bundle* bundle) {
  enum { B = 2, HKV = 2, HQ = 4, D = 32, PAGE = 4, BLOCKS = 6, WIDTH = 3, ROW = D / 32 * 34 };
  const int64_t q_shape[] = {B, 1, HQ, D}, new_shape[] = {B, 1, HKV, D}, rows_shape[] = {B, HQ, 1};
  const int64_t pages_shape[] = {BLOCKS, PAGE, HKV, ROW}, lengths_shape[] = {B}, table_shape[] = {B, WIDTH};
  const size_t nq = B * HQ * D, nrows = B * HQ, npages = (size_t)BLOCKS * PAGE * HKV * ROW;
  float *q = random_floats(nq), *k = random_floats(B * HKV * D), *v = random_floats(B * HKV * D);
  unsigned char *k_pages = q8_0_pages(npages / 34), *v_pages = q8_0_pages(npages / 34);
  unsigned char *k_copy = malloc(npages), *v_copy = malloc(npages);
  memcpy(k_copy, k_pages, npages), memcpy(v_copy, v_pages, npages);
  int32_t lengths[B] = {5, 2}, table[B * WIDTH] = {4, 1, 3, 0, 5, 2}, too_long[B] = {12, 2};
  float *out = poisoned(nq), *lse = poisoned(nrows);
  float *ref_out = reference_poisoned(nq), *ref_lse = reference_poisoned(nrows);
  mfa_tensor_view vq = view(q, 4, q_shape), vk = view(k, 4, new_shape), vv = view(v, 4, new_shape);
  mfa_tensor_view vkp = {k_pages, MFA_UINT8, 4, pages_shape, NULL}, vvp = {v_pages, MFA_UINT8, 4, pages_shape, NULL};
  mfa_tensor_view rkp = {k_copy, MFA_UINT8, 4, pages_shape, NULL}, rvp = {v_copy, MFA_UINT8, 4, pages_shape, NULL};
  mfa_tensor_view vlengths = {lengths, MFA_INT32, 1, lengths_shape, NULL}, vtable = {table, MFA_INT32, 2, table_shape,
                                                                                      NULL};
  mfa_tensor_view vlong = {too_long, MFA_INT32, 1, lengths_shape, NULL};
  mfa_tensor_view vout = view(out, 4, q_shape), vlse = view(lse, 3, rows_shape);
  mfa_tensor_view rout = view(ref_out, 4, q_shape), rlse = view(ref_lse, 3, rows_shape);
  mfa_call* call = NULL;
  OK(mfa_call_new(bundle, "attention_with_kvcache", &call));
  OK(mfa_call_set_tensor(call, "q", &vq));
  OK(mfa_call_set_quantized(call, "k_cache", "q8_0", &vkp));
  OK(mfa_call_set_quantized(call, "v_cache", "q8_0", &vvp));
  OK(mfa_call_set_tensor(call, "k", &vk));
  OK(mfa_call_set_tensor(call, "v", &vv));
  OK(mfa_call_set_tensor(call, "block_table", &vtable));
  OK(mfa_call_set_tensor(call, "out", &vout));
  OK(mfa_call_set_tensor(call, "lse", &vlse));
  OK(mfa_call_set_bool(call, "causal", 1));
  OK(mfa_call_set_tensor(call, "cache_seqlens", &vlong));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR,
         "batch 0 attends cache_seqlens + Rn = 13 keys, beyond the cache's capacity max_blocks * page_size = 3 * 4",
         "an append past the pages");
  CHECK(memcmp(k_pages, k_copy, npages) == 0 && all_nan(out, nq), "a refused append wrote something");
  OK(mfa_call_set_tensor(call, "cache_seqlens", &vlengths));
  OK(mfa_call_set_tensor(call, "rotary_cos", &vq)); /* the rotary arguments reach the op: */
  OK(mfa_call_set_bool(call, "rotary_interleaved", 0));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR, "rotary_cos and rotary_sin are given together",
         "rotary_cos without rotary_sin");
  OK(mfa_call_set_none(call, "rotary_cos"));
  OK(mfa_call_run(call, device));
  char error[4096] = "";
  CHECK(cpp_attention_with_kvcache(path, "q8_0", &vq, &rkp, &rvp, &vlengths, &vk, &vv, &vtable, NULL, NULL, &rout,
                                   &rlse, error, sizeof error) == 0, "%s", error);
  CHECK(any_nonzero(out, nq), "kvcache out: nothing written");
  CHECK(memcmp(out, ref_out, nq * sizeof *out) == 0, "kvcache out differs from the C++ API's");
  CHECK(memcmp(lse, ref_lse, nrows * sizeof *lse) == 0, "kvcache lse differs from the C++ API's");
  CHECK(memcmp(k_pages, k_copy, npages) == 0 && memcmp(v_pages, v_copy, npages) == 0,
        "the appended cache bytes differ from the C++ API's");
  mfa_call_free(call);
  void* buffers[] = {q, k, v, k_pages, v_pages, k_copy, v_copy, out, lse, ref_out, ref_lse};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) free(buffers[i]);
}

/* Random float8 bytes below 2 in magnitude (bit 6 clear: no e4m3fn NaN, no e5m2 inf or NaN). */
static unsigned char* float8_bytes(size_t n) {
  unsigned char* x = malloc(n);
  for (size_t i = 0; i < n; ++i) x[i] = (unsigned char)((int)(uniform() * 127.0f + 128.0f) & 0xBF);
  return x;
}

/* The float8 bundle family: attention_with_kvcache on contiguous caches stored float8_e4m3fn
 * (k) and float8_e5m2 (v), k_descale (B, Hkv) and v_descale a single factor, appending one row
 * per batch: the C ABI gives the C++ API's output, lse and cache bytes; a v_descale of another
 * shape is refused with Python's message before writing, and so is an affine cache of 7 bits. */
static void float8_decode(const char* path, const mfa_device* device, const mfa_bundle* bundle) {
  enum { B = 2, HKV = 2, HQ = 4, D = 32, CMAX = 8 };
  const int64_t q_shape[] = {B, 1, HQ, D}, new_shape[] = {B, 1, HKV, D}, rows_shape[] = {B, HQ, 1};
  const int64_t cache_shape[] = {B, CMAX, HKV, D}, lengths_shape[] = {B}, descale_shape[] = {B, HKV};
  const int64_t one_shape[] = {1}, bad_shape[] = {3};
  const size_t nq = B * HQ * D, nrows = B * HQ, ncache = (size_t)B * CMAX * HKV * D;
  float *q = random_floats(nq), *k = random_floats(B * HKV * D), *v = random_floats(B * HKV * D);
  float k_factors[B * HKV] = {0.5f, 1.5f, 2.0f, 0.75f}, v_factor[3] = {1.25f, 1.0f, 1.0f};
  unsigned char *k_cache = float8_bytes(ncache), *v_cache = float8_bytes(ncache);
  unsigned char *k_copy = malloc(ncache), *v_copy = malloc(ncache), *k_given = malloc(ncache);
  memcpy(k_copy, k_cache, ncache), memcpy(v_copy, v_cache, ncache), memcpy(k_given, k_cache, ncache);
  int32_t lengths[B] = {5, 0};
  float *out = poisoned(nq), *lse = poisoned(nrows);
  float *ref_out = reference_poisoned(nq), *ref_lse = reference_poisoned(nrows);
  mfa_tensor_view vq = view(q, 4, q_shape), vk = view(k, 4, new_shape), vv = view(v, 4, new_shape);
  mfa_tensor_view vkc = {k_cache, MFA_FLOAT8_E4M3FN, 4, cache_shape, NULL};
  mfa_tensor_view vvc = {v_cache, MFA_FLOAT8_E5M2, 4, cache_shape, NULL};
  mfa_tensor_view rkc = {k_copy, MFA_FLOAT8_E4M3FN, 4, cache_shape, NULL};
  mfa_tensor_view rvc = {v_copy, MFA_FLOAT8_E5M2, 4, cache_shape, NULL};
  mfa_tensor_view vk_factors = view(k_factors, 2, descale_shape), vv_factor = view(v_factor, 1, one_shape);
  mfa_tensor_view vbad = view(v_factor, 1, bad_shape);
  mfa_tensor_view vlengths = {lengths, MFA_INT32, 1, lengths_shape, NULL};
  mfa_tensor_view vout = view(out, 4, q_shape), vlse = view(lse, 3, rows_shape);
  mfa_tensor_view rout = view(ref_out, 4, q_shape), rlse = view(ref_lse, 3, rows_shape);
  mfa_call* call = NULL;
  OK(mfa_call_new(bundle, "attention_with_kvcache", &call));
  const char* names[] = {"q", "k_cache", "v_cache", "cache_seqlens", "k", "v", "k_descale", "v_descale", "out", "lse"};
  const mfa_tensor_view* views[] = {&vq, &vkc, &vvc, &vlengths, &vk, &vv, &vk_factors, &vbad, &vout, &vlse};
  for (size_t i = 0; i < sizeof names / sizeof *names; ++i) OK(mfa_call_set_tensor(call, names[i], views[i]));
  OK(mfa_call_set_bool(call, "causal", 1));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR,
         "v_descale must be (B, Hkv) = (2, 2) or a single factor ((1,) or 0-d), got shape (3,)", "a v_descale (3,)");
  CHECK(memcmp(k_cache, k_given, ncache) == 0 && all_nan(out, nq), "a refused float8 call wrote something");
  OK(mfa_call_set_tensor(call, "v_descale", &vv_factor));
  OK(mfa_call_run(call, device));
  char error[4096] = "";
  CHECK(cpp_attention_with_kvcache(path, NULL, &vq, &rkc, &rvc, &vlengths, &vk, &vv, NULL, &vk_factors, &vv_factor,
                                   &rout, &rlse, error, sizeof error) == 0, "%s", error);
  CHECK(any_nonzero(out, nq), "float8 kvcache out: nothing written");
  CHECK(memcmp(out, ref_out, nq * sizeof *out) == 0, "float8 kvcache out differs from the C++ API's");
  CHECK(memcmp(lse, ref_lse, nrows * sizeof *lse) == 0, "float8 kvcache lse differs from the C++ API's");
  CHECK(memcmp(k_cache, k_copy, ncache) == 0 && memcmp(v_cache, v_copy, ncache) == 0,
        "the appended float8 bytes differ from the C++ API's");
  CHECK(memcmp(k_cache, k_given, ncache) != 0, "the float8 append wrote nothing");
  /* An affine k_cache reaches the C++ op's checks, QuantizedTensor's (bits before any shape). */
  const int64_t words_shape[] = {B, CMAX, HKV, D * 4 / 32}, groups_shape[] = {B, CMAX, HKV, 1};
  mfa_tensor_view words = {k_cache, MFA_UINT32, 4, words_shape, NULL}, groups = view(ref_out, 4, groups_shape);
  OK(mfa_call_set_quantized_affine(call, "k_cache", &words, &groups, &groups, 7, 32));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR,
         "bits must be one of (2, 3, 4, 5, 6, 8) for the affine format, got 7", "an affine cache of 7 bits");
  mfa_call_free(call);
  void* buffers[] = {q, k, v, k_cache, v_cache, k_copy, v_copy, k_given, out, lse, ref_out, ref_lse};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) free(buffers[i]);
}

/* The varlen bundle family: attention_varlen on three packed sequences (one empty) with GQA,
 * heads packed by max_seqlen_q: the C ABI gives the C++ API's output and lse, and its backward
 * the C++ API's gradients; a cu_seqlens_q that decreases is refused with Python's message
 * before writing, and a backward given seqused_k is not computed. */
static void packed_varlen(const char* path, const mfa_device* device, const mfa_bundle* bundle) {
  enum { TQ = 9, TK = 14, HKV = 2, HQ = 4, D = 16, NCU = 4 };
  const int64_t q_shape[] = {TQ, HQ, D}, k_shape[] = {TK, HKV, D}, rows_shape[] = {HQ, TQ}, cu_shape[] = {NCU};
  const size_t nq = TQ * HQ * D, nrows = HQ * TQ;
  float *q = random_floats(nq), *k = random_floats(TK * HKV * D), *v = random_floats(TK * HKV * D);
  int32_t cu_q[NCU] = {0, 4, 4, TQ}, cu_k[NCU] = {0, 6, 9, TK}, bad_cu[NCU] = {0, 5, 3, TQ};
  float *out = poisoned(nq), *lse = poisoned(nrows);
  float *ref_out = reference_poisoned(nq), *ref_lse = reference_poisoned(nrows);
  mfa_tensor_view vq = view(q, 3, q_shape), vk = view(k, 3, k_shape), vv = view(v, 3, k_shape);
  mfa_tensor_view vcu_q = {cu_q, MFA_INT32, 1, cu_shape, NULL}, vcu_k = {cu_k, MFA_INT32, 1, cu_shape, NULL};
  mfa_tensor_view vbad = {bad_cu, MFA_INT32, 1, cu_shape, NULL};
  mfa_tensor_view vout = view(out, 3, q_shape), vlse = view(lse, 2, rows_shape);
  mfa_tensor_view rout = view(ref_out, 3, q_shape), rlse = view(ref_lse, 2, rows_shape);
  mfa_call* call = NULL;
  OK(mfa_call_new(bundle, "attention_varlen", &call));
  OK(mfa_call_set_tensor(call, "q", &vq));
  OK(mfa_call_set_tensor(call, "k", &vk));
  OK(mfa_call_set_tensor(call, "v", &vv));
  OK(mfa_call_set_tensor(call, "cu_seqlens_q", &vbad));
  OK(mfa_call_set_tensor(call, "cu_seqlens_k", &vcu_k));
  OK(mfa_call_set_int(call, "max_seqlen_q", 5));
  OK(mfa_call_set_tensor(call, "out", &vout));
  OK(mfa_call_set_tensor(call, "lse", &vlse));
  OK(mfa_call_set_bool(call, "causal", 1));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR,
         "cu_seqlens_q must be non-decreasing, but cu_seqlens_q[2] = 3 < cu_seqlens_q[1] = 5", "a decreasing cu_seqlens_q");
  CHECK(all_nan(out, nq) && all_nan(lse, nrows), "a refused varlen call wrote something");
  OK(mfa_call_set_tensor(call, "cu_seqlens_q", &vcu_q));
  OK(mfa_call_run(call, device));
  char error[4096] = "";
  CHECK(cpp_attention_varlen(path, &vq, &vk, &vv, &vcu_q, &vcu_k, 5, &rout, &rlse, error, sizeof error) == 0, "%s",
        error);
  CHECK(any_nonzero(out, nq), "varlen out: nothing written");
  CHECK(memcmp(out, ref_out, nq * sizeof *out) == 0, "varlen out differs from the C++ API's");
  CHECK(memcmp(lse, ref_lse, nrows * sizeof *lse) == 0, "varlen lse differs from the C++ API's");
  mfa_call_free(call);
  /* The backward: o and lse as written, dq, dk and dv by name, the C++ API's bits. */
  const size_t nk = TK * HKV * D;
  float *dout = random_floats(nq), *dq = poisoned(nq), *dk = poisoned(nk), *dv = poisoned(nk);
  float *ref_dq = reference_poisoned(nq), *ref_dk = reference_poisoned(nk), *ref_dv = reference_poisoned(nk);
  mfa_tensor_view vdout = view(dout, 3, q_shape), vdq = view(dq, 3, q_shape), vdk = view(dk, 3, k_shape),
                  vdv = view(dv, 3, k_shape);
  mfa_tensor_view rdq = view(ref_dq, 3, q_shape), rdk = view(ref_dk, 3, k_shape), rdv = view(ref_dv, 3, k_shape);
  OK(mfa_call_new(bundle, "attention_varlen_backward", &call));
  const char* names[] = {"q", "k", "v", "o", "lse", "do", "cu_seqlens_q", "cu_seqlens_k", "dq", "dk", "dv"};
  const mfa_tensor_view* views[] = {&vq, &vk, &vv, &vout, &vlse, &vdout, &vcu_q, &vcu_k, &vdq, &vdk, &vdv};
  for (size_t i = 0; i < sizeof names / sizeof *names; ++i) OK(mfa_call_set_tensor(call, names[i], views[i]));
  OK(mfa_call_set_bool(call, "causal", 1));
  OK(mfa_call_run(call, device));
  CHECK(cpp_attention_varlen_backward(path, &vq, &vk, &vv, &vout, &vlse, &vdout, &vcu_q, &vcu_k, &rdq, &rdk, &rdv,
                                      error, sizeof error) == 0, "%s", error);
  CHECK(any_nonzero(dq, nq) && any_nonzero(dk, nk) && any_nonzero(dv, nk), "varlen backward: nothing written");
  CHECK(memcmp(dq, ref_dq, nq * sizeof *dq) == 0 && memcmp(dk, ref_dk, nk * sizeof *dk) == 0 &&
            memcmp(dv, ref_dv, nk * sizeof *dv) == 0,
        "varlen dq, dk or dv differs from the C++ API's");
  /* seqused_k is forward-only: the same call with it is not computed, and nothing is written. */
  int32_t used[NCU - 1] = {6, 3, 5};
  const int64_t used_shape[] = {NCU - 1};
  mfa_tensor_view vused = {used, MFA_INT32, 1, used_shape, NULL};
  OK(mfa_call_set_tensor(call, "seqused_k", &vused));
  memset(dq, 0xff, nq * sizeof *dq);
  expect(mfa_call_run(call, device), MFA_NOT_IMPLEMENTED_ERROR, "seqused_k given, but keys limited by seqused_k is "
         "forward-only", "a varlen backward with seqused_k");
  CHECK(all_nan(dq, nq), "a refused varlen backward wrote something");
  mfa_call_free(call);
  void* buffers[] = {q, k, v, out, lse, ref_out, ref_lse, dout, dq, dk, dv, ref_dq, ref_dk, ref_dv};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) free(buffers[i]);
}

/* The indexer then sparse attention over its lists (bundle families four and five): the C
 * ABI's indices, out and lse are the C++ API's; the lists are padded with -1 past each row's
 * candidates (causal), which sparse_attention skips. */
static void indexed(const char* path, const mfa_device* device, const mfa_bundle* bundle) {
  enum { B = 1, HI = 2, HQ = 2, R = 5, C = 12, DI = 16, D = 16, TOPK = 4 };
  const int64_t qi_shape[] = {B, HI, R, DI}, ki_shape[] = {B, 1, C, DI}, w_shape[] = {B, HI, R};
  const int64_t list_shape[] = {B, 1, R, TOPK}, q_shape[] = {B, HQ, R, D}, kv_shape[] = {B, 1, C, D};
  const int64_t rows_shape[] = {B, HQ, R};
  const size_t nlists = B * R * TOPK, nq = B * HQ * R * D, nrows = B * HQ * R;
  float *qi = random_floats(B * HI * R * DI), *ki = random_floats(B * C * DI), *w = random_floats(B * HI * R);
  float *q = random_floats(nq), *k = random_floats(B * C * D), *v = random_floats(B * C * D);
  float *out = poisoned(nq), *lse = poisoned(nrows);
  float *ref_out = reference_poisoned(nq), *ref_lse = reference_poisoned(nrows);
  int32_t lists[B * R * TOPK], ref_lists[B * R * TOPK];
  memset(lists, 0x80, sizeof lists), memset(ref_lists, 0x81, sizeof ref_lists);
  mfa_tensor_view vqi = view(qi, 4, qi_shape), vki = view(ki, 4, ki_shape), vw = view(w, 3, w_shape);
  mfa_tensor_view vlists = {lists, MFA_INT32, 4, list_shape, NULL}, rlists = {ref_lists, MFA_INT32, 4, list_shape, NULL};
  mfa_tensor_view vq = view(q, 4, q_shape), vk = view(k, 4, kv_shape), vv = view(v, 4, kv_shape);
  mfa_tensor_view vout = view(out, 4, q_shape), vlse = view(lse, 3, rows_shape);
  mfa_tensor_view rout = view(ref_out, 4, q_shape), rlse = view(ref_lse, 3, rows_shape);
  mfa_call *topk = NULL, *call = NULL;
  OK(mfa_call_new(bundle, "sparse_topk", &topk));
  const char* topk_names[] = {"q", "k", "weights", "indices"};
  const mfa_tensor_view* topk_views[] = {&vqi, &vki, &vw, &vlists};
  for (int i = 0; i < 4; ++i) OK(mfa_call_set_tensor(topk, topk_names[i], topk_views[i]));
  expect(mfa_call_run(topk, device), MFA_TYPE_ERROR, "sparse_topk() missing 1 required argument: 'topk'",
         "the indexer without topk");
  OK(mfa_call_set_int(topk, "topk", TOPK));
  OK(mfa_call_run(topk, device));
  OK(mfa_call_new(bundle, "sparse_attention", &call));
  const char* names[] = {"q", "k", "v", "indices", "out", "lse"};
  const mfa_tensor_view* views[] = {&vq, &vk, &vv, &vlists, &vout, &vlse};
  for (int i = 0; i < 6; ++i) OK(mfa_call_set_tensor(call, names[i], views[i]));
  OK(mfa_call_run(call, device));
  char error[4096] = "";
  CHECK(cpp_sparse(path, &vqi, &vki, &vw, TOPK, &rlists, &vq, &vk, &vv, &rout, &rlse, error, sizeof error) == 0, "%s",
        error);
  CHECK(memcmp(lists, ref_lists, nlists * sizeof *lists) == 0 && lists[0] >= 0, "the C ABI's lists differ");
  CHECK(any_nonzero(out, nq), "sparse out: nothing written");
  CHECK(memcmp(out, ref_out, nq * sizeof *out) == 0, "sparse out differs from the C++ API's");
  CHECK(memcmp(lse, ref_lse, nrows * sizeof *lse) == 0, "sparse lse differs from the C++ API's");
  mfa_call* backward = NULL; /* its row: Python's argument names, checked before anything runs */
  OK(mfa_call_new(bundle, "sparse_attention_backward", &backward));
  OK(mfa_call_set_tensor(backward, "q", &vq));
  expect(mfa_call_run(backward, device), MFA_TYPE_ERROR,
         "sparse_attention_backward() missing 9 required arguments: 'k', 'v', 'indices', 'o', 'lse', 'do', 'dq', "
         "'dk', and 'dv'", "the sparse backward's arguments");
  mfa_call_free(backward);
  mfa_call_free(topk);
  mfa_call_free(call);
  float* buffers[] = {qi, ki, w, q, k, v, out, lse, ref_out, ref_lse};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) free(buffers[i]);
}

/* The sixth bundle family: int8_attention (tile scales, no smoothing, int8 P V) with GQA,
 * causal, a window and sinks, the scale given: the C ABI gives the C++ API's output and lse;
 * a bad qk_scale and a pv the bundle lacks are refused with Python's message. */
static void int8_call(const char* path, const mfa_device* device, const mfa_bundle* bundle) {
  enum { B = 2, HQ = 4, HKV = 2, R = 9, C = 70, D = 16 };
  const int64_t q_shape[] = {B, HQ, R, D}, k_shape[] = {B, HKV, C, D}, rows_shape[] = {B, HQ, R}, heads[] = {HQ};
  const size_t nq = B * HQ * R * D, nk = B * HKV * C * D, nrows = B * HQ * R;
  float *q = random_floats(nq), *k = random_floats(nk), *v = random_floats(nk), *sinks = random_floats(HQ);
  float *out = poisoned(nq), *lse = poisoned(nrows);
  float *ref_out = reference_poisoned(nq), *ref_lse = reference_poisoned(nrows);
  mfa_tensor_view vq = view(q, 4, q_shape), vk = view(k, 4, k_shape), vv = view(v, 4, k_shape);
  mfa_tensor_view vsinks = view(sinks, 1, heads), vout = view(out, 4, q_shape), vlse = view(lse, 3, rows_shape);
  mfa_tensor_view rout = view(ref_out, 4, q_shape), rlse = view(ref_lse, 3, rows_shape);
  mfa_call* call = NULL;
  OK(mfa_call_new(bundle, "int8_attention", &call));
  const char* names[] = {"q", "k", "v", "sinks", "out", "lse"};
  const mfa_tensor_view* views[] = {&vq, &vk, &vv, &vsinks, &vout, &vlse};
  for (size_t i = 0; i < sizeof names / sizeof *names; ++i) OK(mfa_call_set_tensor(call, names[i], views[i]));
  OK(mfa_call_set_bool(call, "causal", 1));
  OK(mfa_call_set_int_pair(call, "window", 20, 0));
  OK(mfa_call_set_float(call, "scale", 0.3));
  OK(mfa_call_set_string(call, "qk_scale", "tile"));
  OK(mfa_call_set_bool(call, "smooth_k", 0));
  OK(mfa_call_run(call, device));
  char error[4096] = "";
  const reference_options options = {1, 0.3, "lower_right", 1, 20, 0, NULL, &vsinks, "bhsd", 0, 0.0, NULL};
  CHECK(cpp_int8_attention(path, &options, "tile", 0, "int8", &vq, &vk, &vv, &rout, &rlse, error, sizeof error) == 0,
        "%s", error);
  CHECK(any_nonzero(out, nq), "int8 out: nothing written");
  CHECK(memcmp(out, ref_out, nq * sizeof *out) == 0, "int8 out differs from the C++ API's");
  CHECK(memcmp(lse, ref_lse, nrows * sizeof *lse) == 0, "int8 lse differs from the C++ API's");
  OK(mfa_call_set_string(call, "qk_scale", "row"));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR, "qk_scale must be 'token' or 'tile', got 'row'",
         "a bad qk_scale");
  OK(mfa_call_set_string(call, "qk_scale", "tile"));
  OK(mfa_call_set_string(call, "pv", "float"));
  expect(mfa_call_run(call, device), MFA_NO_BUNDLE_ENTRY_ERROR, "qk_scale=tile smooth_k=no pv=float",
         "an int8 entry the bundle lacks");
  expect(mfa_call_set_string(call, "score_mod", "score"), MFA_TYPE_ERROR,
         "int8_attention() got an unexpected keyword argument 'score_mod'", "score_mod for int8");
  mfa_call_free(call);
  float* buffers[] = {q, k, v, sinks, out, lse, ref_out, ref_lse};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) free(buffers[i]);
}

/* The last two families: merge_attention of two parts and quantize to q8_0 give the C++ API's
 * bits; a merge of parts of two shapes and a quantize of a last axis of 48 are refused with
 * Python's message. */
static void merge_and_quantize(const char* path, const mfa_device* device, const mfa_bundle* bundle) {
  enum { B = 2, H = 4, R = 9, DV = 16, ROWS = 3, D = 64 };
  const int64_t o_shape[] = {B, H, R, DV}, rows_shape[] = {B, H, R}, short_shape[] = {B, H, R, DV - 1};
  const size_t no = B * H * R * DV, nrows = B * H * R;
  float *parts[2] = {random_floats(no), random_floats(no)}, *lses[2] = {random_floats(nrows), random_floats(nrows)};
  float *out = poisoned(no), *lse = poisoned(nrows);
  float *ref_out = reference_poisoned(no), *ref_lse = reference_poisoned(nrows);
  const mfa_tensor_view vparts[2] = {view(parts[0], 4, o_shape), view(parts[1], 4, o_shape)};
  const mfa_tensor_view vlses[2] = {view(lses[0], 3, rows_shape), view(lses[1], 3, rows_shape)};
  mfa_tensor_view vout = view(out, 4, o_shape), vlse = view(lse, 3, rows_shape);
  mfa_tensor_view rout = view(ref_out, 4, o_shape), rlse = view(ref_lse, 3, rows_shape);
  mfa_call* call = NULL;
  OK(mfa_call_new(bundle, "merge_attention", &call));
  OK(mfa_call_set_tensors(call, "outputs", vparts, 2));
  OK(mfa_call_set_tensors(call, "lses", vlses, 2));
  OK(mfa_call_set_tensor(call, "out", &vout));
  OK(mfa_call_set_tensor(call, "lse", &vlse));
  OK(mfa_call_run(call, device));
  char error[4096] = "";
  CHECK(cpp_merge_attention(path, vparts, vlses, 2, &rout, &rlse, error, sizeof error) == 0, "%s", error);
  CHECK(any_nonzero(out, no), "merge out: nothing written");
  CHECK(memcmp(out, ref_out, no * sizeof *out) == 0, "merge out differs from the C++ API's");
  CHECK(memcmp(lse, ref_lse, nrows * sizeof *lse) == 0, "merge lse differs from the C++ API's");
  mfa_tensor_view uneven[2] = {vparts[0], vparts[1]};
  uneven[1].shape = short_shape;
  OK(mfa_call_set_tensors(call, "outputs", uneven, 2));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR,
         "outputs must be 4-d arrays of one dtype and shape: outputs[0] is float32 (2, 4, 9, 16), outputs[1] is "
         "float32 (2, 4, 9, 15)", "parts of two shapes");
  mfa_call_free(call);

  const int64_t x_shape[] = {ROWS, D}, data_shape[] = {ROWS, D / 32 * 34}, odd_shape[] = {ROWS, 48};
  float* x = random_floats(ROWS * D);
  unsigned char *data = malloc(ROWS * D / 32 * 34), *ref_data = malloc(ROWS * D / 32 * 34);
  memset(data, 0xff, ROWS * D / 32 * 34);
  memset(ref_data, 0xee, ROWS * D / 32 * 34);
  mfa_tensor_view vx = view(x, 2, x_shape);
  mfa_tensor_view vdata = {data, MFA_UINT8, 2, data_shape, NULL}, rdata = {ref_data, MFA_UINT8, 2, data_shape, NULL};
  OK(mfa_call_new(bundle, "quantize", &call));
  OK(mfa_call_set_tensor(call, "x", &vx));
  OK(mfa_call_set_tensor(call, "data", &vdata));
  OK(mfa_call_set_string(call, "format", "q8_0"));
  OK(mfa_call_run(call, device));
  CHECK(cpp_quantize(path, &vx, "q8_0", &rdata, NULL, NULL, error, sizeof error) == 0, "%s", error);
  CHECK(memcmp(data, ref_data, ROWS * D / 32 * 34) == 0, "quantize's blocks differ from the C++ API's");
  /* 4-bit affine groups of 32: uint32 words (MFA_UINT32), a scale and a bias per group. */
  const int64_t words_shape[] = {ROWS, D / 8}, groups_shape[] = {ROWS, D / 32};
  uint32_t words[ROWS * D / 8], ref_words[ROWS * D / 8];
  float *scales = poisoned(ROWS * D / 32), *biases = poisoned(ROWS * D / 32);
  float *ref_scales = reference_poisoned(ROWS * D / 32), *ref_biases = reference_poisoned(ROWS * D / 32);
  memset(words, 0xff, sizeof words), memset(ref_words, 0xee, sizeof ref_words);
  mfa_tensor_view vwords = {words, MFA_UINT32, 2, words_shape, NULL};
  mfa_tensor_view rwords = {ref_words, MFA_UINT32, 2, words_shape, NULL};
  mfa_tensor_view vscales = view(scales, 2, groups_shape), vbiases = view(biases, 2, groups_shape);
  mfa_tensor_view rscales = view(ref_scales, 2, groups_shape), rbiases = view(ref_biases, 2, groups_shape);
  OK(mfa_call_set_tensor(call, "data", &vwords));
  OK(mfa_call_set_tensor(call, "scales", &vscales));
  OK(mfa_call_set_tensor(call, "biases", &vbiases));
  OK(mfa_call_set_string(call, "format", "affine"));
  OK(mfa_call_set_int(call, "bits", 4));
  OK(mfa_call_set_int(call, "group_size", 32));
  OK(mfa_call_run(call, device));
  CHECK(cpp_quantize(path, &vx, "affine", &rwords, &rscales, &rbiases, error, sizeof error) == 0, "%s", error);
  CHECK(memcmp(words, ref_words, sizeof words) == 0 && any_nonzero(scales, ROWS * D / 32),
        "quantize's affine words differ from the C++ API's");
  CHECK(memcmp(scales, ref_scales, ROWS * D / 32 * sizeof *scales) == 0 &&
        memcmp(biases, ref_biases, ROWS * D / 32 * sizeof *biases) == 0,
        "quantize's affine scales or biases differ from the C++ API's");
  OK(mfa_call_set_int(call, "group_size", 64));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR,
         "scales must be float32 (3, 1) for affine 4-bit, groups of 64, got float32 (3, 2)",
         "scales of another group size");
  OK(mfa_call_set_string(call, "format", "q8_0"));
  OK(mfa_call_set_none(call, "bits"));
  OK(mfa_call_set_none(call, "group_size"));
  free(scales), free(biases), free(ref_scales), free(ref_biases);
  mfa_tensor_view odd = view(x, 2, odd_shape);
  OK(mfa_call_set_tensor(call, "x", &odd));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR,
         "x's last axis must be a positive multiple of group_size (32) for q8_0, got shape (3, 48)",
         "a last axis of 48");
  mfa_call_free(call);
  float* buffers[] = {parts[0], parts[1], lses[0], lses[1], out, lse, ref_out, ref_lse, x};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) free(buffers[i]);
  free(data);
  free(ref_data);
}

/* The block-sparse family: per-head partial and full lists in blocks of 8 queries and 4 keys,
 * lower-right causal inside partial blocks, GQA: the C ABI's out, lse and gradients are the C++
 * API's; a list naming a block past the keys is refused with Python's message, before anything
 * is written. */
static void block_sparse(const char* path, const mfa_device* device, const mfa_bundle* bundle) {
  enum { B = 1, HQ = 4, HKV = 2, R = 20, C = 18, D = 16, QB = 8, KB = 4, NQ = 3, NK = 5 };
  const int64_t q_shape[] = {B, HQ, R, D}, k_shape[] = {B, HKV, C, D}, rows_shape[] = {B, HQ, R};
  const int64_t counts_shape[] = {B, HQ, NQ}, indices_shape[] = {B, HQ, NQ, NK};
  const size_t nq = B * HQ * R * D, nk = B * HKV * C * D, nrows = B * HQ * R;
  float *q = random_floats(nq), *k = random_floats(nk), *v = random_floats(nk), *dout = random_floats(nq);
  float* got[5] = {poisoned(nq), poisoned(nrows), poisoned(nq), poisoned(nk), poisoned(nk)};
  float* ref[5] = {reference_poisoned(nq), reference_poisoned(nrows), reference_poisoned(nq), reference_poisoned(nk),
                   reference_poisoned(nk)};
  int32_t counts[2][B * HQ * NQ] = {{0}}, indices[2][B * HQ * NQ * NK];
  memset(indices, 0xff, sizeof indices); /* -1 past each count: never read */
  for (int row = 0; row < B * HQ * NQ; ++row)
    for (int j = 0; j < NK; ++j) { /* each key block partial, full or left out */
      const float draw = uniform();
      if (draw < 0.3f) {
        const int kind = draw < -0.3f ? 0 : 1;
        indices[kind][row * NK + counts[kind][row]++] = j;
      }
    }
  mfa_tensor_view lists[4];
  for (int kind = 0; kind < 2; ++kind) {
    const mfa_tensor_view num = {counts[kind], MFA_INT32, 3, counts_shape, NULL};
    const mfa_tensor_view listed = {indices[kind], MFA_INT32, 4, indices_shape, NULL};
    lists[2 * kind] = num, lists[2 * kind + 1] = listed;
  }
  const char* list_names[] = {"kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"};
  mfa_tensor_view vq = view(q, 4, q_shape), vk = view(k, 4, k_shape), vv = view(v, 4, k_shape);
  mfa_tensor_view vdout = view(dout, 4, q_shape);
  mfa_tensor_view vgot[5] = {view(got[0], 4, q_shape), view(got[1], 3, rows_shape), view(got[2], 4, q_shape),
                             view(got[3], 4, k_shape), view(got[4], 4, k_shape)};
  mfa_tensor_view vref[5] = {view(ref[0], 4, q_shape), view(ref[1], 3, rows_shape), view(ref[2], 4, q_shape),
                             view(ref[3], 4, k_shape), view(ref[4], 4, k_shape)};
  mfa_call *call = NULL, *backward = NULL;
  OK(mfa_call_new(bundle, "block_sparse_attention", &call));
  OK(mfa_call_new(bundle, "block_sparse_attention_backward", &backward));
  mfa_call* both[] = {call, backward};
  for (int i = 0; i < 2; ++i) {
    OK(mfa_call_set_tensor(both[i], "q", &vq));
    OK(mfa_call_set_tensor(both[i], "k", &vk));
    OK(mfa_call_set_tensor(both[i], "v", &vv));
    for (int n = 0; n < 4; ++n) OK(mfa_call_set_tensor(both[i], list_names[n], &lists[n]));
    OK(mfa_call_set_string(both[i], "causal", "lower_right"));
  }
  OK(mfa_call_set_int_pair(backward, "block_size", QB, KB));
  OK(mfa_call_set_tensor(call, "out", &vgot[0]));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR,
         "kv_num_blocks has shape (1, 4, 3), but its last axis must be ceil(R / Q_BLOCK) = 1",
         "the default block size (128), which the lists do not fit");
  CHECK(all_nan(got[0], nq) && all_nan(got[1], nrows), "a refused block-sparse call wrote its outputs");
  OK(mfa_call_set_int_pair(call, "block_size", QB, KB));
  OK(mfa_call_set_tensor(call, "lse", &vgot[1]));
  const char* backward_names[] = {"o", "lse", "do", "dq", "dk", "dv"};
  const mfa_tensor_view* backward_views[] = {&vgot[0], &vgot[1], &vdout, &vgot[2], &vgot[3], &vgot[4]};
  for (int i = 0; i < 6; ++i) OK(mfa_call_set_tensor(backward, backward_names[i], backward_views[i]));
  indices[0][0] = NK + 4; /* a block past the keys, counted when row 0 has a partial block */
  counts[0][0] = counts[0][0] ? counts[0][0] : 1;
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR,
         "kv_indices lists block 9 in its counted part (row 0, entry 0), outside 0..4", "a list entry out of range");
  CHECK(all_nan(got[0], nq) && all_nan(got[1], nrows), "a refused block-sparse call wrote its outputs");
  OK(mfa_call_set_none(call, "kv_indices"));
  expect(mfa_call_run(call, device), MFA_TYPE_ERROR,
         "block_sparse_attention() missing 1 required argument: 'kv_indices'", "a missing list");
  CHECK(all_nan(got[0], nq) && all_nan(got[1], nrows), "a refused block-sparse call wrote its outputs");
  OK(mfa_call_set_tensor(call, "kv_indices", &lists[1]));
  indices[0][0] = 0;
  OK(mfa_call_run(call, device));
  OK(mfa_call_run(backward, device));
  char error[4096] = "";
  CHECK(cpp_block_sparse(path, lists, QB, KB, &vq, &vk, &vv, &vdout, &vref[0], &vref[1], &vref[2], &vref[3],
                         &vref[4], error, sizeof error) == 0, "%s", error);
  const size_t sizes[5] = {nq, nrows, nq, nk, nk};
  const char* outputs[5] = {"out", "lse", "dq", "dk", "dv"};
  for (int i = 0; i < 5; ++i) {
    CHECK(any_nonzero(got[i], sizes[i]), "block-sparse %s: nothing written", outputs[i]);
    CHECK(memcmp(got[i], ref[i], sizes[i] * sizeof(float)) == 0, "block-sparse %s differs from the C++ API's",
          outputs[i]);
    free(got[i]), free(ref[i]);
  }
  mfa_call_free(call);
  mfa_call_free(backward);
  float* buffers[] = {q, k, v, dout};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) free(buffers[i]);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s BUNDLE\n", argv[0]);
    return 2;
  }
  /* B, Hq, Hkv, R, C, D: grouped-query heads, lower-right causal, a window, sinks, scale given. */
  const struct { int64_t B, Hq, Hkv, R, C, D; double scale; int64_t window_left, window_right; } p = {
      2, 4, 2, 19, 27, 16, 0.25, 7, -1};
  const size_t nq = (size_t)(p.B * p.Hq * p.R * p.D), nk = (size_t)(p.B * p.Hkv * p.C * p.D);
  const size_t nrows = (size_t)(p.B * p.Hq * p.R), nh = (size_t)p.Hq;
  const int64_t q_shape[] = {p.B, p.Hq, p.R, p.D}, k_shape[] = {p.B, p.Hkv, p.C, p.D};
  const int64_t rows_shape[] = {p.B, p.Hq, p.R}, heads_shape[] = {p.Hq};
  float *q = random_floats(nq), *k = random_floats(nk), *v = random_floats(nk), *sinks = random_floats(nh);
  float* dout = random_floats(nq);

  mfa_device* device = NULL;
  mfa_bundle* bundle = NULL;
  OK(mfa_device_default(&device));
  OK(mfa_bundle_load(argv[1], &bundle));
  if (!device || !bundle) return 1;
  printf("C ABI on %s, bundle of %zu entries: %s\n", mfa_device_name(device), mfa_bundle_entry_count(bundle),
         mfa_bundle_entry(bundle, 0));

  /* Forward: the C ABI by names, then the C++ API on the same inputs. */
  float *out = poisoned(nq), *lse = poisoned(nrows);
  float *cpp_out = reference_poisoned(nq), *cpp_lse = reference_poisoned(nrows);
  mfa_tensor_view vq = view(q, 4, q_shape), vk = view(k, 4, k_shape), vv = view(v, 4, k_shape);
  mfa_tensor_view vsinks = view(sinks, 1, heads_shape), vout = view(out, 4, q_shape), vlse = view(lse, 3, rows_shape);
  mfa_call* call = NULL;
  OK(mfa_call_new(bundle, "attention", &call));
  OK(mfa_call_set_tensor(call, "q", &vq));
  OK(mfa_call_set_tensor(call, "k", &vk));
  OK(mfa_call_set_tensor(call, "v", &vv));
  OK(mfa_call_set_tensor(call, "out", &vout));
  OK(mfa_call_set_tensor(call, "lse", &vlse));
  OK(mfa_call_set_tensor(call, "sinks", &vsinks));
  OK(mfa_call_set_float(call, "scale", p.scale));
  OK(mfa_call_set_bool(call, "causal", 1)); /* Python's causal=True: lower_right */
  OK(mfa_call_set_int_pair(call, "window", p.window_left, p.window_right));
  OK(mfa_call_set_string(call, "layout", "bhsd"));
  OK(mfa_call_run(call, device));
  char error[4096] = "";
  const reference_options options = {1, p.scale, "lower_right", 1, p.window_left, p.window_right, NULL, &vsinks,
                                     "bhsd", 0, 0.0, NULL};
  mfa_tensor_view vcpp_out = view(cpp_out, 4, q_shape), vcpp_lse = view(cpp_lse, 3, rows_shape);
  CHECK(cpp_attention(argv[1], &options, &vq, &vk, &vv, &vcpp_out, &vcpp_lse, error, sizeof error) == 0, "%s", error);
  CHECK(any_nonzero(out, nq) && any_nonzero(lse, nrows), "the C ABI wrote nothing");
  CHECK(memcmp(out, cpp_out, nq * sizeof *out) == 0, "out differs from the C++ API's");
  CHECK(memcmp(lse, cpp_lse, nrows * sizeof *lse) == 0, "lse differs from the C++ API's");
  /* causal by Python's string: the same call, the same bits. */
  float* again = poisoned(nq);
  mfa_tensor_view vagain = view(again, 4, q_shape);
  OK(mfa_call_set_string(call, "causal", "lower_right"));
  OK(mfa_call_set_tensor(call, "out", &vagain));
  OK(mfa_call_run(call, device));
  CHECK(memcmp(again, out, nq * sizeof *out) == 0, "causal='lower_right' differs from causal=True");
  OK(mfa_call_set_tensor(call, "out", &vout));

  /* Backward. */
  float *dq = poisoned(nq), *dk = poisoned(nk), *dv = poisoned(nk), *dsinks = poisoned(nh);
  float *cpp_dq = reference_poisoned(nq), *cpp_dk = reference_poisoned(nk), *cpp_dv = reference_poisoned(nk);
  float* cpp_dsinks = reference_poisoned(nh);
  mfa_tensor_view vdout = view(dout, 4, q_shape), vdq = view(dq, 4, q_shape), vdk = view(dk, 4, k_shape);
  mfa_tensor_view vdv = view(dv, 4, k_shape), vdsinks = view(dsinks, 1, heads_shape);
  mfa_call* backward = NULL;
  OK(mfa_call_new(bundle, "attention_backward", &backward));
  const char* names[] = {"q", "k", "v", "o", "lse", "do", "dq", "dk", "dv", "sinks", "dsinks"};
  const mfa_tensor_view* views[] = {&vq, &vk, &vv, &vout, &vlse, &vdout, &vdq, &vdk, &vdv, &vsinks, &vdsinks};
  for (size_t i = 0; i < sizeof names / sizeof *names; ++i) OK(mfa_call_set_tensor(backward, names[i], views[i]));
  OK(mfa_call_set_float(backward, "scale", p.scale));
  OK(mfa_call_set_string(backward, "causal", "lower_right"));
  OK(mfa_call_set_int_pair(backward, "window", p.window_left, p.window_right));
  OK(mfa_call_run(backward, device));
  mfa_tensor_view vcpp_dq = view(cpp_dq, 4, q_shape), vcpp_dk = view(cpp_dk, 4, k_shape);
  mfa_tensor_view vcpp_dv = view(cpp_dv, 4, k_shape), vcpp_dsinks = view(cpp_dsinks, 1, heads_shape);
  CHECK(cpp_attention_backward(argv[1], &options, &vq, &vk, &vv, &vout, &vlse, &vdout, &vcpp_dq, &vcpp_dk, &vcpp_dv,
                               &vcpp_dsinks, error, sizeof error) == 0, "%s", error);
  CHECK(any_nonzero(dq, nq) && any_nonzero(dk, nk) && any_nonzero(dv, nk) && any_nonzero(dsinks, nh),
        "the C ABI's backward wrote nothing");
  CHECK(memcmp(dq, cpp_dq, nq * sizeof *dq) == 0, "dq differs from the C++ API's");
  CHECK(memcmp(dk, cpp_dk, nk * sizeof *dk) == 0, "dk differs from the C++ API's");
  CHECK(memcmp(dv, cpp_dv, nk * sizeof *dv) == 0, "dv differs from the C++ API's");
  CHECK(memcmp(dsinks, cpp_dsinks, nh * sizeof *dsinks) == 0, "dsinks differs from the C++ API's");
  masked_bshd(argv[1], device, bundle);
  paged_decode(argv[1], device, bundle);
  float8_decode(argv[1], device, bundle);
  indexed(argv[1], device, bundle);
  int8_call(argv[1], device, bundle);
  merge_and_quantize(argv[1], device, bundle);
  packed_varlen(argv[1], device, bundle);
  block_sparse(argv[1], device, bundle);
  if (!failures)
    printf("attention (+ backward), attention_with_kvcache, sparse_topk, sparse_attention, int8_attention, "
           "merge_attention, quantize, attention_varlen and block_sparse_attention (+ backwards) through the C ABI: "
           "the C++ API's bits\n");

  /* Bad calls: the code and Python's message, and the poisoned outputs untouched. */
  float *fresh = poisoned(nq), *fresh_rows = poisoned(nrows), *fresh_dq = poisoned(nq);
  float *untouched = poisoned(nq), *untouched_rows = poisoned(nrows), *untouched_dq = poisoned(nq);
  mfa_tensor_view vfresh = view(fresh, 4, q_shape), vfresh_rows = view(fresh_rows, 3, rows_shape);
  mfa_tensor_view vfresh_dq = view(fresh_dq, 4, q_shape);
  OK(mfa_call_set_tensor(call, "out", &vfresh));
  OK(mfa_call_set_tensor(call, "lse", &vfresh_rows));
  OK(mfa_call_set_tensor(backward, "dq", &vfresh_dq));

  mfa_tensor_view half_k = vk;
  half_k.dtype = MFA_FLOAT16;
  OK(mfa_call_set_tensor(call, "k", &half_k));
  expect(mfa_call_run(call, device), MFA_TYPE_ERROR, "k has dtype float16 but q has float32", "a wrong dtype");
  OK(mfa_call_set_tensor(call, "k", &vk));

  const int64_t short_shape[] = {p.B, p.Hq, p.R - 1, p.D};
  mfa_tensor_view short_out = view(fresh, 4, short_shape);
  OK(mfa_call_set_tensor(call, "out", &short_out));
  expect(mfa_call_run(call, device), MFA_ARGUMENT_ERROR, "out must have shape", "a wrong shape");
  OK(mfa_call_set_tensor(call, "out", &vfresh));

  expect(mfa_call_set_float(call, "scal", 0.5), MFA_TYPE_ERROR,
         "attention() got an unexpected keyword argument 'scal'", "an unknown argument");
  expect(mfa_call_set_tensor(backward, "out", &vfresh), MFA_TYPE_ERROR,
         "attention_backward() got an unexpected keyword argument 'out'", "attention's argument in the backward");
  expect(mfa_call_set_int(call, "scale", 1), MFA_TYPE_ERROR,
         "attention's scale is set with mfa_call_set_float, not mfa_call_set_int", "the wrong setter");
  expect(mfa_call_set_tensors(call, "q", &vq, 1), MFA_TYPE_ERROR,
         "attention's q is set with mfa_call_set_tensor, not mfa_call_set_tensors", "a list for a tensor");
  expect(mfa_call_set_string(call, "causal", NULL), MFA_ARGUMENT_ERROR, "value is NULL", "a NULL string");
  expect(mfa_call_set_string(call, "deterministic", "sometimes"), MFA_ARGUMENT_ERROR,
         "deterministic must be False, True, 'run_to_run' or 'batch_invariant', got 'sometimes'",
         "a deterministic mode Python lacks");
  expect(mfa_call_set_bool(backward, "deterministic", 1), MFA_TYPE_ERROR,
         "attention_backward() got an unexpected keyword argument 'deterministic'", "deterministic in the backward");
  expect(mfa_call_set_float(NULL, "scale", 1.0), MFA_ARGUMENT_ERROR, "call is NULL", "a NULL call");
  mfa_tensor_view odd = vq;
  odd.dtype = (mfa_dtype)42;
  expect(mfa_call_set_tensor(call, "q", &odd), MFA_TYPE_ERROR, "q has dtype 42, which is no mfa_dtype",
         "a dtype outside mfa_dtype");
  expect(mfa_call_set_string(call, "causal", "yes"), MFA_ARGUMENT_ERROR,
         "causal must be False, True, 'lower_right' or 'upper_left' (or 'none'), got 'yes'", "a bad causal");
  expect(mfa_call_set_string(call, "layout", "sbhd"), MFA_ARGUMENT_ERROR, "layout must be 'bhsd' or 'bshd', got 'sbhd'",
         "a bad layout");
  mfa_call* unknown = NULL;
  expect(mfa_call_new(bundle, "attention_forward", &unknown), MFA_ARGUMENT_ERROR,
         "no op named 'attention_forward'; the C ABI runs attention, attention_backward", "an unknown op");
  CHECK(unknown == NULL, "a refused call was handed out");

  OK(mfa_call_set_string(call, "causal", "upper_left"));
  expect(mfa_call_run(call, device), MFA_NO_BUNDLE_ENTRY_ERROR,
         "the bundle holds no entry for attention float32 D=16 Dv=16 gqa=2 causal=upper_left", "a missing entry");
  CHECK(strstr(mfa_last_error(), mfa_bundle_entry(bundle, 0)) != NULL, "the message lists the bundle's entries");
  OK(mfa_call_set_none(call, "causal")); /* the default: no causal mask, which the bundle lacks too */
  expect(mfa_call_run(call, device), MFA_NO_BUNDLE_ENTRY_ERROR, "causal=none", "the default causal");
  OK(mfa_call_set_bool(call, "causal", 1));

  OK(mfa_call_set_none(call, "out"));
  expect(mfa_call_run(call, device), MFA_TYPE_ERROR, "attention() missing 1 required argument: 'out'",
         "a missing output");
  OK(mfa_call_set_tensor(call, "out", &vfresh));
  mfa_call* bare = NULL;
  OK(mfa_call_new(bundle, "attention_backward", &bare));
  OK(mfa_call_set_tensor(bare, "k", &vk));
  expect(mfa_call_run(bare, device), MFA_TYPE_ERROR,
         "attention_backward() missing 8 required arguments: 'q', 'v', 'o', 'lse', 'do', 'dq', 'dk', and 'dv'",
         "missing arguments");
  mfa_call_free(bare);

  mfa_tensor_view half_dv = vdv;
  half_dv.dtype = MFA_FLOAT16;
  OK(mfa_call_set_tensor(backward, "dv", &half_dv));
  expect(mfa_call_run(backward, device), MFA_TYPE_ERROR, "dv has dtype float16 but must be float32",
         "a backward output's dtype");
  OK(mfa_call_set_tensor(backward, "dv", &vdv));

  mfa_event* event = NULL;
#ifndef __APPLE__
  expect(mfa_call_encode_metal(call, device, NULL, &event), MFA_UNAVAILABLE_ERROR, "this build has no Metal backend",
         "Metal's entry point without Metal");
  CHECK(event == NULL && !mfa_event_ready(event), "a refused encoding handed out an event");
#endif
  OK(mfa_call_set_none(call, "q"));
  expect(mfa_call_encode_metal(call, device, NULL, &event), MFA_TYPE_ERROR,
         "attention() missing 1 required argument: 'q'", "a missing argument, encoding");
  OK(mfa_call_set_tensor(call, "q", &vq));

  mfa_bundle* broken = NULL;
  expect(mfa_bundle_from_memory("not a bundle", 12, &broken), MFA_BUNDLE_ERROR, "", "a damaged bundle");
  expect(mfa_bundle_load("/nonexistent/attention.mfab", &broken), MFA_BUNDLE_ERROR,
         "cannot open bundle '/nonexistent/attention.mfab'", "a missing file");
  CHECK(broken == NULL, "a refused bundle was handed out");

  CHECK(memcmp(fresh, untouched, nq * sizeof *fresh) == 0, "a refused call wrote out");
  CHECK(memcmp(fresh_rows, untouched_rows, nrows * sizeof *fresh_rows) == 0, "a refused call wrote lse");
  CHECK(memcmp(fresh_dq, untouched_dq, nq * sizeof *fresh_dq) == 0, "a refused call wrote dq");

  /* The arguments fixed, the same call runs and writes. */
  OK(mfa_call_run(call, device));
  CHECK(memcmp(fresh, out, nq * sizeof *out) == 0, "the corrected call differs");
  if (!failures) printf("bad calls: the right codes and messages, nothing written\n");

  mfa_call_free(backward);
  mfa_call_free(call);
  mfa_bundle_free(bundle);
  mfa_device_free(device);
  float* buffers[] = {q, k, v, sinks, dout, out, lse, cpp_out, cpp_lse, again, dq, dk, dv, dsinks, cpp_dq, cpp_dk,
                      cpp_dv, cpp_dsinks, fresh, fresh_rows, fresh_dq, untouched, untouched_rows, untouched_dq};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; ++i) free(buffers[i]);
  printf("%s\n", failures ? "FAILED" : "passed");
  return failures ? 1 : 0;
}
