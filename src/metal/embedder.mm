// The functions of include/mfa/metal.hpp.
#include "mfa/metal.hpp"

#include <functional>
#include <future>
#include <memory>
#include <string>

#include "mfa/attention.hpp"
#include "mfa/command_batch.hpp"
#include "mfa/errors.hpp"
#include "metal/encoder.h"
#include "metal/metal_backend.h"
#include "metal/metal_objects.h"
#include "metal/submission.h"

namespace mfa::metal {

namespace {

const char* const kNeedsMacOS14 = "the Metal backend needs macOS 14 or later";

// The object behind `pointer` when it is of `protocol`; throws naming `what` otherwise.
id checked_object(void* pointer, Protocol* protocol, const std::string& what, const char* expected) {
  if (!pointer) throw ArgumentError(what + " is null; expected " + expected);
  id object = (__bridge id)pointer;
  if (![object conformsToProtocol:protocol]) throw TypeError(what + " is not " + expected);
  return object;
}

// `command_buffer` as an id<MTLCommandBuffer> of `device`'s GPU, not committed
// yet; throws naming `what` otherwise.
MFA_METAL_AVAILABILITY id<MTLCommandBuffer> open_command_buffer(const Device& device, void* command_buffer,
                                                                const std::string& what) {
  MetalBackend& backend = metal_backend_of(device, what);
  id<MTLCommandBuffer> target =
      checked_object(command_buffer, @protocol(MTLCommandBuffer), what + ": command_buffer", "an id<MTLCommandBuffer>");
  if (target.device != backend.device()) throw ArgumentError(what + ": command_buffer belongs to another Metal device");
  if (target.status > MTLCommandBufferStatusEnqueued)
    throw ArgumentError(what + ": command_buffer is already committed");
  return target;
}

std::string kernel_names(const std::vector<Dispatch>& dispatches) {
  std::string names;
  for (const Dispatch& dispatch : dispatches) names += (names.empty() ? "" : ", ") + dispatch.pipeline->name();
  return names;
}

// What `record` records into a CommandBatch of `device` (a bundle's pass),
// encoded into the caller's `command_buffer`: the batch's work is taken out
// (validated, staged inputs copied in) and a completed handler copies the
// staged outputs back, then makes the returned future ready.
std::shared_future<void> encode_recorded(const Device& device, void* command_buffer, const std::string& what,
                                         const std::function<void(CommandBatch&)>& record) {
  if (@available(macOS 14.0, *)) {
    return with_autorelease_pool([&] {
      id<MTLCommandBuffer> target = open_command_buffer(device, command_buffer, what);
      CommandBatch batch(device);
      record(batch);
      auto work = std::make_shared<const BatchWork>(batch.take_work());
      auto done = std::make_shared<std::promise<void>>();
      std::shared_future<void> visible = done->get_future().share();
      if (work->dispatches.empty()) {  // nothing to compute: the outputs are written already
        done->set_value();
        return visible;
      }
      encode_dispatches(target, work->dispatches);
      const Device owner = device;
      // The block owns the work (pipelines, pool buffers) until the GPU is done with it.
      [target addCompletedHandler:^(id<MTLCommandBuffer> completed) {
        if (completed.status == MTLCommandBufferStatusError) {
          done->set_exception(std::make_exception_ptr(DispatchError(kernel_names(work->dispatches),
                                                                    explain(completed.error))));
          return;
        }
        owner.count_copy_back(copy_back(work->staging));
        done->set_value();
      }];
      return visible;
    });
  }
  throw UnavailableError(kNeedsMacOS14);
}

}  // namespace

void encode(const Device& device, std::vector<Dispatch> dispatches, void* command_buffer) {
  if (@available(macOS 14.0, *)) {
    with_autorelease_pool([&] {
      id<MTLCommandBuffer> target = open_command_buffer(device, command_buffer, "mfa::metal::encode");
      for (const Dispatch& dispatch : dispatches) validate_dispatch(device, dispatch);
      encode_dispatches(target, dispatches);
      retain_until_completed(target, std::move(dispatches));
    });
    return;
  }
  throw UnavailableError(kNeedsMacOS14);
}

Buffer wrap_buffer(const Device& device, void* mtl_buffer, std::size_t byte_offset, std::size_t bytes) {
  if (@available(macOS 14.0, *)) {
    return with_autorelease_pool([&] {
      MetalBackend& backend = metal_backend_of(device, "mfa::metal::wrap_buffer");
      id<MTLBuffer> buffer = checked_object(mtl_buffer, @protocol(MTLBuffer), "mfa::metal::wrap_buffer: mtl_buffer",
                                            "an id<MTLBuffer> (a kDLMetal tensor's DLTensor::data)");
      if (buffer.device != backend.device())
        throw ArgumentError("mfa::metal::wrap_buffer: mtl_buffer belongs to another Metal device");
      const std::size_t length = buffer.length;
      if (bytes == 0) throw ArgumentError("mfa::metal::wrap_buffer: bytes must be at least 1");
      if (byte_offset > length || bytes > length - byte_offset)
        throw ArgumentError("mfa::metal::wrap_buffer: byte_offset " + std::to_string(byte_offset) + " + bytes " +
                            std::to_string(bytes) + " runs past the MTLBuffer's " + std::to_string(length) +
                            " bytes");
      return Buffer(std::make_shared<MetalStorage>(buffer, byte_offset, bytes), bytes);
    });
  }
  throw UnavailableError(kNeedsMacOS14);
}

std::shared_future<void> attention(const Device& device, const Bundle& bundle, const TensorView& q,
                                   const TensorView& k, const TensorView& v, const TensorView& out,
                                   const AttentionOptions& options, const TensorView* lse, void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::attention", [&](CommandBatch& batch) {
    mfa::attention(batch, bundle, q, k, v, out, options, lse);
  });
}

