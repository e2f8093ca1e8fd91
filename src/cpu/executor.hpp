// Runs a compiled kernel: one fiber per GPU thread, threadgroups in parallel
// on worker threads, with the diagnostics no Metal tool gives on Linux.
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "mfa/types.hpp"
#include "shim/mfa_kernel_abi.h"

namespace mfa::cpu {

using KernelMain = void (*)(mfa_abi::ThreadState*);

struct Launch {
  std::string kernel;  // entry-point name, for diagnostics
  KernelMain main = nullptr;
  Size3 threadgroups;
  Size3 threads_per_threadgroup;
  std::array<void*, mfa_abi::kMaxBuffers> buffers{};
  std::array<std::size_t, mfa_abi::kMaxBuffers> buffer_sizes{};
  std::vector<std::size_t> threadgroup_memory;  // byte length of [[threadgroup(i)]]
  std::size_t threadgroup_memory_limit = 32 * 1024;
  std::vector<BufferTraffic> traffic;  // the buffers to report (index, name); run() adds the bytes
};

class Executor {
 public:
  // `workers` OS threads run threadgroups; 0 means one per hardware thread.
  explicit Executor(unsigned workers = 0);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // The process-wide executor (MFA_NATIVE_CPU_THREADS sets its worker count).
  static Executor& shared();

  // Runs every threadgroup of the launch to completion. Throws
  // DispatchError(kernel, diagnostic) for: a barrier not every thread
  // reaches, a deadlock, lanes at different collectives, a simdgroup_matrix
  // operation with inactive lanes, threadgroup memory over the limit, a
  // failure the kernel reported (bounds checks), an exception escaping the
  // kernel, a threadgroup whose threads only yield for
  // MFA_NATIVE_CPU_TIMEOUT seconds (default 10), and a threadgroup still
  // running a loop after MFA_NATIVE_CPU_WATCHDOG_S seconds (default 10; the
  // translator puts a check in every loop). Never hangs on those.
  // Throws ArgumentError for a malformed launch. Safe to call from several
  // threads; dispatches run one after another.
  DispatchStats run(const Launch& launch);

  unsigned workers() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Context switches per second of the fiber implementation in use (benchmark).
double measure_context_switches_per_second(std::size_t switches);
const char* fiber_switch_implementation();  // "x86_64-asm", "aarch64-asm" or "ucontext"

}  // namespace mfa::cpu
