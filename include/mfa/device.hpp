// A device: one backend plus the caches and pool that serve it. Devices are
// process-wide singletons per kind; copies of a Device share one state.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mfa/backend.hpp"
#include "mfa/buffer.hpp"
#include "mfa/pipeline.hpp"
#include "mfa/types.hpp"

namespace mfa {

// Every CommandBatch a device ran: how many, the bytes of caller memory bound
// by address (per binding; pool buffers, such as op outputs, are not caller
// memory), and of those the bytes staged to the device at commit and copied
// back at wait (both 0 where the backend binds host memory in place, as the
// cpu backend does).
struct BatchStats {
  std::uint64_t committed = 0;
  std::uint64_t bytes_host_bound = 0;
  std::uint64_t bytes_staged_in = 0;
  std::uint64_t bytes_copied_back = 0;
};

class Device {
 public:
  // Every device this build can run on this machine (cpu always).
  static std::vector<Device> available();
  static bool is_available(DeviceKind kind);
  // Throws UnavailableError when the kind is not available here.
  static Device get(DeviceKind kind);
  // MFA_NATIVE_DEVICE=cpu|metal when set, else metal where available, else cpu.
  static Device default_device();

  DeviceKind kind() const;
  std::string name() const;
  DeviceLimits limits() const;
  std::vector<std::pair<std::string, std::string>> properties() const;
  TuningFacts tuning() const;

  // With `binary` (this device's compiled form of `source`, e.g. a Metal
  // library a bundle stores), the library is made from it where the backend
  // loads such binaries; the cpu backend compiles the source. Cached under the
  // same key either way (see PipelineCache::library).
  std::shared_ptr<const Library> library(const std::string& source, const CompileOptions& options = {},
                                         const std::vector<unsigned char>* binary = nullptr) const;
  std::shared_ptr<const Pipeline> pipeline(const std::shared_ptr<const Library>& library,
                                           const std::string& entry,
                                           const FunctionConstants& constants = {}) const;
  // Both steps in one: compile (cached) and specialize (cached).
  std::shared_ptr<const Pipeline> pipeline(const std::string& source, const std::string& entry,
                                           const FunctionConstants& constants = {},
                                           const CompileOptions& options = {}) const;

  Buffer new_buffer(std::size_t bytes) const;  // from the pool
  BufferPool& buffer_pool() const;
  PipelineCache& pipeline_cache() const;
  BatchStats batch_stats() const;
  // Called by CommandBatch: one batch committed that bound `host_bound` bytes
  // of caller memory, `staged_in` of them staged.
  void count_commit(std::uint64_t host_bound, std::uint64_t staged_in) const;
  // Called by CommandBatch: `copied_back` bytes returned to caller memory.
  void count_copy_back(std::uint64_t copied_back) const;
  Backend& backend() const;

  bool operator==(const Device& other) const { return state_ == other.state_; }

 private:
  struct State;
  // The process-wide state of one kind, created on first use; nullptr when
  // that kind is not available here.
  static const std::shared_ptr<State>& state_for(DeviceKind kind);
  explicit Device(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace mfa
