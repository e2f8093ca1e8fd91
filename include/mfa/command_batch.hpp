// Records dispatches, validates them against the kernels' signatures and the
// device limits, and runs them in order: commit() starts, wait() finishes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "mfa/backend.hpp"
#include "mfa/buffer.hpp"
#include "mfa/device.hpp"
#include "mfa/pipeline.hpp"
#include "mfa/types.hpp"

namespace mfa {

// Checks a dispatch against its kernel's signature and the device's limits.
// Throws ArgumentError naming the kernel and the problem: a missing or extra
// buffer, too many threads, threadgroup memory over the limit or without a
// length, inline bytes too small for the argument, read-only memory bound to
// a written argument. CommandBatch::commit and mfa::metal::encode call it.
void validate_dispatch(const Device& device, const Dispatch& dispatch);

// Caller memory a batch stages through a pool buffer because the backend
// cannot bind it in place: copied in before the work runs, and back after it
// when a kernel writes it.
struct HostStaging {
  void* host;
  Buffer staging;
  std::size_t bytes;
  bool writable;
};

// Copies every writable staging buffer back to its caller memory; the bytes copied.
std::uint64_t copy_back(const std::vector<HostStaging>& staging);

// A batch's work taken out to be run elsewhere (mfa::metal::attention encodes
// it into the caller's command buffer): the validated dispatches, and the
// staged caller memory, inputs already copied in.
struct BatchWork {
  std::vector<Dispatch> dispatches;
  std::vector<HostStaging> staging;
};

class CommandBatch {
 public:
  explicit CommandBatch(Device device);
  ~CommandBatch();  // waits for committed work; never leaves a dispatch running
  CommandBatch(const CommandBatch&) = delete;
  CommandBatch& operator=(const CommandBatch&) = delete;

  // Fluent access to the dispatch just recorded.
  class DispatchRef {
   public:
    DispatchRef& buffer(int index, Buffer buffer, std::size_t offset = 0);
    // Caller memory: bound without a copy where the backend allows it, else
    // staged through the pool (copied in at commit, out at wait if writable).
    DispatchRef& host(int index, void* data, std::size_t bytes, bool writable);
    DispatchRef& bytes(int index, const void* data, std::size_t size);
    DispatchRef& threadgroup_memory(int index, std::size_t bytes);

   private:
    friend class CommandBatch;
    DispatchRef(CommandBatch& batch, std::size_t which) : batch_(batch), which_(which) {}
    CommandBatch& batch_;
    std::size_t which_;
  };

  DispatchRef dispatch(std::shared_ptr<const Pipeline> pipeline, Size3 threadgroups,
                       Size3 threads_per_threadgroup);

  // Validates every dispatch (validate_dispatch) and hands the batch to the backend.
  void commit();
  // Blocks until done; copies staged host memory back. Throws DispatchError.
  std::vector<DispatchStats> wait();
  std::vector<DispatchStats> run() { commit(); return wait(); }
  // Validates the dispatches and copies staged inputs in, as commit() does,
  // but hands the work to the caller instead of the backend; the batch is
  // then spent. The caller runs the dispatches, keeps the work alive until
  // they complete, then calls copy_back(work.staging).
  BatchWork take_work();
  const Device& device() const { return device_; }

 private:
  // commit()'s and take_work()'s common part: validate, stage in, count the commit.
  void seal();
  // The staging buffer already made for `host` in this batch, if any, so
  // one array bound twice is one buffer (later dispatches see earlier writes).
  HostStaging* staging_for(void* host, std::size_t bytes);

  Device device_;
  std::vector<Dispatch> dispatches_;
  std::vector<HostStaging> staging_;
  std::uint64_t host_bound_ = 0;  // caller memory bound by address, per binding
  std::unique_ptr<Submission> submission_;
  bool committed_ = false;
};

}  // namespace mfa
