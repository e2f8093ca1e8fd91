// The messages a failing threadgroup reports: what went wrong, at which
// sites of the .metal text, and which threads are involved. Only called once
// a group has failed, so clarity beats speed here.
#include <algorithm>
#include <sstream>

#include "scheduler.hpp"

namespace mfa::cpu {
namespace {

std::string site_text(const mfa_abi::Site* site) {
  if (site == nullptr) return "an unknown site";
  std::ostringstream text;
  text << (site->op != nullptr ? site->op : "?") << " at "
       << (site->file != nullptr ? site->file : "?") << ':' << site->line;
  return text.str();
}

// "5" or "0-15, 17, 20-31" for ascending indices.
std::string ranges_text(const std::vector<std::uint32_t>& indices) {
  std::ostringstream text;
  for (std::size_t i = 0; i < indices.size();) {
    std::size_t end = i;
    while (end + 1 < indices.size() && indices[end + 1] == indices[end] + 1) ++end;
    if (i != 0) text << ", ";
    text << indices[i];
    if (end != i) text << '-' << indices[end];
    i = end + 1;
  }
  return text.str();
}

std::string counted(const char* noun, const std::vector<std::uint32_t>& indices) {
  return std::string(noun) + (indices.size() == 1 ? " " : "s ") + ranges_text(indices);
}

std::vector<std::uint32_t> lanes_of(std::uint32_t mask) {
  std::vector<std::uint32_t> lanes;
  for (std::uint32_t lane = 0; lane < mfa_abi::kSimdWidth; ++lane) {
    if (mask & (1u << lane)) lanes.push_back(lane);
  }
  return lanes;
}

std::vector<std::uint32_t> threads_of(std::uint32_t simdgroup, std::uint32_t mask) {
  std::vector<std::uint32_t> threads = lanes_of(mask);
  for (std::uint32_t& lane : threads) lane += simdgroup * mfa_abi::kSimdWidth;
  return threads;
}

std::string lanes_text(std::uint32_t simdgroup, std::uint32_t mask) {
  return counted("lane", lanes_of(mask)) + " of simdgroup " + std::to_string(simdgroup) + " (" +
         counted("thread", threads_of(simdgroup, mask)) + ")";
}

constexpr const char* kSameBarrierRule =
    "every thread of a threadgroup must reach the same threadgroup_barrier";

}  // namespace

std::string GroupScheduler::group_name() const {
  const std::uint32_t* p = group_.threadgroup_position_in_grid;
  std::ostringstream text;
  text << "threadgroup (" << p[0] << ", " << p[1] << ", " << p[2] << ')';
  return text.str();
}

std::string GroupScheduler::thread_name(std::uint32_t thread) const {
  const std::uint32_t* p = fibers_[thread].thread.thread_position_in_threadgroup;
  std::ostringstream text;
  text << "thread (" << p[0] << ", " << p[1] << ", " << p[2] << ')';
  return text.str();
}

std::string GroupScheduler::kernel_failure_diagnostic(const char* message) const {
  return group_name() + ", " + thread_name(current_) + ": " +
         (message != nullptr ? message : "failed");
}

std::string GroupScheduler::exception_diagnostic(const char* what) const {
  return group_name() + ", " + thread_name(current_) + ": a C++ exception " +
         (what != nullptr ? std::string("escaped the kernel: ") + what
                          : std::string("of unknown type escaped the kernel"));
}

std::string GroupScheduler::lanes_diverged_diagnostic(const Collective& collective,
                                                      const mfa_abi::Site* site) const {
  const std::uint32_t simdgroup = current_ / mfa_abi::kSimdWidth;
  const std::uint32_t lane = current_ % mfa_abi::kSimdWidth;
  return group_name() + ": lanes of one simdgroup reached different collectives: " +
         lanes_text(simdgroup, collective.arrived) + " wait at " + site_text(collective.site) +
         ", but " + lanes_text(simdgroup, 1u << lane) + " arrived at " + site_text(site) +
         "; every active lane of a simdgroup must reach the same collective (lane-divergent "
         "collectives cannot run on the cpu backend)";
}

std::string GroupScheduler::inactive_lanes_diagnostic(const mfa_abi::Site* site,
                                                      std::uint32_t simdgroup) const {
  const std::uint32_t size = simdgroups_[simdgroup].size;
  const Collective& collective = collectives_[simdgroup];
  const std::uint32_t returned = collective.existing & ~collective.live;
  std::string reason;
  if (size < mfa_abi::kSimdWidth) {
    reason = "the simdgroup has only " + std::to_string(size) + " threads";
  }
  if (returned != 0) {
    if (!reason.empty()) reason += " and ";
    reason += lanes_text(simdgroup, returned) + " returned";
  }
  return group_name() + ": " + site_text(site) + " needs all 32 lanes of simdgroup " +
         std::to_string(simdgroup) + " active, but " + reason;
}

std::string GroupScheduler::barrier_unreachable_diagnostic(const mfa_abi::Site* site) const {
  std::vector<std::uint32_t> returned, waiting;
  for (std::uint32_t i = 0; i < thread_count_; ++i) {
    if (fibers_[i].state == FiberState::finished) {
      returned.push_back(i);
    } else if (fibers_[i].state == FiberState::at_barrier || i == current_) {
      waiting.push_back(i);
    }
  }
  return group_name() + ": " + site_text(site) + " can never complete: " +
         counted("thread", returned) + " returned without reaching it (" +
         counted("thread", waiting) + " reached it); " + kSameBarrierRule;
}

std::string GroupScheduler::different_barriers_diagnostic(const mfa_abi::Site* site) const {
  std::vector<std::uint32_t> waiting;
  for (std::uint32_t i = 0; i < thread_count_; ++i) {
    if (fibers_[i].state == FiberState::at_barrier) waiting.push_back(i);
  }
  return group_name() + ": threads reached different barriers: " + counted("thread", waiting) +
         " wait at " + site_text(barrier_site_) + ", but " +
         counted("thread", {current_}) + " arrived at " + site_text(site) + "; " +
         kSameBarrierRule;
}

std::string GroupScheduler::no_progress_diagnostic() const {
  std::ostringstream text;
  text << group_name() << ": no progress for " << launch_.no_progress_seconds
       << " s (spin-wait on something that never happens?): " << describe_waiting_threads();
  return text.str();
}

std::string GroupScheduler::watchdog_diagnostic(const mfa_abi::Site* loop) const {
  std::ostringstream text;
  text << group_name() << ", " << thread_name(current_) << ": still running after "
       << launch_.watchdog_seconds << " s (MFA_NATIVE_CPU_WATCHDOG_S), in the loop at "
       << (loop->file != nullptr ? loop->file : "?") << ':' << loop->line
       << " (a loop that never ends? on a GPU the command buffer's watchdog would end it)";
  return text.str();
}

std::string GroupScheduler::threadgroup_memory_place(std::size_t offset) const {
  std::size_t argument = launch_.threadgroup_args;
  while (argument > 0 && launch_.threadgroup_offsets[argument - 1] > offset) --argument;
  if (offset >= launch_.static_base || argument == 0) {
    return "byte " + std::to_string(offset - launch_.static_base) + " of the kernel-scope threadgroup variables";
  }
  return "byte " + std::to_string(offset - launch_.threadgroup_offsets[argument - 1]) + " of [[threadgroup(" +
         std::to_string(argument - 1) + ")]]";
}

std::string GroupScheduler::race_diagnostic(const RaceDetector::Race& race) const {
  auto who = [&](const RaceDetector::Access& access) {
    std::ostringstream text;
    text << thread_name(access.thread) << " (simdgroup " << access.thread / mfa_abi::kSimdWidth << ", lane "
         << access.thread % mfa_abi::kSimdWidth << ") " << (access.writes ? "wrote" : "read") << " it at "
         << (access.file != nullptr ? access.file : "?") << ':' << access.line;
    return text.str();
  };
  const char* kind = race.earlier.writes ? (race.later.writes ? "write-after-write" : "read-after-write")
                                         : "write-after-read";
  return group_name() + ": data race (" + kind + ") on " + threadgroup_memory_place(race.offset) + ": " +
         who(race.earlier) + ", then " + who(race.later) +
         ", with no threadgroup_barrier(mem_flags::mem_threadgroup) between them (nor a simdgroup_barrier "
         "with mem_threadgroup, for lanes of one simdgroup)";
}

std::string GroupScheduler::outside_threadgroup_memory_diagnostic(const void* address, std::size_t bytes,
                                                                  const mfa_abi::Site* site) const {
  std::ostringstream text;
  text << kernel_failure_diagnostic("") << "a threadgroup pointer accesses " << bytes << " bytes at " << address
       << ", outside the threadgroup's " << launch_.dispatch->threadgroup_memory_limit
       << " bytes of threadgroup memory, at " << (site->file != nullptr ? site->file : "?") << ':' << site->line;
  return text.str();
}

std::string GroupScheduler::deadlock_diagnostic() const {
  return group_name() + ": deadlock, every unfinished thread waits and none can continue: " +
         describe_waiting_threads();
}

// "threads 0-15 wait at simd_sum at k.metal:10 (simdgroup 0 still needs
// lanes 16-31); threads 16-63 wait at threadgroup_barrier at k.metal:12; ..."
std::string GroupScheduler::describe_waiting_threads() const {
  struct Wait {
    FiberState state;
    const mfa_abi::Site* site;
    std::uint32_t simdgroup;  // for collectives: the lanes wait for their own simdgroup
    std::vector<std::uint32_t> threads;
  };
  std::vector<Wait> waits;
  for (std::uint32_t i = 0; i < thread_count_; ++i) {
    const Fiber& fiber = fibers_[i];
    const std::uint32_t simdgroup =
        fiber.state == FiberState::at_collective ? i / mfa_abi::kSimdWidth : 0;
    auto same = [&](const Wait& wait) {
      return wait.state == fiber.state && wait.simdgroup == simdgroup &&
             same_site(wait.site, fiber.site);
    };
    auto found = std::find_if(waits.begin(), waits.end(), same);
    if (found == waits.end()) {
      waits.push_back(Wait{fiber.state, fiber.site, simdgroup, {}});
      found = waits.end() - 1;
    }
    found->threads.push_back(i);
  }

  std::string text;
  for (const Wait& wait : waits) {
    if (!text.empty()) text += "; ";
    text += counted("thread", wait.threads);
    switch (wait.state) {
      case FiberState::ready:
        text += wait.site != nullptr ? " yielded last at " + site_text(wait.site)
                                     : std::string(" never ran");
        break;
      case FiberState::at_collective: {
        const Collective& collective = collectives_[wait.simdgroup];
        text += " wait at " + site_text(wait.site) + " (simdgroup " +
                std::to_string(wait.simdgroup) + " still needs " +
                counted("lane", lanes_of(collective.live & ~collective.arrived)) + ")";
        break;
      }
      case FiberState::at_barrier:
        text += " wait at " + site_text(wait.site);
        break;
      case FiberState::finished:
        text += " returned";
        break;
    }
  }
  return text;
}

}  // namespace mfa::cpu
