// Records dispatches, validates them against the kernels' signatures and the
// device limits, and runs them in order: commit() starts, wait() finishes.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "mfa/backend.hpp"
#include "mfa/buffer.hpp"
#include "mfa/device.hpp"
#include "mfa/pipeline.hpp"
#include "mfa/types.hpp"

namespace mfa {

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

  // Validates every dispatch (throws ArgumentError naming the kernel and the
  // problem: unbound buffer, too many threads, threadgroup memory over the
  // limit, wrong inline-bytes size) and hands the batch to the backend.
  void commit();
  // Blocks until done; copies staged host memory back. Throws DispatchError.
  std::vector<DispatchStats> wait();
  std::vector<DispatchStats> run() { commit(); return wait(); }

 private:
  struct HostStaging {
    void* host;
    Buffer staging;
    std::size_t bytes;
    bool writable;
  };
  void validate(const Dispatch& dispatch) const;

  Device device_;
  std::vector<Dispatch> dispatches_;
  std::vector<HostStaging> staging_;
  std::unique_ptr<Submission> submission_;
  bool committed_ = false;
};

}  // namespace mfa