std::shared_future<void> attention_backward(const Device& device, const Bundle& bundle, const TensorView& q,
                                            const TensorView& k, const TensorView& v, const TensorView& o,
                                            const TensorView& lse, const TensorView& dout, const TensorView& dq,
                                            const TensorView& dk, const TensorView& dv,
                                            const AttentionOptions& options, const TensorView* dsinks,
                                            void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::attention_backward", [&](CommandBatch& batch) {
    mfa::attention_backward(batch, bundle, q, k, v, o, lse, dout, dq, dk, dv, options, dsinks);
  });
}

std::shared_future<void> attention_with_kvcache(const Device& device, const Bundle& bundle, const TensorView& q,
                                                const KVCache& k_cache, const KVCache& v_cache,
                                                const TensorView& out, const KVCacheOptions& options,
                                                const TensorView* lse, void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::attention_with_kvcache", [&](CommandBatch& batch) {
    mfa::attention_with_kvcache(batch, bundle, q, k_cache, v_cache, out, options, lse);
  });
}

std::shared_future<void> sparse_attention(const Device& device, const Bundle& bundle, const TensorView& q,
                                          const TensorView& k, const TensorView& v, const TensorView& indices,
                                          const TensorView& out, const SparseOptions& options, const TensorView* lse,
                                          void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::sparse_attention", [&](CommandBatch& batch) {
    mfa::sparse_attention(batch, bundle, q, k, v, indices, out, options, lse);
  });
}

std::shared_future<void> sparse_attention_backward(const Device& device, const Bundle& bundle, const TensorView& q,
                                                   const TensorView& k, const TensorView& v,
                                                   const TensorView& indices, const TensorView& o,
                                                   const TensorView& lse, const TensorView& dout,
                                                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                                   const SparseOptions& options, const TensorView* dsinks,
                                                   void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::sparse_attention_backward", [&](CommandBatch& batch) {
    mfa::sparse_attention_backward(batch, bundle, q, k, v, indices, o, lse, dout, dq, dk, dv, options, dsinks);
  });
}

