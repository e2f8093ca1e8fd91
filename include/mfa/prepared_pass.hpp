// A pass made ready to run many times: several dispatches in order whose
// pipelines, launch geometry and bindings were resolved once. Each run binds
// the caller's arrays (the pass's inputs and outputs), takes the intermediates
// from the device's buffer pool and encodes every dispatch into one
// CommandBatch: one commit, one wait. The core orders dependent dispatches.
//
// The Python runner builds one from a pass description (codegen's plain value
// listing kernels and buffers); C++ programs can build one by hand.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "mfa/buffer.hpp"
#include "mfa/command_batch.hpp"
#include "mfa/device.hpp"
#include "mfa/pipeline.hpp"
#include "mfa/types.hpp"

namespace mfa {

// What one [[buffer(i)]] of a dispatch binds: the run's array `slot`, the
// pass's intermediate `slot`, or its constant bytes `slot`.
struct PassBinding {
  enum class Source { array, intermediate, constant };
  int index = -1;
  Source source = Source::array;
  std::size_t slot = 0;
};

struct PassDispatch {
  std::shared_ptr<const Pipeline> pipeline;
  Size3 threadgroups;
  Size3 threads_per_threadgroup;
  std::vector<PassBinding> bindings;
  std::vector<std::size_t> threadgroup_memory;  // byte length of [[threadgroup(i)]]
};

// One array of a run: caller memory (`host`, `bytes` from its first element)
// or device memory (`buffer` at `offset`).
struct PassArray {
  void* host = nullptr;
  std::size_t bytes = 0;
  Buffer buffer;
  std::size_t offset = 0;
};

// The array slots of a pass, in order: a name for messages, and whether the
// kernels write it (outputs) or only read it (inputs).
struct PassArraySlot {
  std::string name;
  bool writable = false;
};

class PreparedPass {
 public:
  // Throws ArgumentError when a binding names a slot the pass does not have.
  PreparedPass(Device device, std::vector<PassDispatch> dispatches, std::vector<PassArraySlot> arrays,
               std::vector<std::size_t> intermediate_bytes, std::vector<std::vector<unsigned char>> constants);

  // Runs every dispatch in one batch and returns their stats in order.
  // `arrays` fills the array slots in order. Safe to call from several
  // threads at once (each run has its own batch and intermediates).
  std::vector<DispatchStats> run(const std::vector<PassArray>& arrays) const;
  // Records every dispatch into `batch` (of this pass's device) without
  // committing; the batch keeps the intermediates alive until it is done.
  void encode(CommandBatch& batch, const std::vector<PassArray>& arrays) const;

  const Device& device() const { return device_; }
  const std::vector<PassArraySlot>& arrays() const { return arrays_; }

 private:
  Device device_;
  std::vector<PassDispatch> dispatches_;
  std::vector<PassArraySlot> arrays_;
  std::vector<std::size_t> intermediate_bytes_;
  std::vector<std::vector<unsigned char>> constants_;
};

}  // namespace mfa
