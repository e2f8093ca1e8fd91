/* mfa_native's C ABI (C99): what C, Swift, Rust and Zig programs link. It runs
 * the ops of a bundle file (`python -m mfa_native bundle -o FILE --spec SPEC.json`)
 * on caller memory, as include/mfa/attention.hpp does for C++, and nothing C++
 * crosses it: handles are opaque, tensors are plain structs, errors are codes.
 *
 *   mfa_device* device;  mfa_bundle* bundle;  mfa_call* call;
 *   mfa_device_default(&device);
 *   mfa_bundle_load("attention.mfab", &bundle);
 *   mfa_call_new(bundle, "attention", &call);
 *   mfa_call_set_tensor(call, "q", &q);   ... "k", "v", "out", optionally "lse"
 *   mfa_call_set_string(call, "causal", "lower_right");
 *   if (mfa_call_run(call, device) != MFA_OK) fprintf(stderr, "%s\n", mfa_last_error());
 *   mfa_call_free(call);  mfa_bundle_free(bundle);  mfa_device_free(device);
 *
 * A call is an op by name ("attention", "attention_backward",
 * "attention_with_kvcache", "sparse_attention", "sparse_attention_backward",
 * "sparse_topk", "int8_attention", "merge_attention", "quantize", "attention_varlen",
 * "attention_varlen_backward", "block_sparse_attention", "block_sparse_attention_backward")
 * and its arguments set by name, with Python's names and
 * values (mfa_native.attention's q, k, v, mask, sinks, scale, causal, window, layout,
 * softcap, alibi_slopes, score_mod and score_mod_tensors (a score_mod's text);
 * attention_backward's o, lse, do and outputs dq, dk, dv, dsinks; attention's
 * outputs out and lse; attention_with_kvcache's q, k_cache, v_cache (tensors, or
 * quantized: mfa_call_set_quantized, mfa_call_set_quantized_affine; float8:
 * MFA_FLOAT8_E4M3FN or MFA_FLOAT8_E5M2 tensors), cache_seqlens, k, v, block_table,
 * rotary_cos, rotary_sin, rotary_seqlens, rotary_interleaved, q_descale, k_descale,
 * v_descale (a float8 cache's factors), scale, causal, window,
 * sinks, softcap, alibi_slopes, out and lse, its k and v appended to the caches in
 * place; the sparse ops' arguments as include/mfa/sparse.hpp names them, topk set
 * with mfa_call_set_int; "int8_attention"'s attention's arguments but score_mod, and
 * qk_scale, smooth_k and pv (include/mfa/int8.hpp); "merge_attention"'s outputs and lses
 * (mfa_call_set_tensors), layout, out and lse; "quantize"'s x, format, bits, group_size and
 * outputs data, scales, biases (GGUF blocks MFA_UINT8, affine data MFA_UINT32); these three
 * with mfa_call_run only); attention_varlen's q, k, v, cu_seqlens_q, cu_seqlens_k,
 * max_seqlen_q, max_seqlen_k (mfa_call_set_int), scale, causal, window, sinks, softcap,
 * alibi_slopes, score_mod, score_mod_tensors, block_table, seqused_k, out (total_q, Hq,
 * Dv) and lse (Hq, total_q), attention_varlen_backward's the same inputs with o, lse, do
 * and outputs dq, dk, dv, dsinks; block_sparse_attention's (+ _backward's) attention's
 * arguments with its block mask's parts by the names its torch schema gives them:
 * kv_num_blocks, kv_indices (required), full_kv_num_blocks, full_kv_indices, q_num_blocks,
 * q_indices, full_q_num_blocks, full_q_indices, kv_bit_blocks, kv_bits (int32 tensors),
 * block_size (mfa_call_set_int or _set_int_pair; default 128) and seq_lengths (an int pair),
 * causal not set meaning False (include/mfa/block_sparse.hpp). New ops and arguments
 * need no new functions here. Giving attention's lse is Python's
 * return_lse=True. Semantics, shapes, layouts and error messages are Python's,
 * the rules for views (strides read in place, outputs contiguous) and bundle
 * entries include/mfa/attention.hpp's; on the cpu backend the results are
 * bit-identical to the C++ API's (the same code runs) and so to Python's.
 *
 * Errors: every function that can fail returns an mfa_status; on anything but
 * MFA_OK, mfa_last_error() holds the message (Python's, naming the argument at
 * fault) and no handle was written. A call is checked completely (dtypes, shapes,
 * options, the bundle entry) before anything runs: a refused call writes none of
 * its outputs. (Only a failure while running, MFA_DISPATCH_ERROR, comes after.)
 *
 * Running: mfa_call_run runs a call to completion on a device; on Apple GPUs
 * mfa_call_encode_metal encodes it into the caller's command buffer instead.
 *
 * Thread safety: devices and bundles may be used from several threads at once;
 * a call handle by one thread at a time. mfa_last_error is per thread.
 *
 * Linking: the library is C++ (libmfa_core.a): link with a C++ linker, or add
 * the C++ runtime. CMake: find_package(mfa_native CONFIG REQUIRED), a project
 * with LANGUAGES C CXX, and target_link_libraries(app PRIVATE mfa_native::core).
 */