std::shared_future<void> sparse_topk(const Device& device, const Bundle& bundle, const TensorView& q,
                                     const TensorView& k, const TensorView& weights, std::int64_t topk,
                                     const TensorView& indices, const SparseTopkOptions& options,
                                     const TensorView* topk_scores, void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::sparse_topk", [&](CommandBatch& batch) {
    mfa::sparse_topk(batch, bundle, q, k, weights, topk, indices, options, topk_scores);
  });
}

std::shared_future<void> block_sparse_attention(const Device& device, const Bundle& bundle, const TensorView& q,
                                                const TensorView& k, const TensorView& v, const BlockMask& block_mask,
                                                const TensorView& out, const BlockSparseOptions& options,
                                                const TensorView* lse, void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::block_sparse_attention", [&](CommandBatch& batch) {
    mfa::block_sparse_attention(batch, bundle, q, k, v, block_mask, out, options, lse);
  });
}

std::shared_future<void> block_sparse_attention_backward(const Device& device, const Bundle& bundle,
                                                         const TensorView& q, const TensorView& k, const TensorView& v,
                                                         const TensorView& o, const TensorView& lse,
                                                         const TensorView& dout, const BlockMask& block_mask,
                                                         const TensorView& dq, const TensorView& dk,
                                                         const TensorView& dv, const BlockSparseOptions& options,
                                                         const TensorView* dsinks, void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::block_sparse_attention_backward",
                         [&](CommandBatch& batch) {
                           mfa::block_sparse_attention_backward(batch, bundle, q, k, v, o, lse, dout, block_mask, dq,
                                                                dk, dv, options, dsinks);
                         });
}

std::shared_future<void> int8_attention(const Device& device, const Bundle& bundle, const TensorView& q,
                                        const TensorView& k, const TensorView& v, const TensorView& out,
                                        const Int8AttentionOptions& options, const TensorView* lse,
                                        void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::int8_attention", [&](CommandBatch& batch) {
    mfa::int8_attention(batch, bundle, q, k, v, out, options, lse);
  });
}

std::shared_future<void> merge_attention(const Device& device, const Bundle& bundle,
                                         const std::vector<TensorView>& outputs, const std::vector<TensorView>& lses,
                                         const TensorView& out, const TensorView& lse, Layout layout,
                                         void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::merge_attention", [&](CommandBatch& batch) {
    mfa::merge_attention(batch, bundle, outputs, lses, out, lse, layout);
  });
}

std::shared_future<void> quantize(const Device& device, const Bundle& bundle, const TensorView& x,
                                  const QuantizeOutputs& out, const std::string& format,
                                  std::optional<std::int64_t> bits, std::optional<std::int64_t> group_size,
                                  void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::quantize", [&](CommandBatch& batch) {
    mfa::quantize(batch, bundle, x, out, format, bits, group_size);
  });
}

std::shared_future<void> attention_varlen(const Device& device, const Bundle& bundle, const TensorView& q,
                                          const TensorView& k, const TensorView& v, const TensorView& cu_seqlens_q,
                                          const TensorView* cu_seqlens_k, const TensorView& out,
                                          const VarlenOptions& options, const TensorView* lse, void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::attention_varlen", [&](CommandBatch& batch) {
    mfa::attention_varlen(batch, bundle, q, k, v, cu_seqlens_q, cu_seqlens_k, out, options, lse);
  });
}

std::shared_future<void> attention_varlen_backward(const Device& device, const Bundle& bundle, const TensorView& q,
                                                   const TensorView& k, const TensorView& v, const TensorView& o,
                                                   const TensorView& lse, const TensorView& dout,
                                                   const TensorView& cu_seqlens_q, const TensorView* cu_seqlens_k,
                                                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                                   const VarlenOptions& options, const TensorView* dsinks,
                                                   void* command_buffer) {
  return encode_recorded(device, command_buffer, "mfa::metal::attention_varlen_backward", [&](CommandBatch& batch) {
    mfa::attention_varlen_backward(batch, bundle, q, k, v, o, lse, dout, cu_seqlens_q, cu_seqlens_k, dq, dk, dv,
                                   options, dsinks);
  });
}

}  // namespace mfa::metal
