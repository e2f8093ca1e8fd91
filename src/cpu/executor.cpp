// Runs a launch: checks it, lays out threadgroup memory, and hands out its
// threadgroups to a persistent pool of OS threads (the caller's among them),
// each with its own GroupScheduler. A threadgroup never migrates between OS
// threads. Dispatches from several caller threads run one after another.
#include "executor.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "mfa/errors.hpp"
#include "scheduler.hpp"

namespace mfa::cpu {
namespace {

constexpr std::uint64_t kMaxThreadsPerThreadgroup = 1024;
constexpr std::size_t kThreadgroupArgumentAlignment = 16;
constexpr double kDefaultNoProgressSeconds = 10;
constexpr double kDefaultWatchdogSeconds = 10;
constexpr double kMaxCpuThreads = 1024;  // MFA_NATIVE_CPU_THREADS beyond this is a typo, not a machine

// The value of environment variable `name` if set, which must be a positive
// number (an integer when `integer`).
std::optional<double> positive_number_from_environment(const char* name, bool integer) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (*end != '\0' || !(value > 0) || (integer && value != static_cast<unsigned>(value))) {
    throw ArgumentError(std::string(name) + " must be a positive " +
                        (integer ? "integer" : "number") + ", got '" + text + "'");
  }
  return value;
}

std::string size3_text(const Size3& size) {
  return "(" + std::to_string(size.x) + ", " + std::to_string(size.y) + ", " +
         std::to_string(size.z) + ")";
}

void check_launch(const Launch& launch) {
  if (launch.main == nullptr) {
    throw ArgumentError("launch of kernel '" + launch.kernel + "': main is null");
  }
  const Size3& threads = launch.threads_per_threadgroup;
  if (threads.volume() == 0 || threads.volume() > kMaxThreadsPerThreadgroup) {
    throw ArgumentError("launch of kernel '" + launch.kernel + "': threads_per_threadgroup " +
                        size3_text(threads) + " must have 1 to " +
                        std::to_string(kMaxThreadsPerThreadgroup) + " threads");
  }
  if (launch.threadgroup_memory.size() > mfa_abi::kMaxThreadgroupArgs) {
    throw ArgumentError("launch of kernel '" + launch.kernel + "': " +
                        std::to_string(launch.threadgroup_memory.size()) +
                        " threadgroup memory lengths, at most " +
                        std::to_string(mfa_abi::kMaxThreadgroupArgs) + " expected");
  }
  for (const BufferTraffic& traffic : launch.traffic) {
    if (traffic.index < 0 || traffic.index >= int(mfa_abi::kMaxBuffers)) {
      throw ArgumentError("launch of kernel '" + launch.kernel + "': traffic of buffer(" +
                          std::to_string(traffic.index) + ") asked for");
    }
  }
}

std::size_t round_up(std::size_t bytes, std::size_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

// Places the [[threadgroup(i)]] blocks first, 16-byte aligned; kernel-scope
// threadgroup variables follow. Rejects layouts over the limit.
void lay_out_threadgroup_memory(const Launch& launch, GroupLaunch& group_launch) {
  std::size_t offset = 0;
  std::string parts;
  for (std::size_t i = 0; i < launch.threadgroup_memory.size(); ++i) {
    group_launch.threadgroup_offsets[i] = offset;
    offset += round_up(launch.threadgroup_memory[i], kThreadgroupArgumentAlignment);
    if (!parts.empty()) parts += " + ";
    parts += "[[threadgroup(" + std::to_string(i) + ")]] " +
             std::to_string(launch.threadgroup_memory[i]);
  }
  if (offset > launch.threadgroup_memory_limit) {
    throw DispatchError(launch.kernel,
                        "threadgroup memory of " + std::to_string(offset) + " bytes (" + parts +
                            ", each rounded up to " +
                            std::to_string(kThreadgroupArgumentAlignment) +
                            " bytes) is over the limit of " +
                            std::to_string(launch.threadgroup_memory_limit) + " bytes");
  }
  group_launch.threadgroup_args = launch.threadgroup_memory.size();
  group_launch.static_base = offset;
}

// One dispatch, as every participating OS thread sees it.
struct DispatchJob {
  GroupLaunch group_launch;
  Size3 grid;
  std::atomic<std::uint64_t> next_group{0};
  std::atomic<bool> stop{false};  // a threadgroup failed: take no more

  std::mutex mutex;  // guards the results below
  mfa_abi::Counters counters{};
  std::uint64_t groups_done = 0;
  std::optional<std::string> failure;  // the first diagnostic

  // Runs threadgroups on the calling OS thread until none are left.
  void work(GroupScheduler& scheduler) {
    mfa_abi::Counters counters_here{};
    std::uint64_t groups_here = 0;
    std::optional<std::string> failure_here;
    try {
      scheduler.prepare(group_launch);
      while (!stop.load(std::memory_order_relaxed)) {
        const std::uint64_t group = next_group.fetch_add(1, std::memory_order_relaxed);
        if (group >= grid.volume()) break;
        const std::array<std::uint32_t, 3> position = {
            static_cast<std::uint32_t>(group % grid.x),
            static_cast<std::uint32_t>(group / grid.x % grid.y),
            static_cast<std::uint32_t>(group / (std::uint64_t(grid.x) * grid.y))};
        failure_here = scheduler.run(position, counters_here);
        if (failure_here) break;
        ++groups_here;
      }
    } catch (const std::exception& error) {
      failure_here = error.what();
    } catch (...) {
      failure_here = "an exception of unknown type while running threadgroups";
    }
    std::lock_guard<std::mutex> lock(mutex);
    counters.simdgroup_matrix_ops += counters_here.simdgroup_matrix_ops;
    counters.barriers += counters_here.barriers;
    for (unsigned i = 0; i < mfa_abi::kMaxBuffers; ++i) {
      counters.buffers[i].bytes_read += counters_here.buffers[i].bytes_read;
      counters.buffers[i].bytes_written += counters_here.buffers[i].bytes_written;
    }
    groups_done += groups_here;
    if (failure_here && !failure) failure = std::move(failure_here);
    // Only after recording: groups that see the stop report a failure of
    // their own ("stopped"), which must not come first.
    if (failure_here) stop.store(true, std::memory_order_relaxed);
  }
};

// How long the caller of a dispatch waits for its helpers without sleeping.
constexpr std::chrono::milliseconds kCallerSpin{2};

// Persistent OS threads that join the caller in running a DispatchJob.
class WorkerPool {
 public:
  explicit WorkerPool(unsigned helpers) {
    try {
      for (unsigned i = 0; i < helpers; ++i) threads_.emplace_back([this] { helper_main(); });
    } catch (...) {
      stop_helpers();
      throw;
    }
  }
  ~WorkerPool() { stop_helpers(); }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  unsigned helpers() const { return static_cast<unsigned>(threads_.size()); }

  // Runs `job` on the caller (with `caller_scheduler`) and up to `helpers`
  // pool threads; returns once none of them touches the job any more.
  void run(DispatchJob& job, GroupScheduler& caller_scheduler, unsigned helpers) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      openings_ = helpers;
      ++generation_;
    }
    if (helpers > 0) wake_.notify_all();
    job.work(caller_scheduler);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      openings_ = 0;  // helpers that have not woken yet stay out
      job_ = nullptr;  // those that joined hold their own pointer
    }
    wait_for_helpers();
  }

 private:
  // Returns once no helper runs the job. The caller first watches for up to
  // kCallerSpin (helpers usually finish their last threadgroup within it)
  // and only then sleeps: on a virtual machine a sleeping vCPU gives its
  // core to other work, and the caller came back to caches so cold that a
  // warm decode's host time doubled (bench host, tiny split-KV decode).
  // No pause instruction in the loop: under KVM a pause loop exits to the
  // hypervisor, which is the sleep this avoids.
  void wait_for_helpers() {
    const auto deadline = std::chrono::steady_clock::now() + kCallerSpin;
    while (running_.load(std::memory_order_acquire) != 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_.wait(lock, [this] { return running_ == 0; });
        return;
      }
    }
  }

  void helper_main() {
    GroupScheduler scheduler;  // this thread's fibers, stacks and threadgroup memory
    std::uint64_t joined_generation = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] {
        return stopping_ || (openings_ > 0 && generation_ != joined_generation);
      });
      if (stopping_) return;
      joined_generation = generation_;
      --openings_;
      ++running_;
      DispatchJob* job = job_;
      lock.unlock();
      job->work(scheduler);
      lock.lock();
      if (--running_ == 0) idle_.notify_all();
    }
  }

  void stop_helpers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& thread : threads_) thread.join();
  }

  std::mutex mutex_;
  std::condition_variable wake_;  // a job has openings, or the pool stops
  std::condition_variable idle_;  // no helper runs the job any more
  DispatchJob* job_ = nullptr;
  unsigned openings_ = 0;   // helpers the current job still takes
  std::atomic<unsigned> running_{0};  // helpers inside job->work (changed under mutex_)
  std::uint64_t generation_ = 0;  // one per job, so a helper joins each at most once
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