#ifndef MFA_MFA_H
#define MFA_MFA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What went wrong; the classes of include/mfa/errors.hpp (and Python's exceptions). */
typedef enum mfa_status {
  MFA_OK = 0,
  MFA_ERROR = 1,                  /* an mfa error of no class below */
  MFA_ARGUMENT_ERROR = 2,         /* a bad value (Python: ValueError) */
  MFA_TYPE_ERROR = 3,             /* a wrong type or dtype, an unknown argument name, a wrong
                                     setter for an argument, a missing argument (Python: TypeError) */
  MFA_UNAVAILABLE_ERROR = 4,      /* a device kind this machine lacks; Metal entry points
                                     in a build without Metal */
  MFA_COMPILE_ERROR = 5,          /* kernel source failed to compile */
  MFA_DISPATCH_ERROR = 6,         /* a dispatch failed while running */
  MFA_BUNDLE_ERROR = 7,           /* a damaged, truncated or future-version bundle */
  MFA_NO_BUNDLE_ENTRY_ERROR = 8,  /* the bundle holds no entry for the call's problem */
  MFA_OUT_OF_MEMORY = 9,
  MFA_INTERNAL_ERROR = 10,        /* anything else: a bug */
  MFA_NOT_IMPLEMENTED_ERROR = 11  /* valid arguments the op does not compute, as a backward of
                                     a forward-only argument (Python: NotImplementedError) */
} mfa_status;

/* The message of the last call on this thread that did not return MFA_OK ("" if
 * none): valid until this thread's next failing call. */
const char* mfa_last_error(void);
/* "MFA_OK", "MFA_ARGUMENT_ERROR", ...; "" for a value that is no status. */
const char* mfa_status_name(mfa_status status);

/* Element types: as include/mfa/attention.hpp's DType. MFA_BOOL: one byte, 0 or 1;
 * MFA_UINT8: bytes (a quantized tensor's blocks); MFA_UINT32: words (affine quantized data);
 * MFA_FLOAT8_E4M3FN, MFA_FLOAT8_E5M2: one byte a value (a float8 KV cache). */
typedef enum mfa_dtype {
  MFA_FLOAT32 = 0,
  MFA_FLOAT16 = 1,
  MFA_BFLOAT16 = 2,
  MFA_BOOL = 3,
  MFA_INT32 = 4,
  MFA_UINT8 = 5,
  MFA_UINT32 = 6,
  MFA_FLOAT8_E4M3FN = 7,
  MFA_FLOAT8_E5M2 = 8
} mfa_dtype;

/* A tensor in caller memory. shape and strides (in elements; NULL: contiguous
 * row-major) are copied when the view is set; data must stay valid, and
 * unchanged for inputs, until the call has run. */
typedef struct mfa_tensor_view {
  void* data;
  mfa_dtype dtype;
  int32_t ndim;
  const int64_t* shape;
  const int64_t* strides;
} mfa_tensor_view;

/* Devices: "cpu" or "metal". default: MFA_NATIVE_DEVICE when set, else metal
 * where available, else cpu. A handle is a reference to the process-wide device. */
typedef struct mfa_device mfa_device;
mfa_status mfa_device_default(mfa_device** device);
mfa_status mfa_device_get(const char* kind, mfa_device** device);
/* The device's name, owned by the handle. */
const char* mfa_device_name(const mfa_device* device);
void mfa_device_free(mfa_device* device);

