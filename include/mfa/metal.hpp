// The Metal-specific part of the embedder API: run mfa's dispatches, or a
// bundle's attention pass, inside a command buffer the caller owns (a PyTorch
// MPS or MLX stream, an app's own queue), and use Metal buffers made by others
// with no copy.
//
// Only builds with the Metal backend (macOS; MFA_HAVE_METAL is defined on the
// mfa_core target) provide these functions. This header is plain C++:
// Objective-C objects cross it as void*, passed with `(__bridge void*)object`.
// Ownership never moves: mfa retains what it needs for as long as it needs it.
// Objective-C++ callers also get overloads taking id<MTLCommandBuffer> and
// id<MTLBuffer> directly. docs/metal.md has the synchronization rules.
#pragma once

#include <cstddef>
#include <future>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfa/attention.hpp"
#include "mfa/backend.hpp"
#include "mfa/block_sparse.hpp"
#include "mfa/buffer.hpp"
#include "mfa/device.hpp"
#include "mfa/int8.hpp"
#include "mfa/kvcache.hpp"
#include "mfa/merge.hpp"
#include "mfa/quantize.hpp"
#include "mfa/sparse.hpp"
#include "mfa/varlen.hpp"

namespace mfa::metal {

// Encodes `dispatches` into `command_buffer`, an id<MTLCommandBuffer> of
// `device`'s GPU that is not committed yet and has no encoder open. They get
// one compute encoder of their own, run in order (a buffer barrier before
// each dispatch that touches memory an earlier one of them wrote, or writes
// memory it read), and run when the caller commits the command buffer, after the
// encoders the caller encoded before. Their buffers and pipelines stay
// alive until the command buffer completes; errors surface in the caller's
// command buffer. Each dispatch is used as given: build them as CommandBatch
// would (every [[buffer(i)]] bound, threads within the pipeline's limit).
// Throws ArgumentError (not the metal device, a committed command buffer, a
// pipeline or buffer of another device) or TypeError (not a command buffer)
// before encoding anything.
void encode(const Device& device, std::vector<Dispatch> dispatches, void* command_buffer);

// A Buffer over `bytes` bytes from `byte_offset` of `mtl_buffer`, an
// id<MTLBuffer> of `device`'s GPU, with no copy: for a kDLMetal DLPack tensor
// pass DLTensor::data and DLTensor::byte_offset. Bind it with
// CommandBatch::DispatchRef::buffer(). Never pass a framework's data_ptr():
// for GPU tensors it is an opaque handle, not memory. The Buffer retains the
// MTLBuffer, but the framework may reuse that memory for another tensor once
// its own tensor is gone: keep the tensor alive until the work is done.
// Throws ArgumentError (null, out of range, another device) or TypeError
// (not an MTLBuffer).
Buffer wrap_buffer(const Device& device, void* mtl_buffer, std::size_t byte_offset, std::size_t bytes);

// mfa::attention / attention_backward (include/mfa/attention.hpp),
// attention_with_kvcache (include/mfa/kvcache.hpp; the caches it appends to are
// outputs here: written in place, or staged and copied back), sparse_attention,
// its backward and sparse_topk (include/mfa/sparse.hpp), block_sparse_attention
// and its backward (include/mfa/block_sparse.hpp), int8_attention,
// merge_attention, quantize, attention_varlen and its backward (include/mfa/varlen.hpp;
// the unit tables built from cu_seqlens at this call) with the same checks, entry and pass, encoded into `command_buffer`, an id<MTLCommandBuffer>
// of `device`'s GPU that is not committed yet and has no encoder open, without
// committing it: the pass gets one compute encoder of its own, after the
// encoders the caller encoded before, and runs when the caller commits.
//
// Caller memory: each view's data is host memory (unified on Apple GPUs).
// Page-aligned views are bound in place, with no copy; the others are staged
// through pool buffers: staged inputs are copied in during this call (as are
// inputs the kernels cannot address in place, packed as mfa::attention packs
// them), staged outputs are copied back by a completed handler this call adds
// to the command buffer. So:
//   - Results are visible once the returned future is ready: after the command
//     buffer completed and every staged output was copied back. (The command
//     buffer's completion alone, e.g. waitUntilCompleted returning, does not
//     promise that the completed handlers ran.) If the command buffer failed,
//     the future holds a DispatchError and staged outputs are left as they were.
//   - Lifetime: every view's memory stays alive, inputs unchanged and outputs
//     untouched by the caller, from this call until the future is ready. The
//     bundle need not outlive the call; mfa keeps its pipelines and pool
//     buffers alive until the command buffer completes.
//   - A call with nothing to compute (B, Hq, R or C = 0) writes its outputs at
//     once, encodes nothing and returns a ready future.
//   - A command buffer that is never committed never completes: its future never
//     becomes ready.
// Throws before encoding anything: ArgumentError (not the metal device; a
// command buffer of another device, or already committed), TypeError (not a
// command buffer), and every error mfa::attention throws for its arguments.
std::shared_future<void> attention(const Device& device, const Bundle& bundle, const TensorView& q,
                                   const TensorView& k, const TensorView& v, const TensorView& out,
                                   const AttentionOptions& options, const TensorView* lse, void* command_buffer);
std::shared_future<void> attention_backward(const Device& device, const Bundle& bundle, const TensorView& q,
                                            const TensorView& k, const TensorView& v, const TensorView& o,
                                            const TensorView& lse, const TensorView& dout, const TensorView& dq,
                                            const TensorView& dk, const TensorView& dv,
                                            const AttentionOptions& options, const TensorView* dsinks,
                                            void* command_buffer);
std::shared_future<void> attention_with_kvcache(const Device& device, const Bundle& bundle, const TensorView& q,
                                                const KVCache& k_cache, const KVCache& v_cache,
                                                const TensorView& out, const KVCacheOptions& options,
                                                const TensorView* lse, void* command_buffer);
std::shared_future<void> sparse_attention(const Device& device, const Bundle& bundle, const TensorView& q,
                                          const TensorView& k, const TensorView& v, const TensorView& indices,
                                          const TensorView& out, const SparseOptions& options, const TensorView* lse,
                                          void* command_buffer);
std::shared_future<void> sparse_attention_backward(const Device& device, const Bundle& bundle, const TensorView& q,
                                                   const TensorView& k, const TensorView& v,
                                                   const TensorView& indices, const TensorView& o,
                                                   const TensorView& lse, const TensorView& dout,
                                                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                                   const SparseOptions& options, const TensorView* dsinks,
                                                   void* command_buffer);
std::shared_future<void> sparse_topk(const Device& device, const Bundle& bundle, const TensorView& q,
                                     const TensorView& k, const TensorView& weights, std::int64_t topk,
                                     const TensorView& indices, const SparseTopkOptions& options,
                                     const TensorView* topk_scores, void* command_buffer);
std::shared_future<void> block_sparse_attention(const Device& device, const Bundle& bundle, const TensorView& q,
                                                const TensorView& k, const TensorView& v, const BlockMask& block_mask,
                                                const TensorView& out, const BlockSparseOptions& options,
                                                const TensorView* lse, void* command_buffer);
std::shared_future<void> block_sparse_attention_backward(const Device& device, const Bundle& bundle,
                                                         const TensorView& q, const TensorView& k, const TensorView& v,
                                                         const TensorView& o, const TensorView& lse,
                                                         const TensorView& dout, const BlockMask& block_mask,
                                                         const TensorView& dq, const TensorView& dk,
                                                         const TensorView& dv, const BlockSparseOptions& options,
                                                         const TensorView* dsinks, void* command_buffer);
std::shared_future<void> int8_attention(const Device& device, const Bundle& bundle, const TensorView& q,
                                        const TensorView& k, const TensorView& v, const TensorView& out,
                                        const Int8AttentionOptions& options, const TensorView* lse,
                                        void* command_buffer);
std::shared_future<void> merge_attention(const Device& device, const Bundle& bundle,
                                         const std::vector<TensorView>& outputs, const std::vector<TensorView>& lses,
                                         const TensorView& out, const TensorView& lse, Layout layout,
                                         void* command_buffer);
std::shared_future<void> quantize(const Device& device, const Bundle& bundle, const TensorView& x,
                                  const QuantizeOutputs& out, const std::string& format,
                                  std::optional<std::int64_t> bits, std::optional<std::int64_t> group_size,
                                  void* command_buffer);
std::shared_future<void> attention_varlen(const Device& device, const Bundle& bundle, const TensorView& q,
                                          const TensorView& k, const TensorView& v, const TensorView& cu_seqlens_q,
                                          const TensorView* cu_seqlens_k, const TensorView& out,
                                          const VarlenOptions& options, const TensorView* lse, void* command_buffer);
std::shared_future<void> attention_varlen_backward(const Device& device, const Bundle& bundle, const TensorView& q,
                                                   const TensorView& k, const TensorView& v, const TensorView& o,
                                                   const TensorView& lse, const TensorView& dout,
                                                   const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
                                                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                                   const VarlenOptions& options, const TensorView* dsinks,
                                                   void* command_buffer);

}  // namespace mfa::metal

