// The contract between a kernel compiled by the cpu backend (MSL text + the
// shim headers, built into a shared object) and the executor that runs it.
//
// Each GPU thread runs as a fiber with its own ThreadState. The kernel side
// (shim + generated glue) reads builtins and bindings from it and calls the
// Runtime for anything that synchronizes. Plain layout, no std types: both
// sides may be built by different compilers.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace mfa_abi {

inline constexpr int kVersion = 5;  // 2: Counters::buffers, 3: Runtime::loop_check, 4: race_access,
                                    // 5: DispatchContext::threadgroup_arg_sizes
inline constexpr unsigned kSimdWidth = 32;
inline constexpr unsigned kSlotBytes = 64;     // the largest operand one lane brings to a collective
inline constexpr unsigned kMaxBuffers = 31;    // [[buffer(0..30)]], as in Metal
inline constexpr unsigned kMaxThreadgroupArgs = 31;

// Where a collective or barrier is called from: lanes match on it, and
// diagnostics print it. file/line come from the #line of the .metal text.
struct Site {
  const char* op;    // "simd_sum", "threadgroup_barrier", ...
  const char* file;
  int line;
  uint32_t orders;   // barriers: kOrdersThreadgroupMemory if they order it (mem_threadgroup), else 0
};

inline constexpr uint32_t kOrdersThreadgroupMemory = 1;

// What a recorded threadgroup-memory access does (Runtime::race_access).
inline constexpr unsigned kAccessRead = 1;
inline constexpr unsigned kAccessWrite = 2;

// Operands exchanged in one simdgroup collective. Each lane writes in[lane]
// before arriving; the lane that computes reads in[] of the active lanes and
// writes out[] of every active lane; each lane reads out[lane] after.
struct SimdGroup {
  alignas(16) unsigned char in[kSimdWidth][kSlotBytes];
  alignas(16) unsigned char out[kSimdWidth][kSlotBytes];
  uint32_t active;  // bit l: lane l exists and has not returned (valid while computing)
  uint32_t size;    // lanes that exist (< 32 only in a partial last simdgroup)
  // simdgroup_barriers with mem_threadgroup completed (the race detector's
  // order among the lanes); counted by the lane that completes one.
  uint64_t ordering_barriers;
};

// Bytes moved through the pointers into one [[buffer(i)]] argument: each
// load or store through a `device T*` / `constant T*` counts sizeof(T);
// compound assignment counts both. Reference arguments (`constant P&`) are
// not counted. Through a writable pointer, members and swizzles of an element
// (p[i].x = v, p->m) do not compile: copy the element, change the copy,
// store it back. mfa_buffer_ptr.h has the full rules.
struct BufferTraffic {
  uint64_t bytes_read;
  uint64_t bytes_written;
};

// Work counted per threadgroup, summed by the executor per dispatch. The
// threads of a group run on one OS thread: plain increments, no atomics.
struct Counters {
  uint64_t simdgroup_matrix_ops;  // 8x8x8 multiply-accumulates, counted once per simdgroup
  uint64_t barriers;              // threadgroup barriers completed (counted once per group)
  BufferTraffic buffers[kMaxBuffers];  // by [[buffer(i)]] index; the glue adds each thread's as it returns
};

struct ThreadState;

struct Runtime {
  // Arrive at a simdgroup collective. Blocks until every active lane of the
  // caller's simdgroup has arrived at the same site; then returns nonzero on
  // exactly one lane, which computes out[] for all and calls simd_release.
  // The other lanes return 0 once released. With `full` set, every one of
  // the 32 lanes must be active (simdgroup_matrix operations), else the
  // dispatch fails with a diagnostic. Lanes at different sites fail too.
  int (*simd_arrive)(ThreadState* thread, const Site* site, int full);
  void (*simd_release)(ThreadState* thread);
  // threadgroup_barrier: blocks until every thread of the group arrived at
  // the same site. Threads that returned, or wait elsewhere, fail the dispatch.
  void (*threadgroup_barrier)(ThreadState* thread, const Site* site);
  // Lets other threads of the group run (atomics call it, so a spin-wait on
  // another thread of the group makes progress).
  void (*yield)(ThreadState* thread, const Site* site);
  // Fails the dispatch with `message` (the executor adds kernel, thread and
  // group). Never returns: the fiber is abandoned.
  void (*fail)(ThreadState* thread, const char* message);
  // The watchdog, called from loops every kLoopIterationsPerCheck
  // iterations with the loop's site (op "loop"): fails the dispatch when the
  // caller's threadgroup has run for longer than the limit, or when another
  // threadgroup of the dispatch failed. Otherwise returns at once.
  void (*loop_check)(ThreadState* thread, const Site* site);
  // The race detector (kernels built with MFA_SHIM_RACE_CHECK): the caller
  // reads and/or writes (kAccess*) `bytes` bytes of threadgroup memory at
  // `address`, at `site`. Fails the dispatch if that races an access of
  // another thread since the last barrier that orders threadgroup memory,
  // or if the bytes are not threadgroup memory. Otherwise records it.
  void (*race_access)(ThreadState* thread, const void* address, size_t bytes, unsigned access,
                      const Site* site);
};

// How often a loop calls Runtime::loop_check: rarely enough that the clock
// read it costs does not show, often enough to stop within microseconds.
inline constexpr unsigned kLoopIterationsPerCheck = 1024;

// Shared by every thread of one dispatch.
struct DispatchContext {
  const Runtime* runtime;
  void* const* buffers;             // [kMaxBuffers]: address of [[buffer(i)]] (offset applied) or null
  const size_t* buffer_sizes;       // [kMaxBuffers]: bytes valid from that address
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t simdgroups_per_threadgroup;
  size_t threadgroup_memory_limit;  // 32 KiB: dynamic + kernel-scope threadgroup memory together
  const size_t* threadgroup_arg_sizes;  // [kMaxThreadgroupArgs]: byte length of [[threadgroup(i)]], 0 if none
};

// Shared by the threads of one threadgroup.
struct GroupContext {
  uint32_t threadgroup_position_in_grid[3];
  unsigned char* threadgroup_memory;  // filled with 0xFF (NaN in every float format) at group start
  void* const* threadgroup_args;      // [kMaxThreadgroupArgs]: address of [[threadgroup(i)]]
  size_t static_base;                 // kernel-scope threadgroup variables start here
  Counters* counters;
};

struct ThreadState {
  const DispatchContext* dispatch;
  GroupContext* group;
  SimdGroup* simd;
  uint32_t thread_position_in_threadgroup[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  // Bump cursor for kernel-scope `threadgroup` variables. Every thread
  // executes the same declarations in the same order, so every thread
  // computes the same offsets; starts at group->static_base.
  size_t static_cursor;
  void* executor;  // opaque to kernels
};

// Static facts about a compiled kernel, exported by its shared object.
struct KernelInfo {
  const char* name;                       // the MSL entry point
  uint32_t argument_bytes[kMaxBuffers];   // sizeof the pointee / referenced type of [[buffer(i)]], 0 if unused
};

// The GPU thread running on this OS thread, inside a kernel shared object.
// Fibers of one OS thread share it: the glue sets it on entry, and every shim
// function that may block sets it again after the runtime call returns.
inline thread_local ThreadState* current_thread = nullptr;

}  // namespace mfa_abi

// Symbols every kernel shared object exports (C linkage):
//   int mfa_kernel_abi_version(void);                       returns mfa_abi::kVersion
//   const mfa_abi::KernelInfo* mfa_kernel_info(void);
//   void mfa_kernel_main(mfa_abi::ThreadState* thread);     runs one GPU thread to completion
