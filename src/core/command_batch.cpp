#include "mfa/command_batch.hpp"

#include <algorithm>
#include <cstring>

#include "mfa/dispatch_timing.hpp"
#include "mfa/errors.hpp"

namespace mfa {

namespace {

std::string where(const Pipeline& pipeline) { return "kernel '" + pipeline.name() + "': "; }

std::string describe(const ArgumentInfo& argument) {
  return "buffer(" + std::to_string(argument.index) + ") '" + argument.name + "'";
}

Binding& binding_at(Dispatch& dispatch, int index) {
  if (index < 0 || index > kMaxArgumentIndex)
    throw ArgumentError(where(*dispatch.pipeline) + "buffer index must be 0.." + std::to_string(kMaxArgumentIndex) +
                        ", got " + std::to_string(index));
  // Bindings stay sorted by index; binding an index again replaces it.
  auto found = std::find_if(dispatch.bindings.begin(), dispatch.bindings.end(),
                            [&](const Binding& b) { return b.index >= index; });
  if (found == dispatch.bindings.end() || found->index != index) found = dispatch.bindings.insert(found, Binding{});
  *found = Binding{};
  found->index = index;
  return *found;
}

void check_size(const char* what, const Size3& size) {
  if (size.x == 0 || size.y == 0 || size.z == 0)
    throw ArgumentError(std::string(what) + " must be at least 1 on every axis");
}

}  // namespace

CommandBatch::CommandBatch(Device device) : device_(std::move(device)) {}

CommandBatch::~CommandBatch() {
  if (submission_) {
    try {
      submission_->wait();
    } catch (...) {
      // The caller never asked for the result; the failure has nobody to go to.
    }
  }
}

CommandBatch::DispatchRef CommandBatch::dispatch(std::shared_ptr<const Pipeline> pipeline, Size3 threadgroups,
                                                 Size3 threads_per_threadgroup) {
  if (committed_) throw ArgumentError("this CommandBatch was already committed; record into a new one");
  if (!pipeline) throw ArgumentError("dispatch needs a pipeline");
  Dispatch dispatch;
  dispatch.pipeline = std::move(pipeline);
  dispatch.threadgroups = threadgroups;
  dispatch.threads_per_threadgroup = threads_per_threadgroup;
  dispatches_.push_back(std::move(dispatch));
  return DispatchRef(*this, dispatches_.size() - 1);
}

CommandBatch::DispatchRef& CommandBatch::DispatchRef::buffer(int index, Buffer buffer, std::size_t offset) {
  Dispatch& dispatch = batch_.dispatches_[which_];
  if (!buffer) throw ArgumentError(where(*dispatch.pipeline) + "buffer(" + std::to_string(index) + ") is empty");
  if (offset > buffer.size())
    throw ArgumentError(where(*dispatch.pipeline) + "buffer(" + std::to_string(index) + ") offset " +
                        std::to_string(offset) + " is past its end (" + std::to_string(buffer.size()) + " bytes)");
  Binding& binding = binding_at(dispatch, index);
  binding.buffer = std::move(buffer);
  binding.offset = offset;
  return *this;
}

CommandBatch::DispatchRef& CommandBatch::DispatchRef::host(int index, void* data, std::size_t bytes, bool writable) {
  Dispatch& dispatch = batch_.dispatches_[which_];
  if (!data && bytes) throw ArgumentError(where(*dispatch.pipeline) + "buffer(" + std::to_string(index) + ") is null");
  Backend& backend = batch_.device_.backend();
  batch_.host_bound_ += bytes;
  Buffer buffer;
  if (auto wrapped = backend.wrap_host(data, bytes)) {
    buffer = Buffer(std::move(wrapped), bytes);
  } else if (HostStaging* staged = batch_.staging_for(data, bytes)) {
    staged->writable = staged->writable || writable;
    buffer = staged->staging;
  } else {
    buffer = batch_.device_.new_buffer(bytes);
    batch_.staging_.push_back(HostStaging{data, buffer, bytes, writable});
  }
  Binding& binding = binding_at(dispatch, index);
  binding.buffer = std::move(buffer);
  binding.read_only = !writable;
  return *this;
}

CommandBatch::DispatchRef& CommandBatch::DispatchRef::bytes(int index, const void* data, std::size_t size) {
  Dispatch& dispatch = batch_.dispatches_[which_];
  Binding& binding = binding_at(dispatch, index);
  const auto* begin = static_cast<const unsigned char*>(data);
  binding.bytes.assign(begin, begin + size);
  binding.read_only = true;
  return *this;
}

CommandBatch::DispatchRef& CommandBatch::DispatchRef::threadgroup_memory(int index, std::size_t bytes) {
  Dispatch& dispatch = batch_.dispatches_[which_];
  if (index < 0 || index > kMaxArgumentIndex)
    throw ArgumentError(where(*dispatch.pipeline) + "threadgroup index must be 0.." +
                        std::to_string(kMaxArgumentIndex) + ", got " + std::to_string(index));
  if (dispatch.threadgroup_memory.size() <= std::size_t(index)) dispatch.threadgroup_memory.resize(index + 1, 0);
  dispatch.threadgroup_memory[index] =
      (bytes + kThreadgroupMemoryGranule - 1) / kThreadgroupMemoryGranule * kThreadgroupMemoryGranule;
  return *this;
}

HostStaging* CommandBatch::staging_for(void* host, std::size_t bytes) {
  for (HostStaging& staged : staging_)
    if (staged.host == host && staged.bytes == bytes) return &staged;
  return nullptr;
}

void validate_dispatch(const Device& device, const Dispatch& dispatch) {
  if (!dispatch.pipeline) throw ArgumentError("dispatch has no pipeline");
  const Pipeline& pipeline = *dispatch.pipeline;
  const FunctionInfo& function = pipeline.function();
  const DeviceLimits limits = device.limits();

  check_size("threadgroups", dispatch.threadgroups);
  check_size("threads_per_threadgroup", dispatch.threads_per_threadgroup);
  const std::uint64_t threads = dispatch.threads_per_threadgroup.volume();
  const std::uint64_t allowed =
      std::min<std::uint64_t>(limits.max_threads_per_threadgroup, pipeline.max_total_threads_per_threadgroup());
  if (threads > allowed)
    throw ArgumentError(where(pipeline) + std::to_string(threads) + " threads per threadgroup exceeds the limit of " +
                        std::to_string(allowed));

  for (const Binding& binding : dispatch.bindings) {
    const ArgumentInfo* argument = function.buffer(binding.index);
    if (!argument)
      throw ArgumentError(where(pipeline) + "has no buffer(" + std::to_string(binding.index) +
                          ") argument, but one was bound");
    const std::size_t bound = binding.buffer ? binding.buffer.size() - binding.offset : binding.bytes.size();
    const std::size_t needed = pipeline.backend().argument_size(binding.index);
    if (!argument->is_pointer && needed && bound < needed)
      throw ArgumentError(where(pipeline) + describe(*argument) + " is a " + argument->type + " of " +
                          std::to_string(needed) + " bytes, but " + std::to_string(bound) + " bytes were bound");
    if (binding.read_only && !argument->is_const)
      throw ArgumentError(where(pipeline) + describe(*argument) +
                          " is writable in the kernel, but read-only memory was bound to it");
  }
  std::size_t threadgroup_bytes = 0;
  for (const ArgumentInfo& argument : function.arguments) {
    if (argument.kind == ArgumentKind::buffer && !std::any_of(dispatch.bindings.begin(), dispatch.bindings.end(),
                                                              [&](const Binding& b) { return b.index == argument.index; }))
      throw ArgumentError(where(pipeline) + describe(argument) + " is not bound");
    if (argument.kind == ArgumentKind::threadgroup_memory) {
      const std::size_t length = std::size_t(argument.index) < dispatch.threadgroup_memory.size()
                                     ? dispatch.threadgroup_memory[argument.index]
                                     : 0;
      if (length == 0)
        throw ArgumentError(where(pipeline) + "threadgroup(" + std::to_string(argument.index) + ") '" +
                            argument.name + "' has no length; set threadgroup_memory[" +
                            std::to_string(argument.index) + "]");
      threadgroup_bytes += length;
    }
  }
  if (threadgroup_bytes > limits.max_threadgroup_memory)
    throw ArgumentError(where(pipeline) + "threadgroup memory of " + std::to_string(threadgroup_bytes) +
                        " bytes is over the limit of " + std::to_string(limits.max_threadgroup_memory) + " bytes");
}

std::uint64_t copy_back(const std::vector<HostStaging>& staging) {
  std::uint64_t copied_back = 0;
  for (const HostStaging& staged : staging) {
    if (!staged.writable) continue;
    std::memcpy(staged.host, staged.staging.data(), staged.bytes);
    copied_back += staged.bytes;
  }
  return copied_back;
}

void CommandBatch::seal() {
  if (committed_) throw ArgumentError("this CommandBatch was already committed");
  for (const Dispatch& dispatch : dispatches_) validate_dispatch(device_, dispatch);
  std::uint64_t staged_in = 0;
  for (const HostStaging& staged : staging_) {
    std::memcpy(staged.staging.data(), staged.host, staged.bytes);
    staged_in += staged.bytes;
  }
  device_.count_commit(host_bound_, staged_in);
  committed_ = true;
}

void CommandBatch::commit() {
  seal();
  submission_ = device_.backend().submit(std::move(dispatches_), DispatchTiming::requested());
  dispatches_.clear();
}

BatchWork CommandBatch::take_work() {
  seal();
  BatchWork work{std::move(dispatches_), std::move(staging_)};
  dispatches_.clear();
  staging_.clear();
  return work;
}

std::vector<DispatchStats> CommandBatch::wait() {
  if (!committed_) throw ArgumentError("wait() before commit()");
  if (!submission_) throw ArgumentError("this CommandBatch was already waited for");
  std::unique_ptr<Submission> submission = std::move(submission_);
  std::vector<HostStaging> staging = std::move(staging_);
  std::vector<DispatchStats> stats = submission->wait();
  device_.count_copy_back(copy_back(staging));
  return stats;
}

}  // namespace mfa