#ifdef __OBJC__
#import <Metal/Metal.h>

namespace mfa::metal {

inline void encode(const Device& device, std::vector<Dispatch> dispatches, id<MTLCommandBuffer> command_buffer) {
  encode(device, std::move(dispatches), (__bridge void*)command_buffer);
}

inline Buffer wrap_buffer(const Device& device, id<MTLBuffer> buffer, std::size_t byte_offset, std::size_t bytes) {
  return wrap_buffer(device, (__bridge void*)buffer, byte_offset, bytes);
}

inline std::shared_future<void> attention(const Device& device, const Bundle& bundle, const TensorView& q,
                                          const TensorView& k, const TensorView& v, const TensorView& out,
                                          const AttentionOptions& options, const TensorView* lse,
                                          id<MTLCommandBuffer> command_buffer) {
  return attention(device, bundle, q, k, v, out, options, lse, (__bridge void*)command_buffer);
}

inline std::shared_future<void> attention_backward(const Device& device, const Bundle& bundle, const TensorView& q,
                                                   const TensorView& k, const TensorView& v, const TensorView& o,
                                                   const TensorView& lse, const TensorView& dout,
                                                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                                   const AttentionOptions& options, const TensorView* dsinks,
                                                   id<MTLCommandBuffer> command_buffer) {
  return attention_backward(device, bundle, q, k, v, o, lse, dout, dq, dk, dv, options, dsinks,
                            (__bridge void*)command_buffer);
}

inline std::shared_future<void> attention_with_kvcache(const Device& device, const Bundle& bundle,
                                                       const TensorView& q, const KVCache& k_cache,
                                                       const KVCache& v_cache, const TensorView& out,
                                                       const KVCacheOptions& options, const TensorView* lse,
                                                       id<MTLCommandBuffer> command_buffer) {
  return attention_with_kvcache(device, bundle, q, k_cache, v_cache, out, options, lse,
                                (__bridge void*)command_buffer);
}

}  // namespace mfa::metal
#endif
