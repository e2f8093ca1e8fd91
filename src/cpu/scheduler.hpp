// Runs the GPU threads of one threadgroup at a time as fibers on the calling
// OS thread: cooperative round-robin over ready fibers, SIMD-group
// collectives, threadgroup barriers, and a diagnostic (never a hang) when the
// threads cannot all finish.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "executor.hpp"
#include "fiber.hpp"
#include "race_detector.hpp"
#include "shim/mfa_kernel_abi.h"

namespace mfa::cpu {

// Lanes and threads match on the site of a collective or barrier: the same
// operation at the same line of the same file. (Each lane usually passes its
// own Site, whose strings are the same literals: the pointer tests decide.)
inline bool same_site(const mfa_abi::Site* a, const mfa_abi::Site* b) {
  if (a == b) return true;
  if (a == nullptr || b == nullptr || a->line != b->line) return false;
  auto same_text = [](const char* x, const char* y) {
    return x == y || (x != nullptr && y != nullptr && std::strcmp(x, y) == 0);
  };
  return same_text(a->op, b->op) && same_text(a->file, b->file);
}

// What every threadgroup of one dispatch shares.
struct GroupLaunch {
  const mfa_abi::DispatchContext* dispatch = nullptr;  // sizes, buffers, runtime, memory limit
  KernelMain main = nullptr;
  // Offsets of the [[threadgroup(i)]] blocks in threadgroup memory.
  std::array<std::size_t, mfa_abi::kMaxThreadgroupArgs> threadgroup_offsets{};
  std::size_t threadgroup_args = 0;  // how many [[threadgroup(i)]] blocks the launch has
  std::size_t static_base = 0;       // kernel-scope threadgroup variables start here
  double no_progress_seconds = 10;   // a group that only yields this long fails
  double watchdog_seconds = 10;      // a group whose loops still run after this long fails
  const std::atomic<bool>* stop = nullptr;  // set when another threadgroup failed
};

class GroupScheduler {
 public:
  GroupScheduler();
  ~GroupScheduler();
  GroupScheduler(const GroupScheduler&) = delete;
  GroupScheduler& operator=(const GroupScheduler&) = delete;

  // The function table kernels call; `ThreadState::executor` is the scheduler.
  static const mfa_abi::Runtime& runtime();

  // Sets up the threads of `launch` (allocates stacks and threadgroup memory
  // only when this launch needs more than any before).
  void prepare(const GroupLaunch& launch);

  // Runs the threadgroup at `position` to completion, adding its work to
  // `counters`. Returns the diagnostic if it failed; its fibers are then
  // abandoned, never resumed.
  std::optional<std::string> run(const std::array<std::uint32_t, 3>& position,
                                 mfa_abi::Counters& counters);

 private:
  enum class FiberState : std::uint8_t { ready, at_collective, at_barrier, finished };

  struct Fiber {
    FiberContext context;
    mfa_abi::ThreadState thread{};
    const mfa_abi::Site* site = nullptr;  // where it waits, or last yielded
    FiberState state = FiberState::ready;
    int arrive_result = 0;  // what simd_arrive returns when the fiber resumes
  };

  // The collective a simdgroup's lanes are gathering at.
  struct Collective {
    const mfa_abi::Site* site = nullptr;  // null when none is pending
    std::uint32_t arrived = 0;    // lanes waiting at `site`
    std::uint32_t existing = 0;   // lanes of the simdgroup (all 32 but in a partial one)
    std::uint32_t live = 0;       // lanes that exist and have not returned
    std::uint32_t releasing = 0;  // lanes simd_release resumes
    bool full = false;            // needs all 32 lanes (simdgroup_matrix)
  };

  struct AlignedDelete {
    void operator()(unsigned char* memory) const;
  };

  // Runtime entry points, called on the running fiber.
  int simd_arrive(const mfa_abi::Site* site, bool full);
  void simd_release();
  void threadgroup_barrier(const mfa_abi::Site* site);
  void yield(const mfa_abi::Site* site);
  void loop_check(const mfa_abi::Site* site);
  void race_access(const void* address, std::size_t bytes, unsigned access, const mfa_abi::Site* site);

