#include "mfa/prepared_pass.hpp"

#include "mfa/command_batch.hpp"
#include "mfa/errors.hpp"

namespace mfa {

PreparedPass::PreparedPass(Device device, std::vector<PassDispatch> dispatches, std::vector<PassArraySlot> arrays,
                           std::vector<std::size_t> intermediate_bytes,
                           std::vector<std::vector<unsigned char>> constants)
    : device_(std::move(device)),
      dispatches_(std::move(dispatches)),
      arrays_(std::move(arrays)),
      intermediate_bytes_(std::move(intermediate_bytes)),
      constants_(std::move(constants)) {
  for (const PassDispatch& dispatch : dispatches_) {
    if (!dispatch.pipeline) throw ArgumentError("a pass dispatch has no pipeline");
    for (const PassBinding& binding : dispatch.bindings) {
      const std::size_t slots = binding.source == PassBinding::Source::array          ? arrays_.size()
                                : binding.source == PassBinding::Source::intermediate ? intermediate_bytes_.size()
                                                                                      : constants_.size();
      if (binding.slot >= slots)
        throw ArgumentError("kernel '" + dispatch.pipeline->name() + "': buffer(" + std::to_string(binding.index) +
                            ") binds slot " + std::to_string(binding.slot) + " of " + std::to_string(slots));
    }
  }
}

std::vector<DispatchStats> PreparedPass::run(const std::vector<PassArray>& arrays) const {
  CommandBatch batch(device_);
  encode(batch, arrays);
  return batch.run();
}

void PreparedPass::encode(CommandBatch& batch, const std::vector<PassArray>& arrays) const {
  if (!(batch.device() == device_)) throw ArgumentError("the batch runs on another device than the pass");
  if (arrays.size() != arrays_.size())
    throw ArgumentError("the pass takes " + std::to_string(arrays_.size()) + " arrays, got " +
                        std::to_string(arrays.size()));
  std::vector<Buffer> intermediates;
  intermediates.reserve(intermediate_bytes_.size());
  for (std::size_t bytes : intermediate_bytes_) intermediates.push_back(device_.new_buffer(bytes));

  for (const PassDispatch& dispatch : dispatches_) {
    auto ref = batch.dispatch(dispatch.pipeline, dispatch.threadgroups, dispatch.threads_per_threadgroup);
    for (const PassBinding& binding : dispatch.bindings) {
      switch (binding.source) {
        case PassBinding::Source::array: {
          const PassArray& array = arrays[binding.slot];
          if (array.buffer) ref.buffer(binding.index, array.buffer, array.offset);
          else ref.host(binding.index, array.host, array.bytes, arrays_[binding.slot].writable);
          break;
        }
        case PassBinding::Source::intermediate:
          ref.buffer(binding.index, intermediates[binding.slot]);
          break;
        case PassBinding::Source::constant: {
          const std::vector<unsigned char>& bytes = constants_[binding.slot];
          ref.bytes(binding.index, bytes.data(), bytes.size());
          break;
        }
      }
    }
    for (std::size_t i = 0; i < dispatch.threadgroup_memory.size(); ++i)
      if (dispatch.threadgroup_memory[i]) ref.threadgroup_memory(int(i), dispatch.threadgroup_memory[i]);
  }
}

}  // namespace mfa