struct Executor::Impl {
  explicit Impl(unsigned workers) : pool(workers - 1) {}

  std::mutex run_mutex;             // one dispatch at a time
  GroupScheduler caller_scheduler;  // used by the caller's thread under run_mutex
  WorkerPool pool;
};

Executor::Executor(unsigned workers) {
  if (workers == 0) workers = std::max(1u, std::thread::hardware_concurrency());
  impl_ = std::make_unique<Impl>(workers);
}

Executor::~Executor() = default;

namespace {
// The worker count MFA_NATIVE_CPU_THREADS asks for (0: unset), checked.
unsigned workers_from_environment() {
  const std::optional<double> workers = positive_number_from_environment("MFA_NATIVE_CPU_THREADS", true);
  if (workers && *workers > kMaxCpuThreads) {
    throw ArgumentError("MFA_NATIVE_CPU_THREADS must be at most " + std::to_string(static_cast<int>(kMaxCpuThreads)) +
                        ", got '" + std::getenv("MFA_NATIVE_CPU_THREADS") + "'");
  }
  return static_cast<unsigned>(workers.value_or(0));
}
}  // namespace

Executor& Executor::shared() {
  static Executor executor = [] {
    const unsigned workers = workers_from_environment();
    try {
      return Executor(workers);
    } catch (const std::system_error& error) {
      throw ArgumentError("could not start the cpu backend's " + std::to_string(workers) +
                          " worker threads (MFA_NATIVE_CPU_THREADS): " + error.what());
    }
  }();
  return executor;
}