  // Fiber lifecycle.
  static void fiber_entry(void* scheduler);
  [[noreturn]] void run_current_thread();
  std::string run_kernel_on_current_thread();  // the diagnostic if an exception escaped
  [[noreturn]] void finish_current_thread();
  // Stops the group with `diagnostic`; the running fiber is never resumed.
  // Callers pass a temporary: nothing on the abandoned stack may own memory.
  [[noreturn]] void abandon_current_thread(std::string diagnostic);
  void complete_collective(std::uint32_t simdgroup, std::uint32_t computing_lane);
  void make_ready(std::uint32_t thread);
  std::uint32_t next_ready();
  // Suspends the running thread (already marked waiting or ready) and runs
  // the next ready one.
  void suspend_current();
  void check_progress();
  void check_stop();  // abandons the running thread once another group failed

  // Diagnostics (scheduler_diagnostics.cpp): each says what went wrong and
  // where, naming the sites and the threads.
  std::string group_name() const;
  std::string thread_name(std::uint32_t thread) const;
  std::string describe_waiting_threads() const;
  std::string kernel_failure_diagnostic(const char* message) const;
  std::string exception_diagnostic(const char* what) const;
  std::string lanes_diverged_diagnostic(const Collective& collective,
                                        const mfa_abi::Site* site) const;
  std::string inactive_lanes_diagnostic(const mfa_abi::Site* site, std::uint32_t simdgroup) const;
  std::string barrier_unreachable_diagnostic(const mfa_abi::Site* site) const;
  std::string different_barriers_diagnostic(const mfa_abi::Site* site) const;
  std::string no_progress_diagnostic() const;
  std::string watchdog_diagnostic(const mfa_abi::Site* loop) const;
  std::string race_diagnostic(const RaceDetector::Race& race) const;
  std::string outside_threadgroup_memory_diagnostic(const void* address, std::size_t bytes,
                                                    const mfa_abi::Site* site) const;
  std::string threadgroup_memory_place(std::size_t offset) const;  // "byte 4 of [[threadgroup(1)]]"
  std::string deadlock_diagnostic() const;

  GroupLaunch launch_;
  std::uint32_t thread_count_ = 0;
  std::vector<FiberStack> stacks_;
  std::vector<Fiber> fibers_;
  std::vector<mfa_abi::SimdGroup> simdgroups_;  // operand slots, one per simdgroup
  std::vector<Collective> collectives_;
  std::unique_ptr<unsigned char[], AlignedDelete> threadgroup_memory_;
  std::size_t threadgroup_memory_bytes_ = 0;
  std::array<void*, mfa_abi::kMaxThreadgroupArgs> threadgroup_args_{};
  mfa_abi::GroupContext group_{};

  // Round-robin queue of ready fibers; each fiber is in it at most once.
  std::vector<std::uint32_t> ready_;
  std::uint32_t ready_mask_ = 0;
  std::uint32_t ready_head_ = 0;
  std::uint32_t ready_count_ = 0;

  FiberContext scheduler_context_;
  std::uint32_t current_ = 0;  // the running fiber
  std::uint32_t finished_ = 0;
  const mfa_abi::Site* barrier_site_ = nullptr;  // the pending barrier, null when none
  std::uint32_t barrier_arrived_ = 0;
  std::optional<std::string> failure_;

  // Watchdog for spin-waits: progress counts arrivals and finished threads.
  std::uint64_t progress_ = 0;
  std::uint64_t progress_at_check_ = 0;
  double progress_seen_at_ = 0;  // seconds on the steady clock
  std::uint32_t yields_since_check_ = 0;
  double started_at_ = 0;  // when the group started (loop watchdog), steady clock seconds
  RaceDetector race_detector_;  // used by kernels built with the race detector only
};

}  // namespace mfa::cpu