/* Bundles: read and checked (version, length, sha256) at load time; immutable. */
typedef struct mfa_bundle mfa_bundle;
mfa_status mfa_bundle_load(const char* path, mfa_bundle** bundle);
mfa_status mfa_bundle_from_memory(const void* data, size_t size, mfa_bundle** bundle);
/* One line per entry, as `python -m mfa_native bundle --list` prints; owned by the bundle. */
size_t mfa_bundle_entry_count(const mfa_bundle* bundle);
const char* mfa_bundle_entry(const mfa_bundle* bundle, size_t index); /* NULL past the end */
void mfa_bundle_free(mfa_bundle* bundle);

/* Calls: an op of a bundle by name, its arguments set by name. The call keeps
 * the bundle alive (mfa_bundle_free may come first). Setting an argument again
 * replaces it; mfa_call_set_none restores its default (Python's None). Each
 * setter checks the name (MFA_TYPE_ERROR naming an unknown argument, or the
 * setter an argument takes) and the value's form; mfa_call_run checks the rest
 * (dtypes, shapes, the bundle entry) before anything is written, runs the op on
 * `device` and waits. A call may run again, with arguments changed or not. */
typedef struct mfa_call mfa_call;
mfa_status mfa_call_new(const mfa_bundle* bundle, const char* op, mfa_call** call);
mfa_status mfa_call_set_tensor(mfa_call* call, const char* name, const mfa_tensor_view* view);
/* A list of tensors (Python: a sequence of arrays). */
mfa_status mfa_call_set_tensors(mfa_call* call, const char* name, const mfa_tensor_view* views, size_t count);
mfa_status mfa_call_set_float(mfa_call* call, const char* name, double value);
mfa_status mfa_call_set_int(mfa_call* call, const char* name, int64_t value);
mfa_status mfa_call_set_bool(mfa_call* call, const char* name, bool value);
mfa_status mfa_call_set_string(mfa_call* call, const char* name, const char* value);
/* A pair of ints, e.g. window (left, right), -1 unbounded. */
mfa_status mfa_call_set_int_pair(mfa_call* call, const char* name, int64_t first, int64_t second);
/* A quantized tensor (Python: a QuantizedTensor), e.g. attention_with_kvcache's k_cache:
 * GGUF's `format` ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1") and its MFA_UINT8 blocks
 * `data`, shape[:-1] + (bytes per row,) (include/mfa/kvcache.hpp's QuantizedTensor); its
 * logical dtype is q's. */
mfa_status mfa_call_set_quantized(mfa_call* call, const char* name, const char* format, const mfa_tensor_view* data);
/* An MLX affine quantized tensor (Python: QuantizedTensor(data, scales, biases, format="affine",
 * bits=, group_size=)): MFA_UINT32 words `data`, shape[:-1] + (D * bits / 32,), and `scales`,
 * `biases` shape[:-1] + (D / group_size,) of q's dtype; bits 2, 3, 4, 5, 6 or 8, group_size 32,
 * 64 or 128. */
mfa_status mfa_call_set_quantized_affine(mfa_call* call, const char* name, const mfa_tensor_view* data,
                                         const mfa_tensor_view* scales, const mfa_tensor_view* biases, int64_t bits,
                                         int64_t group_size);
mfa_status mfa_call_set_none(mfa_call* call, const char* name);
mfa_status mfa_call_run(mfa_call* call, const mfa_device* device);
void mfa_call_free(mfa_call* call);

/* Metal: the call encoded into the caller's command buffer (an app's own queue, a
 * PyTorch MPS or MLX stream), as mfa::metal::attention does it (include/mfa/metal.hpp,
 * docs/metal.md): `command_buffer` is an id<MTLCommandBuffer> of the metal device's GPU
 * (passed as (__bridge void*)), not committed, with no encoder open; the op gets one
 * compute encoder of its own and runs when the caller commits. *done (free it with
 * mfa_event_free) becomes ready once the command buffer completed and the outputs mfa
 * staged were copied back; every view stays alive, inputs unchanged and outputs untouched,
 * until then. The call's checks come first, as in mfa_call_run. Builds without the Metal
 * backend (all but macOS) return MFA_UNAVAILABLE_ERROR. */
typedef struct mfa_event mfa_event;
mfa_status mfa_call_encode_metal(mfa_call* call, const mfa_device* device, void* command_buffer, mfa_event** done);
/* Blocks until the event is ready: MFA_OK, or MFA_DISPATCH_ERROR if the command buffer failed
 * (a command buffer never committed never completes: commit it first). */
mfa_status mfa_event_wait(mfa_event* event);
bool mfa_event_ready(const mfa_event* event);
void mfa_event_free(mfa_event* event);

#ifdef __cplusplus
}
#endif

#endif /* MFA_MFA_H */