unsigned Executor::workers() const { return impl_->pool.helpers() + 1; }

DispatchStats Executor::run(const Launch& launch) {
  check_launch(launch);
  DispatchJob job;
  job.grid = launch.threadgroups;
  lay_out_threadgroup_memory(launch, job.group_launch);
  job.group_launch.no_progress_seconds =
      positive_number_from_environment("MFA_NATIVE_CPU_TIMEOUT", false)
          .value_or(kDefaultNoProgressSeconds);
  job.group_launch.watchdog_seconds =
      positive_number_from_environment("MFA_NATIVE_CPU_WATCHDOG_S", false)
          .value_or(kDefaultWatchdogSeconds);

  const Size3& threads = launch.threads_per_threadgroup;
  mfa_abi::DispatchContext dispatch{};
  dispatch.runtime = &GroupScheduler::runtime();
  dispatch.buffers = launch.buffers.data();
  dispatch.buffer_sizes = launch.buffer_sizes.data();
  const std::uint32_t grid[3] = {launch.threadgroups.x, launch.threadgroups.y,
                                 launch.threadgroups.z};
  const std::uint32_t block[3] = {threads.x, threads.y, threads.z};
  std::copy(grid, grid + 3, dispatch.threadgroups_per_grid);
  std::copy(block, block + 3, dispatch.threads_per_threadgroup);
  dispatch.simdgroups_per_threadgroup = static_cast<std::uint32_t>(
      (threads.volume() + mfa_abi::kSimdWidth - 1) / mfa_abi::kSimdWidth);
  dispatch.threadgroup_memory_limit = launch.threadgroup_memory_limit;
  std::array<std::size_t, mfa_abi::kMaxThreadgroupArgs> threadgroup_arg_sizes{};
  std::copy(launch.threadgroup_memory.begin(), launch.threadgroup_memory.end(), threadgroup_arg_sizes.begin());
  dispatch.threadgroup_arg_sizes = threadgroup_arg_sizes.data();
  job.group_launch.dispatch = &dispatch;
  job.group_launch.main = launch.main;
  job.group_launch.stop = &job.stop;

  std::lock_guard<std::mutex> lock(impl_->run_mutex);
  const auto start = std::chrono::steady_clock::now();
  const std::uint64_t groups = launch.threadgroups.volume();
  if (groups > 0) {
    const auto helpers = static_cast<unsigned>(
        std::min<std::uint64_t>(impl_->pool.helpers(), groups - 1));
    impl_->pool.run(job, impl_->caller_scheduler, helpers);
  }
  if (job.failure) throw DispatchError(launch.kernel, *job.failure);

  DispatchStats stats;
  stats.kernel = launch.kernel;
  stats.threadgroups = job.groups_done;
  stats.simdgroup_matrix_ops = job.counters.simdgroup_matrix_ops;
  stats.barriers = job.counters.barriers;
  stats.traffic = launch.traffic;
  for (BufferTraffic& traffic : *stats.traffic) {
    traffic.bytes_read = job.counters.buffers[traffic.index].bytes_read;
    traffic.bytes_written = job.counters.buffers[traffic.index].bytes_written;
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

}  // namespace mfa::cpu
