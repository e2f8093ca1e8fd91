// The hot path: every collective arrival and barrier goes through here
// (about 10^6 per attention dispatch), so it allocates nothing, takes no lock
// and costs one fiber switch per blocked thread.
#include "scheduler.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <new>
#include <utility>

namespace mfa::cpu {
namespace {

constexpr std::size_t kFiberStackBytes = 256 * 1024;  // virtual; kernels use a few KB
constexpr std::size_t kThreadgroupMemoryAlignment = 64;
constexpr std::uint32_t kYieldsPerProgressCheck = 1024;
constexpr unsigned char kPoison = 0xFF;  // NaN in float, half and bfloat

std::uint32_t lane_bit(std::uint32_t thread) { return 1u << (thread % mfa_abi::kSimdWidth); }

std::uint32_t lowest_lane(std::uint32_t lanes) {
  return static_cast<std::uint32_t>(__builtin_ctz(lanes));
}

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A sanitize="address" kernel poisons a redzone after each threadgroup
// variable (mfa_memory.h); the ASan runtime, when loaded, unpoisons the block
// before each group refills it. The core itself is not built with ASan.
void unpoison_threadgroup_memory(unsigned char* memory, std::size_t bytes) {
  using Unpoison = void (*)(const volatile void*, std::size_t);
  static const auto unpoison = reinterpret_cast<Unpoison>(dlsym(RTLD_DEFAULT, "__asan_unpoison_memory_region"));
  if (unpoison) unpoison(memory, bytes);
}

}  // namespace

void GroupScheduler::AlignedDelete::operator()(unsigned char* memory) const {
  ::operator delete[](memory, std::align_val_t(kThreadgroupMemoryAlignment));
}

GroupScheduler::GroupScheduler() = default;
GroupScheduler::~GroupScheduler() = default;

const mfa_abi::Runtime& GroupScheduler::runtime() {
  static const mfa_abi::Runtime table = {
      [](mfa_abi::ThreadState* thread, const mfa_abi::Site* site, int full) {
        return static_cast<GroupScheduler*>(thread->executor)->simd_arrive(site, full != 0);
      },
      [](mfa_abi::ThreadState* thread) {
        static_cast<GroupScheduler*>(thread->executor)->simd_release();
      },
      [](mfa_abi::ThreadState* thread, const mfa_abi::Site* site) {
        static_cast<GroupScheduler*>(thread->executor)->threadgroup_barrier(site);
      },
      [](mfa_abi::ThreadState* thread, const mfa_abi::Site* site) {
        static_cast<GroupScheduler*>(thread->executor)->yield(site);
      },
      [](mfa_abi::ThreadState* thread, const char* message) {
        auto& scheduler = *static_cast<GroupScheduler*>(thread->executor);
        scheduler.abandon_current_thread(scheduler.kernel_failure_diagnostic(message));
      },
      [](mfa_abi::ThreadState* thread, const mfa_abi::Site* site) {
        static_cast<GroupScheduler*>(thread->executor)->loop_check(site);
      },
      [](mfa_abi::ThreadState* thread, const void* address, std::size_t bytes, unsigned access,
         const mfa_abi::Site* site) {
        static_cast<GroupScheduler*>(thread->executor)->race_access(address, bytes, access, site);
      },
  };
  return table;
}

void GroupScheduler::prepare(const GroupLaunch& launch) {
  launch_ = launch;
  const mfa_abi::DispatchContext& dispatch = *launch.dispatch;
  const std::uint32_t width = dispatch.threads_per_threadgroup[0];
  const std::uint32_t height = dispatch.threads_per_threadgroup[1];
  thread_count_ = width * height * dispatch.threads_per_threadgroup[2];

  while (stacks_.size() < thread_count_) stacks_.emplace_back(kFiberStackBytes);
  fibers_.resize(thread_count_);
  const std::uint32_t simdgroup_count =
      (thread_count_ + mfa_abi::kSimdWidth - 1) / mfa_abi::kSimdWidth;
  simdgroups_.resize(simdgroup_count);
  collectives_.resize(simdgroup_count);
  for (std::uint32_t s = 0; s < simdgroup_count; ++s) {
    const std::uint32_t size =
        std::min(mfa_abi::kSimdWidth, thread_count_ - s * mfa_abi::kSimdWidth);
    simdgroups_[s].size = size;
    collectives_[s] = Collective{};
    collectives_[s].existing = size == mfa_abi::kSimdWidth ? ~0u : (1u << size) - 1;
  }

  std::uint32_t queue_capacity = 1;
  while (queue_capacity < thread_count_) queue_capacity *= 2;
  ready_.resize(queue_capacity);
  ready_mask_ = queue_capacity - 1;

  const std::size_t memory_bytes = std::max<std::size_t>(dispatch.threadgroup_memory_limit, 1);
  if (memory_bytes > threadgroup_memory_bytes_) {
    threadgroup_memory_.reset(static_cast<unsigned char*>(
        ::operator new[](memory_bytes, std::align_val_t(kThreadgroupMemoryAlignment))));
    threadgroup_memory_bytes_ = memory_bytes;
  }
  threadgroup_args_.fill(nullptr);
  for (std::size_t i = 0; i < launch.threadgroup_args; ++i) {
    threadgroup_args_[i] = threadgroup_memory_.get() + launch.threadgroup_offsets[i];
  }
  group_.threadgroup_memory = threadgroup_memory_.get();
  group_.threadgroup_args = threadgroup_args_.data();
  group_.static_base = launch.static_base;

  for (std::uint32_t i = 0; i < thread_count_; ++i) {
    mfa_abi::ThreadState& thread = fibers_[i].thread;
    thread = mfa_abi::ThreadState{};
    thread.dispatch = launch.dispatch;
    thread.group = &group_;
    thread.simd = &simdgroups_[i / mfa_abi::kSimdWidth];
    thread.thread_position_in_threadgroup[0] = i % width;
    thread.thread_position_in_threadgroup[1] = i / width % height;
    thread.thread_position_in_threadgroup[2] = i / (width * height);
    thread.thread_index_in_threadgroup = i;
    thread.simdgroup_index_in_threadgroup = i / mfa_abi::kSimdWidth;
    thread.thread_index_in_simdgroup = i % mfa_abi::kSimdWidth;
    thread.executor = this;
  }
}

std::optional<std::string> GroupScheduler::run(const std::array<std::uint32_t, 3>& position,
                                               mfa_abi::Counters& counters) {
  std::copy(position.begin(), position.end(), group_.threadgroup_position_in_grid);
  group_.counters = &counters;
  unpoison_threadgroup_memory(threadgroup_memory_.get(), launch_.dispatch->threadgroup_memory_limit);
  std::memset(threadgroup_memory_.get(), kPoison, launch_.dispatch->threadgroup_memory_limit);

  finished_ = 0;
  barrier_site_ = nullptr;
  barrier_arrived_ = 0;
  failure_.reset();
  progress_ = 0;
  progress_at_check_ = ~std::uint64_t(0);  // the first check starts the clock
  yields_since_check_ = 0;
  started_at_ = steady_seconds();
  race_detector_.begin_group(simdgroups_.data(), launch_.dispatch->threadgroup_memory_limit);
  for (Collective& collective : collectives_) {
    collective.site = nullptr;
    collective.arrived = 0;
    collective.live = collective.existing;
    collective.releasing = 0;
  }
  ready_head_ = 0;
  ready_count_ = 0;
  for (std::uint32_t i = 0; i < thread_count_; ++i) {
    Fiber& fiber = fibers_[i];
    fiber.thread.static_cursor = launch_.static_base;
    fiber.site = nullptr;
    fiber.arrive_result = 0;
    prepare_fiber(fiber.context, stacks_[i], &GroupScheduler::fiber_entry, this);
    make_ready(i);
  }

  // Round-robin until nothing is ready. A failure empties the queue.
  while (ready_count_ != 0) {
    current_ = next_ready();
    switch_fiber(scheduler_context_, fibers_[current_].context);
  }
  if (failure_) return std::exchange(failure_, std::nullopt);
  if (finished_ != thread_count_) return deadlock_diagnostic();
  return std::nullopt;
}

void GroupScheduler::make_ready(std::uint32_t thread) {
  fibers_[thread].state = FiberState::ready;
  ready_[(ready_head_ + ready_count_) & ready_mask_] = thread;
  ++ready_count_;
}

std::uint32_t GroupScheduler::next_ready() {
  const std::uint32_t thread = ready_[ready_head_];
  ready_head_ = (ready_head_ + 1) & ready_mask_;
  --ready_count_;
  return thread;
}

// Switches straight to the next ready fiber: one switch per blocked thread
// instead of two through the scheduler loop, which matters because every
// lane of a simdgroup blocks at every collective. Back to the loop only when
// nothing is ready (it then reports completion or a deadlock).
void GroupScheduler::suspend_current() {
  Fiber& fiber = fibers_[current_];
  if (ready_count_ == 0) {
    switch_fiber(fiber.context, scheduler_context_);
    return;
  }
  const std::uint32_t next = next_ready();
  if (next == current_) return;  // a yield with nothing else to run
  current_ = next;
  switch_fiber(fiber.context, fibers_[next].context);
}

int GroupScheduler::simd_arrive(const mfa_abi::Site* site, bool full) {
  const std::uint32_t simdgroup = current_ / mfa_abi::kSimdWidth;
  Collective& collective = collectives_[simdgroup];
  ++progress_;
  if (collective.arrived == 0) {
    collective.site = site;
    collective.full = full;
  } else if (!same_site(collective.site, site)) {
    abandon_current_thread(lanes_diverged_diagnostic(collective, site));
  }
  if (full && collective.live != ~0u) {
    abandon_current_thread(inactive_lanes_diagnostic(site, simdgroup));
  }
  collective.arrived |= lane_bit(current_);
  if (collective.arrived == collective.live) {
    // The last lane to arrive computes for all, without a switch.
    complete_collective(simdgroup, current_ % mfa_abi::kSimdWidth);
    return 1;
  }
  Fiber& fiber = fibers_[current_];
  fiber.state = FiberState::at_collective;
  fiber.site = site;
  fiber.arrive_result = 0;
  suspend_current();
  return fiber.arrive_result;
}

void GroupScheduler::complete_collective(std::uint32_t simdgroup, std::uint32_t computing_lane) {
  Collective& collective = collectives_[simdgroup];
  simdgroups_[simdgroup].active = collective.live;
  collective.releasing = collective.arrived & ~(1u << computing_lane);
  collective.arrived = 0;
  collective.site = nullptr;
}

void GroupScheduler::simd_release() {
  const std::uint32_t simdgroup = current_ / mfa_abi::kSimdWidth;
  std::uint32_t lanes = std::exchange(collectives_[simdgroup].releasing, 0);
  const std::uint32_t first_thread = simdgroup * mfa_abi::kSimdWidth;
  while (lanes != 0) {
    make_ready(first_thread + lowest_lane(lanes));
    lanes &= lanes - 1;
  }
}

void GroupScheduler::threadgroup_barrier(const mfa_abi::Site* site) {
  ++progress_;
  if (barrier_arrived_ == 0) {
    if (finished_ != 0) abandon_current_thread(barrier_unreachable_diagnostic(site));
    barrier_site_ = site;
  } else if (!same_site(barrier_site_, site)) {
    abandon_current_thread(different_barriers_diagnostic(site));
  }
  if (++barrier_arrived_ == thread_count_) {
    // Every other thread waits here: release them all, in index order.
    barrier_arrived_ = 0;
    barrier_site_ = nullptr;
    ++group_.counters->barriers;
    if (site->orders & mfa_abi::kOrdersThreadgroupMemory) race_detector_.threadgroup_barrier();
    for (std::uint32_t i = 0; i < thread_count_; ++i) {
      if (i != current_) make_ready(i);
    }
    return;
  }
  Fiber& fiber = fibers_[current_];
  fiber.state = FiberState::at_barrier;
  fiber.site = site;
  suspend_current();
}

void GroupScheduler::yield(const mfa_abi::Site* site) {
  Fiber& fiber = fibers_[current_];
  fiber.site = site;
  if (++yields_since_check_ == kYieldsPerProgressCheck) check_progress();
  make_ready(current_);
  suspend_current();
}

// A loop whose group has run too long fails wherever it is: with or
// without barriers and collectives in it, the loop may never end.
void GroupScheduler::loop_check(const mfa_abi::Site* site) {
  check_stop();
  if (steady_seconds() - started_at_ >= launch_.watchdog_seconds) {
    abandon_current_thread(watchdog_diagnostic(site));
  }
}

void GroupScheduler::race_access(const void* address, std::size_t bytes, unsigned access,
                                 const mfa_abi::Site* site) {
  const auto begin = reinterpret_cast<std::uintptr_t>(threadgroup_memory_.get());
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  const std::size_t limit = launch_.dispatch->threadgroup_memory_limit;
  if (at < begin || at - begin > limit || bytes > limit - (at - begin)) {
    abandon_current_thread(outside_threadgroup_memory_diagnostic(address, bytes, site));
  }
  const std::optional<RaceDetector::Race> race =
      race_detector_.access(at - begin, bytes, (access & mfa_abi::kAccessRead) != 0,
                            (access & mfa_abi::kAccessWrite) != 0, current_, site->file, site->line);
  if (race) abandon_current_thread(race_diagnostic(*race));
}

void GroupScheduler::check_stop() {
  if (launch_.stop != nullptr && launch_.stop->load(std::memory_order_relaxed)) {
    abandon_current_thread("stopped because another threadgroup failed");
  }
}

void GroupScheduler::check_progress() {
  yields_since_check_ = 0;
  check_stop();
  const double now = steady_seconds();
  if (progress_ != progress_at_check_) {
    progress_at_check_ = progress_;
    progress_seen_at_ = now;
  } else if (now - progress_seen_at_ >= launch_.no_progress_seconds) {
    abandon_current_thread(no_progress_diagnostic());
  }
}

void GroupScheduler::fiber_entry(void* scheduler) {
  static_cast<GroupScheduler*>(scheduler)->run_current_thread();
}

void GroupScheduler::run_current_thread() {
  std::string escaped = run_kernel_on_current_thread();
  if (!escaped.empty()) abandon_current_thread(std::move(escaped));
  finish_current_thread();
}

std::string GroupScheduler::run_kernel_on_current_thread() {
  // The handlers only build the message: switching away inside a catch
  // block would leave the exception live on this OS thread.
  try {
    launch_.main(&fibers_[current_].thread);
  } catch (const std::exception& error) {
    return exception_diagnostic(error.what());
  } catch (...) {
    return exception_diagnostic(nullptr);
  }
  return std::string();
}

void GroupScheduler::finish_current_thread() {
  ++progress_;
  ++finished_;
  Fiber& fiber = fibers_[current_];
  fiber.state = FiberState::finished;
  if (barrier_arrived_ != 0) {
    abandon_current_thread(barrier_unreachable_diagnostic(barrier_site_));
  }

  // The lanes still waiting at a collective may be all that is left of the
  // simdgroup: then one of them computes.
  const std::uint32_t simdgroup = current_ / mfa_abi::kSimdWidth;
  Collective& collective = collectives_[simdgroup];
  collective.live &= ~lane_bit(current_);
  if (collective.arrived != 0) {
    if (collective.full) {
      abandon_current_thread(inactive_lanes_diagnostic(collective.site, simdgroup));
    }
    if (collective.arrived == collective.live) {
      const std::uint32_t computing_lane = lowest_lane(collective.arrived);
      const std::uint32_t computing_thread = simdgroup * mfa_abi::kSimdWidth + computing_lane;
      complete_collective(simdgroup, computing_lane);
      fibers_[computing_thread].arrive_result = 1;
      make_ready(computing_thread);
    }
  }
  switch_fiber(fiber.context, scheduler_context_);
  std::abort();  // a finished fiber is never resumed
}

void GroupScheduler::abandon_current_thread(std::string diagnostic) {
  failure_ = std::move(diagnostic);
  ready_count_ = 0;  // stops the scheduler loop
  switch_fiber(fibers_[current_].context, scheduler_context_);
  std::abort();  // an abandoned fiber is never resumed
}

}  // namespace mfa::cpu
