// The cpu backend's fiber executor, driven by hand-written kernels that call
// the runtime the way the shim and the generated glue do.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <initializer_list>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "executor.hpp"
#include "fiber.hpp"
#include "fiber_asm.hpp"
#include "mfa/errors.hpp"

namespace mfa::cpu {
namespace {

using mfa_abi::Site;
using mfa_abi::ThreadState;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------------------
// Kernel-side helpers, following the protocol of mfa_kernel_abi.h.

template <class T>
T* buffer(ThreadState* thread, int index) {
  return static_cast<T*>(thread->dispatch->buffers[index]);
}

const mfa_abi::Runtime& runtime(ThreadState* thread) { return *thread->dispatch->runtime; }

std::uint32_t threads_per_group(const ThreadState* thread) {
  const std::uint32_t* size = thread->dispatch->threads_per_threadgroup;
  return size[0] * size[1] * size[2];
}

std::uint32_t group_index(const ThreadState* thread) {
  const std::uint32_t* position = thread->group->threadgroup_position_in_grid;
  const std::uint32_t* grid = thread->dispatch->threadgroups_per_grid;
  return position[0] + grid[0] * (position[1] + grid[1] * position[2]);
}

std::uint32_t global_index(const ThreadState* thread) {
  return group_index(thread) * threads_per_group(thread) + thread->thread_index_in_threadgroup;
}

// simd_sum as the shim writes it: every lane posts its operand in in[], the
// last to arrive sums the active lanes into out[]. Each call makes its own
// Site, so lanes must match on its content, not its address.
float simd_sum(ThreadState* thread, float value, int line) {
  const Site site{"simd_sum", "kernel.metal", line, 0};
  mfa_abi::SimdGroup& simd = *thread->simd;
  const std::uint32_t lane = thread->thread_index_in_simdgroup;
  std::memcpy(simd.in[lane], &value, sizeof value);
  if (runtime(thread).simd_arrive(thread, &site, 0)) {
    float sum = 0;
    for (std::uint32_t l = 0; l < mfa_abi::kSimdWidth; ++l) {
      if (!(simd.active & (1u << l))) continue;
      float operand;
      std::memcpy(&operand, simd.in[l], sizeof operand);
      sum += operand;
    }
    for (std::uint32_t l = 0; l < mfa_abi::kSimdWidth; ++l) {
      if (simd.active & (1u << l)) std::memcpy(simd.out[l], &sum, sizeof sum);
    }
    runtime(thread).simd_release(thread);
  }
  float result;
  std::memcpy(&result, simd.out[lane], sizeof result);
  return result;
}

// A collective that needs all 32 lanes, counted once per simdgroup like
// simdgroup_multiply_accumulate.
void matrix_op(ThreadState* thread, int line) {
  const Site site{"simdgroup_multiply_accumulate", "kernel.metal", line, 0};
  if (runtime(thread).simd_arrive(thread, &site, 1)) {
    ++thread->group->counters->simdgroup_matrix_ops;
    runtime(thread).simd_release(thread);
  }
}

void barrier(ThreadState* thread, int line) {
  const Site site{"threadgroup_barrier", "kernel.metal", line, mfa_abi::kOrdersThreadgroupMemory};
  runtime(thread).threadgroup_barrier(thread, &site);
}

void yield(ThreadState* thread, int line) {
  const Site site{"atomic_load", "kernel.metal", line, 0};
  runtime(thread).yield(thread, &site);
}

// The address of `object`, hidden from the optimizer (which would otherwise
// fold alignment checks of locals to true).
std::uintptr_t opaque_address(const void* object) {
  auto address = reinterpret_cast<std::uintptr_t>(object);
  asm volatile("" : "+r"(address));
  return address;
}

std::uint64_t os_thread_id() { return std::hash<std::thread::id>()(std::this_thread::get_id()); }

// ---------------------------------------------------------------------------
// Host-side helpers.

Launch make_launch(const char* name, KernelMain main, Size3 groups, Size3 threads) {
  Launch launch;
  launch.kernel = name;
  launch.main = main;
  launch.threadgroups = groups;
  launch.threads_per_threadgroup = threads;
  return launch;
}

// Binds [[buffer(index)]]; kernels only read buffers bound const.
template <class T>
void bind_buffer(Launch& launch, int index, const std::vector<T>& data) {
  launch.buffers[index] = const_cast<T*>(data.data());
  launch.buffer_sizes[index] = data.size() * sizeof(T);
}

std::mt19937 fresh_rng() {
  const unsigned seed = std::random_device()();
  std::printf("[ seed     ] %u\n", seed);
  return std::mt19937(seed);
}

std::vector<float> random_floats(std::size_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& value : values) value = uniform(rng);
  return values;
}

Executor& test_executor() {
  static Executor executor(2);
  return executor;
}

// Runs `launch` expecting a DispatchError and returns its message (empty if
// none). A dispatch that hangs cannot be stopped: exit rather than hang.
std::string dispatch_error(Executor& executor, const Launch& launch) {
  auto outcome = std::async(std::launch::async, [&]() -> std::string {
    try {
      executor.run(launch);
    } catch (const DispatchError& error) {
      return error.what();
    }
    return std::string();
  });
  if (outcome.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "FATAL: the dispatch of '%s' hung\n", launch.kernel.c_str());
    std::_Exit(1);
  }
  return outcome.get();
}

void expect_contains(const std::string& text, std::initializer_list<const char*> parts) {
  std::printf("[ message  ] %s\n", text.c_str());
  EXPECT_FALSE(text.empty()) << "expected a DispatchError";
  for (const char* part : parts) {
    EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
  }
}

// ---------------------------------------------------------------------------
// Fibers.

TEST(Fiber, ImplementationMatchesTheBuild) {
#if defined(MFA_FIBER_USES_UCONTEXT)
  EXPECT_STREQ(fiber_switch_implementation(), "ucontext");
#elif defined(__x86_64__)
  EXPECT_STREQ(fiber_switch_implementation(), "x86_64-asm");
#else
  EXPECT_STREQ(fiber_switch_implementation(), "aarch64-asm");
#endif
}

TEST(Fiber, MeasuresContextSwitchesPerSecond) {
  const double rate = measure_context_switches_per_second(1000000);
  std::printf("[ measured ] %.3g context switches/s (%s)\n", rate, fiber_switch_implementation());
  EXPECT_GT(rate, 0.0);
}

struct AlignmentProbe {
  FiberContext caller;
  FiberContext fiber;
  std::uintptr_t local_address = 1;
};

void record_local_alignment(void* argument) {
  auto& probe = *static_cast<AlignmentProbe*>(argument);
  alignas(16) unsigned char local[16] = {};
  probe.local_address = opaque_address(local);
  switch_fiber(probe.fiber, probe.caller);
}

TEST(Fiber, FreshStackMeetsTheCallingConvention) {
  // A 16-byte aligned local lands on a 16-byte boundary only if the stack
  // pointer at the entry is what the ABI promises (8 mod 16 on x86-64).
  FiberStack stack(64 * 1024);
  AlignmentProbe probe;
  prepare_fiber(probe.fiber, stack, &record_local_alignment, &probe);
  switch_fiber(probe.caller, probe.fiber);
  EXPECT_EQ(probe.local_address % 16, 0u);
}

// The floating-point control state a switch must carry: MXCSR and the x87
// control word on x86-64, FPCR on AArch64.
struct FloatControl {
  unsigned sse = 0;  // MXCSR or FPCR
  unsigned x87 = 0;
};

void expect_float_control(const FloatControl& actual, const FloatControl& expected,
                          const char* seen_by) {
  EXPECT_EQ(actual.sse, expected.sse) << std::hex << "MXCSR/FPCR seen by " << seen_by;
  EXPECT_EQ(actual.x87, expected.x87) << std::hex << "x87 control word seen by " << seen_by;
}

FloatControl read_float_control() {
  FloatControl control;
#if defined(__x86_64__)
  control.sse = _mm_getcsr();
  std::uint16_t word;
  asm volatile("fnstcw %0" : "=m"(word));
  control.x87 = word;
#elif defined(__aarch64__)
  std::uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  control.sse = static_cast<unsigned>(fpcr);
#endif
  return control;
}

void write_float_control(const FloatControl& control) {
#if defined(__x86_64__)
  _mm_setcsr(control.sse);
  const auto word = static_cast<std::uint16_t>(control.x87);
  asm volatile("fldcw %0" : : "m"(word));
#elif defined(__aarch64__)
  asm volatile("msr fpcr, %0" : : "r"(std::uint64_t(control.sse)));
#else
  (void)control;
#endif
}

#if defined(__x86_64__)
const FloatControl kCallerControl = {0x7F80, 0x0F7F};  // round toward zero (SSE and x87)
const FloatControl kFiberControl = {0x9FC0, 0x027F};   // flush denormals; 53-bit x87 precision
#elif defined(__aarch64__)
const FloatControl kCallerControl = {0x00C00000, 0};  // round toward zero
const FloatControl kFiberControl = {0x01000000, 0};   // flush denormals
#else
const FloatControl kCallerControl = {};
const FloatControl kFiberControl = {};
#endif

struct FloatControlProbe {
  FiberContext caller;
  FiberContext fiber;
  FloatControl seen_by_fiber;
};

void keep_own_float_control(void* argument) {
  auto& probe = *static_cast<FloatControlProbe*>(argument);
  write_float_control(kFiberControl);
  switch_fiber(probe.fiber, probe.caller);
  probe.seen_by_fiber = read_float_control();
  switch_fiber(probe.fiber, probe.caller);
}

TEST(Fiber, SwitchPreservesFloatingPointControlOnBothSides) {
  const FloatControl original = read_float_control();
  FiberStack stack(64 * 1024);
  FloatControlProbe probe;
  prepare_fiber(probe.fiber, stack, &keep_own_float_control, &probe);
  write_float_control(kCallerControl);
  switch_fiber(probe.caller, probe.fiber);  // the fiber sets its own mode
  const FloatControl caller_after_first = read_float_control();
  switch_fiber(probe.caller, probe.fiber);  // the fiber reads its mode back
  const FloatControl caller_after_second = read_float_control();
  write_float_control(original);
  expect_float_control(caller_after_first, kCallerControl, "the caller after the first switch");
  expect_float_control(caller_after_second, kCallerControl, "the caller after the second switch");
  expect_float_control(probe.seen_by_fiber, kFiberControl, "the fiber when resumed");
}

// Calls mfa_fiber_switch directly, bypassing the sanitizer annotations.
#if !defined(MFA_FIBER_USES_UCONTEXT) && !defined(MFA_FIBER_SANITIZERS) && \
    (defined(__x86_64__) || defined(__aarch64__))

// record_registers_across_switch(save, resume, out) fills every callee-saved
// register with a known pattern, calls mfa_fiber_switch and stores what the
// registers hold once resumed. clobber_registers_and_switch(save, resume)
// fills them with ones and switches back. Both keep their caller's values.
extern "C" void record_registers_across_switch(void** save, void* resume, std::uint64_t* out);
extern "C" void clobber_registers_and_switch(void** save, void* resume);

#if defined(__x86_64__)
// rbx, rbp, r12, r13, r14, r15
const std::vector<std::uint64_t> kRegisterPatterns = {
    0x1111111111111111, 0x2222222222222222, 0x3333333333333333,
    0x4444444444444444, 0x5555555555555555, 0x6666666666666666};
asm(MFA_ASM_FUNCTION_BEGIN("record_registers_across_switch")
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  pushq %rdx\n"
    "  movabsq $0x1111111111111111, %rbx\n"
    "  movabsq $0x2222222222222222, %rbp\n"
    "  movabsq $0x3333333333333333, %r12\n"
    "  movabsq $0x4444444444444444, %r13\n"
    "  movabsq $0x5555555555555555, %r14\n"
    "  movabsq $0x6666666666666666, %r15\n"
    "  call " MFA_ASM_SYMBOL("mfa_fiber_switch") "\n"
    "  popq %rdx\n"
    "  movq %rbx, 0(%rdx)\n  movq %rbp, 8(%rdx)\n  movq %r12, 16(%rdx)\n"
    "  movq %r13, 24(%rdx)\n  movq %r14, 32(%rdx)\n  movq %r15, 40(%rdx)\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    MFA_ASM_FUNCTION_END("record_registers_across_switch")
    MFA_ASM_FUNCTION_BEGIN("clobber_registers_and_switch")
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  movq $-1, %rbx\n  movq $-1, %rbp\n  movq $-1, %r12\n"
    "  movq $-1, %r13\n  movq $-1, %r14\n  movq $-1, %r15\n"
    "  call " MFA_ASM_SYMBOL("mfa_fiber_switch") "\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    MFA_ASM_FUNCTION_END("clobber_registers_and_switch"));
#else
// x19..x29, then the bits of d8..d15
const std::vector<std::uint64_t> kRegisterPatterns = {19,  20,  21,  22,  23,  24,  25,
                                                      26,  27,  28,  29,  108, 109, 110,
                                                      111, 112, 113, 114, 115};
asm(MFA_ASM_FUNCTION_BEGIN("record_registers_across_switch")
    "  sub sp, sp, #176\n"
    "  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n  stp x27, x28, [sp, #64]\n  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n  stp d12, d13, [sp, #128]\n"
    "  stp d14, d15, [sp, #144]\n  str x2, [sp, #160]\n"
    "  mov x19, #19\n  mov x20, #20\n  mov x21, #21\n  mov x22, #22\n  mov x23, #23\n"
    "  mov x24, #24\n  mov x25, #25\n  mov x26, #26\n  mov x27, #27\n  mov x28, #28\n"
    "  mov x29, #29\n"
    "  mov x9, #108\n  fmov d8, x9\n  mov x9, #109\n  fmov d9, x9\n"
    "  mov x9, #110\n  fmov d10, x9\n  mov x9, #111\n  fmov d11, x9\n"
    "  mov x9, #112\n  fmov d12, x9\n  mov x9, #113\n  fmov d13, x9\n"
    "  mov x9, #114\n  fmov d14, x9\n  mov x9, #115\n  fmov d15, x9\n"
    "  bl " MFA_ASM_SYMBOL("mfa_fiber_switch") "\n"
    "  ldr x2, [sp, #160]\n"
    "  stp x19, x20, [x2, #0]\n  stp x21, x22, [x2, #16]\n  stp x23, x24, [x2, #32]\n"
    "  stp x25, x26, [x2, #48]\n  stp x27, x28, [x2, #64]\n  str x29, [x2, #80]\n"
    "  str d8, [x2, #88]\n  str d9, [x2, #96]\n  str d10, [x2, #104]\n  str d11, [x2, #112]\n"
    "  str d12, [x2, #120]\n  str d13, [x2, #128]\n  str d14, [x2, #136]\n"
    "  str d15, [x2, #144]\n"
    "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n  ldp d12, d13, [sp, #128]\n"
    "  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #176\n"
    "  ret\n"
    MFA_ASM_FUNCTION_END("record_registers_across_switch")
    MFA_ASM_FUNCTION_BEGIN("clobber_registers_and_switch")
    "  sub sp, sp, #176\n"
    "  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n  stp x27, x28, [sp, #64]\n  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n  stp d12, d13, [sp, #128]\n"
    "  stp d14, d15, [sp, #144]\n"
    "  mov x19, #-1\n  mov x20, #-1\n  mov x21, #-1\n  mov x22, #-1\n  mov x23, #-1\n"
    "  mov x24, #-1\n  mov x25, #-1\n  mov x26, #-1\n  mov x27, #-1\n  mov x28, #-1\n"
    "  mov x29, #-1\n  fmov d8, x19\n  fmov d9, x19\n  fmov d10, x19\n  fmov d11, x19\n"
    "  fmov d12, x19\n  fmov d13, x19\n  fmov d14, x19\n  fmov d15, x19\n"
    "  bl " MFA_ASM_SYMBOL("mfa_fiber_switch") "\n"
    "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n  ldp d12, d13, [sp, #128]\n"
    "  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #176\n"
    "  ret\n"
    MFA_ASM_FUNCTION_END("clobber_registers_and_switch"));
#endif

struct RegisterProbe {
  FiberContext caller;
  FiberContext fiber;
};

void clobber_forever(void* argument) {
  auto& probe = *static_cast<RegisterProbe*>(argument);
  for (;;) clobber_registers_and_switch(&probe.fiber.stack_pointer, probe.caller.stack_pointer);
}

TEST(Fiber, SwitchPreservesCalleeSavedRegisters) {
  FiberStack stack(64 * 1024);
  RegisterProbe probe;
  prepare_fiber(probe.fiber, stack, &clobber_forever, &probe);
  for (int round = 0; round < 2; ++round) {  // the fiber's first run, then a resumed one
    std::vector<std::uint64_t> seen(kRegisterPatterns.size(), 0);
    record_registers_across_switch(&probe.caller.stack_pointer, probe.fiber.stack_pointer,
                                   seen.data());
    EXPECT_EQ(seen, kRegisterPatterns) << "round " << round;
  }
}

#endif

int recurse_deeply(int depth) {
  volatile char frame[1024];
  frame[0] = static_cast<char>(depth);
  if (depth == std::numeric_limits<int>::max()) return 0;
  return recurse_deeply(depth + 1) + frame[0];
}

void overflow_the_stack(void*) { std::exit(recurse_deeply(0)); }

TEST(FiberDeathTest, StackOverflowHitsTheGuardPage) {
  auto overflow = [] {
    FiberStack stack(64 * 1024);
    AlignmentProbe probe;
    prepare_fiber(probe.fiber, stack, &overflow_the_stack, nullptr);
    switch_fiber(probe.caller, probe.fiber);
  };
  EXPECT_DEATH(overflow(), "");  // SIGSEGV (AddressSanitizer reports it and exits)
}

// ---------------------------------------------------------------------------
// Threads, builtins and collectives.

struct ThreadRecord {
  std::uint32_t runs;
  std::uint32_t position[3];
  std::uint32_t index;
  std::uint32_t simdgroup;
  std::uint32_t lane;
  std::uint32_t simd_size;
  std::uint32_t group[3];
  std::uint32_t simdgroups_per_threadgroup;
  std::uint32_t stack_aligned;
};

void record_builtins(ThreadState* thread) {
  ThreadRecord& record = buffer<ThreadRecord>(thread, 0)[global_index(thread)];
  alignas(16) unsigned char local[16] = {};
  ++record.runs;
  std::copy(thread->thread_position_in_threadgroup, thread->thread_position_in_threadgroup + 3,
            record.position);
  record.index = thread->thread_index_in_threadgroup;
  record.simdgroup = thread->simdgroup_index_in_threadgroup;
  record.lane = thread->thread_index_in_simdgroup;
  record.simd_size = thread->simd->size;
  std::copy(thread->group->threadgroup_position_in_grid,
            thread->group->threadgroup_position_in_grid + 3, record.group);
  record.simdgroups_per_threadgroup = thread->dispatch->simdgroups_per_threadgroup;
  record.stack_aligned = opaque_address(local) % 16 == 0;
}

TEST(Executor, EveryThreadRunsOnceWithItsBuiltins) {
  const std::vector<std::pair<Size3, Size3>> shapes = {
      {{3, 2, 1}, {100, 1, 1}},  // a partial last simdgroup
      {{2, 1, 1}, {8, 5, 1}},
      {{1, 2, 3}, {4, 3, 5}},
      {{2, 2, 1}, {32, 32, 1}},  // the largest threadgroup
      {{1, 1, 1}, {1, 1, 1}},
  };
  for (const auto& [groups, threads] : shapes) {
    SCOPED_TRACE("threadgroups " + std::to_string(groups.volume()) + ", threads (" +
                 std::to_string(threads.x) + ", " + std::to_string(threads.y) + ", " +
                 std::to_string(threads.z) + ")");
    const auto per_group = static_cast<std::uint32_t>(threads.volume());
    std::vector<ThreadRecord> records(groups.volume() * per_group, ThreadRecord{});
    Launch launch = make_launch("builtins", &record_builtins, groups, threads);
    bind_buffer(launch, 0, records);
    const DispatchStats stats = test_executor().run(launch);
    EXPECT_EQ(stats.threadgroups, groups.volume());

    for (std::size_t slot = 0; slot < records.size(); ++slot) {
      const ThreadRecord& record = records[slot];
      const auto i = static_cast<std::uint32_t>(slot % per_group);
      const auto g = static_cast<std::uint32_t>(slot / per_group);
      const std::uint32_t simdgroup = i / 32;
      ASSERT_EQ(record.runs, 1u) << "thread " << i << " of group " << g;
      EXPECT_EQ(record.position[0], i % threads.x);
      EXPECT_EQ(record.position[1], i / threads.x % threads.y);
      EXPECT_EQ(record.position[2], i / (threads.x * threads.y));
      EXPECT_EQ(record.index, i);
      EXPECT_EQ(record.simdgroup, simdgroup);
      EXPECT_EQ(record.lane, i % 32);
      EXPECT_EQ(record.simd_size, std::min(32u, per_group - simdgroup * 32));
      EXPECT_EQ(record.group[0], g % groups.x);
      EXPECT_EQ(record.group[1], g / groups.x % groups.y);
      EXPECT_EQ(record.group[2], g / (groups.x * groups.y));
      EXPECT_EQ(record.simdgroups_per_threadgroup, (per_group + 31) / 32);
      EXPECT_EQ(record.stack_aligned, 1u);
    }
  }
}

void sum_over_simdgroup(ThreadState* thread) {
  const std::uint32_t i = global_index(thread);
  const float* input = buffer<float>(thread, 0);
  float* output = buffer<float>(thread, 1);
  std::uint32_t* active = buffer<std::uint32_t>(thread, 2);
  output[i] = simd_sum(thread, input[i], 10);
  active[i] = thread->simd->active;
}

// The sum over lanes of each simdgroup whose lane passes `takes_part`.
std::vector<float> reference_simd_sums(const std::vector<float>& input, std::uint32_t per_group,
                                       const std::function<bool(std::uint32_t)>& takes_part) {
  std::vector<float> sums(input.size(), kNaN);
  for (std::size_t group = 0; group < input.size(); group += per_group) {
    for (std::size_t first = group; first < group + per_group; first += 32) {
      const std::size_t end = std::min<std::size_t>(first + 32, group + per_group);
      double sum = 0;
      for (std::size_t i = first; i < end; ++i) {
        if (takes_part(static_cast<std::uint32_t>(i - first))) sum += input[i];
      }
      for (std::size_t i = first; i < end; ++i) {
        if (takes_part(static_cast<std::uint32_t>(i - first))) sums[i] = static_cast<float>(sum);
      }
    }
  }
  return sums;
}

void expect_close(const std::vector<float>& actual, const std::vector<float>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (std::isnan(expected[i])) {
      EXPECT_TRUE(std::isnan(actual[i])) << "element " << i << " should be untouched";
    } else {
      EXPECT_NEAR(actual[i], expected[i], 1e-5f) << "element " << i;
    }
  }
}

TEST(Executor, SimdSumMatchesScalarReference) {
  std::mt19937 rng = fresh_rng();
  const std::uint32_t per_group = 100;  // simdgroups of 32, 32, 32 and 4 lanes
  const std::vector<float> input = random_floats(3 * per_group, rng);
  std::vector<float> output(input.size(), kNaN);
  std::vector<std::uint32_t> active(input.size(), 0);
  Launch launch = make_launch("simd_sum", &sum_over_simdgroup, {3, 1, 1}, {per_group, 1, 1});
  bind_buffer(launch, 0, input);
  bind_buffer(launch, 1, output);
  bind_buffer(launch, 2, active);
  test_executor().run(launch);

  expect_close(output, reference_simd_sums(input, per_group, [](std::uint32_t) { return true; }));
  for (std::size_t i = 0; i < active.size(); ++i) {
    const bool last_simdgroup = i % per_group >= 96;
    EXPECT_EQ(active[i], last_simdgroup ? 0xFu : 0xFFFFFFFFu) << "thread " << i;
  }
}

void sum_after_high_lanes_return(ThreadState* thread) {
  if (thread->thread_index_in_simdgroup >= 20) return;
  const std::uint32_t i = global_index(thread);
  buffer<float>(thread, 1)[i] = simd_sum(thread, buffer<float>(thread, 0)[i], 20);
}

void sum_after_low_lanes_return(ThreadState* thread) {
  if (thread->thread_index_in_simdgroup < 12) return;
  const std::uint32_t i = global_index(thread);
  buffer<float>(thread, 1)[i] = simd_sum(thread, buffer<float>(thread, 0)[i], 30);
}

TEST(Executor, CollectiveSpansOnlyLanesThatHaveNotReturned) {
  std::mt19937 rng = fresh_rng();
  struct Case {
    KernelMain main;
    std::function<bool(std::uint32_t)> takes_part;
  };
  // Lanes 0-19 wait before 20-31 return (the last return completes the
  // collective); lanes 0-11 return before 12-31 arrive.
  const std::vector<Case> cases = {
      {&sum_after_high_lanes_return, [](std::uint32_t lane) { return lane < 20; }},
      {&sum_after_low_lanes_return, [](std::uint32_t lane) { return lane >= 12; }},
  };
  for (const Case& test : cases) {
    const std::vector<float> input = random_floats(2 * 64, rng);
    std::vector<float> output(input.size(), kNaN);
    Launch launch = make_launch("partial_sum", test.main, {2, 1, 1}, {64, 1, 1});
    bind_buffer(launch, 0, input);
    bind_buffer(launch, 1, output);
    test_executor().run(launch);
    expect_close(output, reference_simd_sums(input, 64, test.takes_part));
  }
}

// ---------------------------------------------------------------------------
// Barriers and threadgroup memory.

constexpr int kBarrierRounds = 3;

// Each round every thread publishes a value, then reads its neighbours'.
void exchange_with_neighbours(ThreadState* thread) {
  auto* shared = static_cast<float*>(thread->group->threadgroup_args[0]);
  const std::uint32_t n = threads_per_group(thread);
  const std::uint32_t i = thread->thread_index_in_threadgroup;
  float value = buffer<float>(thread, 0)[global_index(thread)];
  for (int round = 0; round < kBarrierRounds; ++round) {
    shared[i] = value;
    barrier(thread, 40);
    value = shared[(i + 1) % n] + 0.5f * shared[(i + n - 1) % n];
    barrier(thread, 42);
  }
  buffer<float>(thread, 1)[global_index(thread)] = value;
}

TEST(Executor, BarriersOrderThreadgroupMemory) {
  std::mt19937 rng = fresh_rng();
  const std::uint32_t n = 80;
  const std::uint32_t groups = 4;
  const std::vector<float> input = random_floats(groups * n, rng);
  std::vector<float> output(input.size(), kNaN);
  Launch launch = make_launch("exchange", &exchange_with_neighbours, {groups, 1, 1}, {n, 1, 1});
  launch.threadgroup_memory = {n * sizeof(float)};
  bind_buffer(launch, 0, input);
  bind_buffer(launch, 1, output);
  const DispatchStats stats = test_executor().run(launch);

  std::vector<float> expected = input;
  for (std::uint32_t g = 0; g < groups; ++g) {
    float* values = expected.data() + g * n;
    for (int round = 0; round < kBarrierRounds; ++round) {
      const std::vector<float> published(values, values + n);
      for (std::uint32_t i = 0; i < n; ++i) {
        values[i] = published[(i + 1) % n] + 0.5f * published[(i + n - 1) % n];
      }
    }
  }
  expect_close(output, expected);
  ASSERT_TRUE(stats.barriers.has_value());
  EXPECT_EQ(*stats.barriers, std::uint64_t(groups) * 2 * kBarrierRounds);
}

struct MemoryReport {
  std::uint32_t poisoned;       // every byte of this thread's slice was 0xFF
  std::uint32_t float_is_nan;   // and reads as a NaN float
  std::uint32_t layout_ok;      // [[threadgroup(i)]] and static_base where expected
};

// Each thread checks its slice of the whole block, then scribbles on it, so
// the next group on the same worker must see poison again.
void check_poison_then_scribble(ThreadState* thread) {
  const mfa_abi::GroupContext& group = *thread->group;
  const std::size_t limit = thread->dispatch->threadgroup_memory_limit;
  const std::uint32_t n = threads_per_group(thread);
  const std::uint32_t i = thread->thread_index_in_threadgroup;
  const std::size_t slice = limit / n;
  unsigned char* begin = group.threadgroup_memory + i * slice;

  MemoryReport& report = buffer<MemoryReport>(thread, 0)[global_index(thread)];
  report.poisoned = std::all_of(begin, begin + slice, [](unsigned char b) { return b == 0xFF; });
  float first;
  std::memcpy(&first, begin, sizeof first);
  report.float_is_nan = std::isnan(first);
  const auto base = reinterpret_cast<std::uintptr_t>(group.threadgroup_memory);
  bool layout = base % 16 == 0 && group.threadgroup_args[0] == group.threadgroup_memory &&
                group.threadgroup_args[1] == group.threadgroup_memory + 112 &&
                group.static_base == 176 && thread->static_cursor == 176;
  for (unsigned a = 2; a < mfa_abi::kMaxThreadgroupArgs; ++a) {
    layout = layout && group.threadgroup_args[a] == nullptr;
  }
  report.layout_ok = layout;
  barrier(thread, 50);
  std::memset(begin, static_cast<int>(i * 7 + 1), slice);
}

TEST(Executor, ThreadgroupMemoryIsPoisonedAtEveryGroupStart) {
  const std::uint32_t groups = 6;
  const std::uint32_t n = 64;
  std::vector<MemoryReport> reports(groups * n, MemoryReport{});
  Launch launch = make_launch("poison", &check_poison_then_scribble, {groups, 1, 1}, {n, 1, 1});
  launch.threadgroup_memory = {100, 64};  // laid out at 0 and 112; static variables at 176
  bind_buffer(launch, 0, reports);
  Executor single_worker(1);  // every group reuses the memory of the one before
  single_worker.run(launch);
  for (std::size_t t = 0; t < reports.size(); ++t) {
    EXPECT_EQ(reports[t].poisoned, 1u) << "thread " << t;
    EXPECT_EQ(reports[t].float_is_nan, 1u) << "thread " << t;
    EXPECT_EQ(reports[t].layout_ok, 1u) << "thread " << t;
  }
}

constexpr int kMatrixOpsPerSimdgroup = 3;

void count_work(ThreadState* thread) {
  for (int op = 0; op < kMatrixOpsPerSimdgroup; ++op) matrix_op(thread, 60);
  barrier(thread, 61);
  barrier(thread, 62);
}

TEST(Executor, CountsThreadgroupsMatrixOpsBarriersAndTime) {
  Launch launch = make_launch("count", &count_work, {2, 3, 1}, {96, 1, 1});
  const DispatchStats stats = test_executor().run(launch);
  EXPECT_EQ(stats.kernel, "count");
  EXPECT_EQ(stats.threadgroups, 6u);
  ASSERT_TRUE(stats.simdgroup_matrix_ops.has_value());
  EXPECT_EQ(*stats.simdgroup_matrix_ops, 6u * 3 * kMatrixOpsPerSimdgroup);
  ASSERT_TRUE(stats.barriers.has_value());
  EXPECT_EQ(*stats.barriers, 6u * 2);
  ASSERT_TRUE(stats.seconds.has_value());
  EXPECT_GT(*stats.seconds, 0.0);
}

void spin_with_yield_until_last_thread_arrives(ThreadState* thread) {
  auto* flag = static_cast<volatile std::uint32_t*>(thread->group->threadgroup_args[0]);
  const std::uint32_t n = threads_per_group(thread);
  if (thread->thread_index_in_threadgroup == 0) {
    *flag = 0;
    barrier(thread, 70);
    while (*flag != 12345) yield(thread, 71);
  } else {
    barrier(thread, 70);
    if (thread->thread_index_in_threadgroup == n - 1) {
      for (int i = 0; i < 100; ++i) yield(thread, 72);
      *flag = 12345;
    }
  }
  buffer<std::uint32_t>(thread, 0)[global_index(thread)] = 1;
}

TEST(Executor, YieldLetsASpinWaitProgress) {
  std::vector<std::uint32_t> done(2 * 64, 0);
  Launch launch =
      make_launch("spin", &spin_with_yield_until_last_thread_arrives, {2, 1, 1}, {64, 1, 1});
  launch.threadgroup_memory = {16};
  bind_buffer(launch, 0, done);
  test_executor().run(launch);
  EXPECT_EQ(std::count(done.begin(), done.end(), 1u), 128);
}

// ---------------------------------------------------------------------------
// Parallelism.

TEST(Executor, WorkerCountFollowsTheArgument) {
  EXPECT_EQ(Executor(3).workers(), 3u);
  EXPECT_EQ(Executor(0).workers(), std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_GE(Executor::shared().workers(), 1u);
}

// In a child process, so that this process's shared executor stays as it is.
TEST(ExecutorDeathTest, SharedExecutorTakesItsSizeFromTheEnvironment) {
  auto shared_workers_exit_code = [](const char* threads) {
    setenv("MFA_NATIVE_CPU_THREADS", threads, 1);
    try {
      std::exit(static_cast<int>(Executor::shared().workers()));
    } catch (const ArgumentError& error) {
      std::fprintf(stderr, "%s\n", error.what());
      std::exit(100);
    }
  };
  EXPECT_EXIT(shared_workers_exit_code("3"), testing::ExitedWithCode(3), "");
  EXPECT_EXIT(shared_workers_exit_code("many"), testing::ExitedWithCode(100),
              "MFA_NATIVE_CPU_THREADS must be a positive integer, got 'many'");
  EXPECT_EXIT(shared_workers_exit_code("100000"), testing::ExitedWithCode(100),
              "MFA_NATIVE_CPU_THREADS must be at most 1024, got '100000'");
}

// Thread 0 of each group waits (without yielding) until both groups run at
// once, which only happens if they are on different OS threads. Every
// thread also records its OS thread before and after blocking.
void meet_the_other_group(ThreadState* thread) {
  auto* started = buffer<std::atomic<std::uint32_t>>(thread, 0);
  std::uint64_t* os_threads = buffer<std::uint64_t>(thread, 1) + 3 * global_index(thread);
  os_threads[0] = os_thread_id();
  if (thread->thread_index_in_threadgroup == 0) {
    started->fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (started->load() < 2 && std::chrono::steady_clock::now() < deadline) {
    }
  }
  barrier(thread, 80);
  os_threads[1] = os_thread_id();
  simd_sum(thread, 1.0f, 81);
  os_threads[2] = os_thread_id();
}

TEST(Executor, ThreadgroupsRunInParallelAndNeverMigrate) {
  Executor executor(2);
  std::vector<std::atomic<std::uint32_t>> started(1);
  std::vector<std::uint64_t> os_threads(2 * 64 * 3, 0);
  Launch launch = make_launch("meet", &meet_the_other_group, {2, 1, 1}, {64, 1, 1});
  bind_buffer(launch, 0, started);
  bind_buffer(launch, 1, os_threads);
  executor.run(launch);
  EXPECT_EQ(started[0].load(), 2u);
  EXPECT_NE(os_threads[0], os_threads[64 * 3]) << "both groups ran on one OS thread";
  for (std::size_t g = 0; g < 2; ++g) {
    for (std::size_t entry = g * 64 * 3; entry < (g + 1) * 64 * 3; ++entry) {
      EXPECT_EQ(os_threads[entry], os_threads[g * 64 * 3]) << "group " << g << " migrated";
    }
  }
}

// Both groups meet (so each runs on its own OS thread); then the group that is
// not on the launching thread takes buffer 2's milliseconds before writing.
void helper_finishes_late(ThreadState* thread) {
  auto* started = buffer<std::atomic<std::uint32_t>>(thread, 0);
  const std::uint32_t group = thread->group->threadgroup_position_in_grid[0];
  const std::uint64_t launching_thread = buffer<std::uint64_t>(thread, 1)[0];
  const std::uint32_t delay_ms = buffer<std::uint32_t>(thread, 2)[0];
  if (thread->thread_index_in_threadgroup == 0) {
    started->fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (started->load() < 2 && std::chrono::steady_clock::now() < deadline) {
    }
    if (os_thread_id() != launching_thread) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    buffer<std::uint32_t>(thread, 3)[group] = group + 1;
  }
}

// The launching thread waits for its helpers without sleeping for a while,
// then on a condition variable: a helper finishing within that time or long
// after it, every group's writes are there when run() returns.
TEST(Executor, RunReturnsAfterTheLastHelperFinishesSoonOrLate) {
  Executor executor(2);
  for (const std::uint32_t delay_ms : {0u, 1u, 10u}) {
    const int rounds = delay_ms < 10 ? 20 : 1;  // a slow round past the spin is enough once
    for (int round = 0; round < rounds; ++round) {
      std::vector<std::atomic<std::uint32_t>> started(1);
      const std::vector<std::uint64_t> launching_thread{os_thread_id()};
      const std::vector<std::uint32_t> delay{delay_ms};
      std::vector<std::uint32_t> written(2, 0);
      Launch launch = make_launch("late", &helper_finishes_late, {2, 1, 1}, {32, 1, 1});
      bind_buffer(launch, 0, started);
      bind_buffer(launch, 1, launching_thread);
      bind_buffer(launch, 2, delay);
      bind_buffer(launch, 3, written);
      executor.run(launch);
      EXPECT_EQ(written, (std::vector<std::uint32_t>{1, 2})) << "delay " << delay_ms << " ms";
    }
  }
}

void sum_and_exchange(ThreadState* thread) {
  const std::uint32_t i = global_index(thread);
  buffer<float>(thread, 1)[i] = simd_sum(thread, buffer<float>(thread, 0)[i], 90);
  barrier(thread, 91);
}

TEST(Executor, ConcurrentDispatchesFromSeveralCallersAreCorrect) {
  Executor executor(2);
  const unsigned seed = std::random_device()();
  auto caller = [&](unsigned id) {
    std::mt19937 rng(seed + id);
    for (int dispatch = 0; dispatch < 10; ++dispatch) {
      const std::vector<float> input = random_floats(16 * 96, rng);
      std::vector<float> output(input.size(), kNaN);
      Launch launch = make_launch("concurrent", &sum_and_exchange, {16, 1, 1}, {96, 1, 1});
      bind_buffer(launch, 0, input);
      bind_buffer(launch, 1, output);
      const DispatchStats stats = executor.run(launch);
      EXPECT_EQ(stats.threadgroups, 16u);
      EXPECT_EQ(stats.barriers.value_or(0), 16u);
      expect_close(output, reference_simd_sums(input, 96, [](std::uint32_t) { return true; }));
    }
  };
  std::vector<std::thread> callers;
  for (unsigned id = 0; id < 4; ++id) callers.emplace_back(caller, id);
  for (std::thread& thread : callers) thread.join();
}

// ---------------------------------------------------------------------------
// Diagnostics: each is a DispatchError naming sites and threads, never a hang.

void high_threads_return_before_barrier(ThreadState* thread) {
  if (thread->thread_index_in_threadgroup >= 32) return;
  barrier(thread, 100);
}

void low_threads_return_before_barrier(ThreadState* thread) {
  if (thread->thread_index_in_threadgroup < 32) return;
  barrier(thread, 101);
}

TEST(Diagnostics, BarrierThatReturnedThreadsNeverReach) {
  const std::string waiting_first = dispatch_error(
      test_executor(),
      make_launch("early_return", &high_threads_return_before_barrier, {1, 1, 1}, {64, 1, 1}));
  expect_contains(waiting_first,
                  {"kernel 'early_return'", "threadgroup (0, 0, 0)",
                   "threadgroup_barrier at kernel.metal:100 can never complete",
                   "thread 32 returned without reaching it", "threads 0-31 reached it"});

  const std::string returned_first = dispatch_error(
      test_executor(),
      make_launch("early_return", &low_threads_return_before_barrier, {1, 1, 1}, {64, 1, 1}));
  expect_contains(returned_first, {"threadgroup_barrier at kernel.metal:101 can never complete",
                                   "threads 0-31 returned", "thread 32 reached it"});
}

void simdgroups_at_different_barriers(ThreadState* thread) {
  barrier(thread, thread->simdgroup_index_in_threadgroup == 0 ? 110 : 111);
}

TEST(Diagnostics, ThreadsAtDifferentBarriers) {
  const std::string error = dispatch_error(
      test_executor(),
      make_launch("two_barriers", &simdgroups_at_different_barriers, {1, 1, 1}, {64, 1, 1}));
  expect_contains(error, {"different barriers",
                          "threads 0-31 wait at threadgroup_barrier at kernel.metal:110",
                          "thread 32 arrived at threadgroup_barrier at kernel.metal:111"});
}

void half_collective_half_barrier(ThreadState* thread) {
  if (thread->thread_index_in_simdgroup < 16) {
    simd_sum(thread, 1.0f, 120);
  } else {
    barrier(thread, 121);
  }
}

TEST(Diagnostics, Deadlock) {
  const std::string error = dispatch_error(
      test_executor(),
      make_launch("deadlock", &half_collective_half_barrier, {1, 1, 1}, {32, 1, 1}));
  expect_contains(error, {"deadlock", "threads 0-15 wait at simd_sum at kernel.metal:120",
                          "still needs lanes 16-31",
                          "threads 16-31 wait at threadgroup_barrier at kernel.metal:121"});
}

void divergent_collectives_in_second_simdgroup(ThreadState* thread) {
  const bool low = thread->thread_index_in_simdgroup < 16;
  simd_sum(thread, 1.0f, thread->simdgroup_index_in_threadgroup == 1 && !low ? 131 : 130);
}

TEST(Diagnostics, LanesAtDifferentCollectives) {
  const std::string error = dispatch_error(
      test_executor(), make_launch("divergent", &divergent_collectives_in_second_simdgroup,
                                   {1, 1, 1}, {64, 1, 1}));
  expect_contains(error, {"different collectives",
                          "lanes 0-15 of simdgroup 1 (threads 32-47) wait at simd_sum at "
                          "kernel.metal:130",
                          "lane 16 of simdgroup 1 (thread 48) arrived at simd_sum at "
                          "kernel.metal:131"});
}

void matrix_op_everywhere(ThreadState* thread) { matrix_op(thread, 140); }

void matrix_op_after_high_lanes_return(ThreadState* thread) {
  if (thread->thread_index_in_simdgroup >= 24) return;
  matrix_op(thread, 141);
}

TEST(Diagnostics, FullCollectiveWithInactiveLanes) {
  const std::string partial = dispatch_error(
      test_executor(),
      make_launch("partial_matrix", &matrix_op_everywhere, {1, 1, 1}, {48, 1, 1}));
  expect_contains(partial, {"simdgroup_multiply_accumulate at kernel.metal:140 needs all 32 "
                            "lanes of simdgroup 1 active",
                            "the simdgroup has only 16 threads"});

  const std::string returned = dispatch_error(
      test_executor(),
      make_launch("returned_matrix", &matrix_op_after_high_lanes_return, {1, 1, 1}, {32, 1, 1}));
  expect_contains(returned, {"simdgroup_multiply_accumulate at kernel.metal:141 needs all 32 "
                             "lanes of simdgroup 0 active",
                             "lane 24 of simdgroup 0 (thread 24) returned"});
}

void mark_ran(ThreadState* thread) { buffer<std::uint32_t>(thread, 0)[0] = 1; }

TEST(Diagnostics, ThreadgroupMemoryOverTheLimitIsRejectedBeforeRunning) {
  std::vector<std::uint32_t> ran(1, 0);
  Launch launch = make_launch("too_much_memory", &mark_ran, {1, 1, 1}, {32, 1, 1});
  launch.threadgroup_memory = {16384, 16385};  // 16384 + 16400 after rounding
  bind_buffer(launch, 0, ran);
  expect_contains(dispatch_error(test_executor(), launch),
                  {"threadgroup memory of 32784 bytes",
                   "[[threadgroup(0)]] 16384 + [[threadgroup(1)]] 16385",
                   "over the limit of 32768 bytes"});
  EXPECT_EQ(ran[0], 0u);

  launch.threadgroup_memory = {16384, 16384};  // exactly the limit is fine
  test_executor().run(launch);
  EXPECT_EQ(ran[0], 1u);
}

void fail_in_one_thread(ThreadState* thread) {
  const std::uint32_t* group = thread->group->threadgroup_position_in_grid;
  const std::uint32_t* position = thread->thread_position_in_threadgroup;
  if (group[0] == 2 && position[0] == 3 && position[1] == 1) {
    runtime(thread).fail(thread, "out-of-bounds read of buffer 1 at index 99");
  }
  barrier(thread, 150);
  buffer<std::uint32_t>(thread, 0)[global_index(thread)] = 1;
}

TEST(Diagnostics, KernelFailureNamesThreadAndThreadgroup) {
  std::vector<std::uint32_t> finished(3 * 8, 0);
  Launch launch = make_launch("failing", &fail_in_one_thread, {3, 1, 1}, {4, 2, 1});
  bind_buffer(launch, 0, finished);
  const std::string error = dispatch_error(test_executor(), launch);
  expect_contains(error, {"kernel 'failing': threadgroup (2, 0, 0), thread (3, 1, 0): "
                          "out-of-bounds read of buffer 1 at index 99"});
  // Group 2's other threads waited at the barrier: abandoned, never resumed.
  EXPECT_EQ(std::count(finished.begin() + 16, finished.end(), 1u), 0);
}

void throw_from_one_thread(ThreadState* thread) {
  if (thread->thread_index_in_threadgroup == 5) throw std::runtime_error("bad thing happened");
  barrier(thread, 160);
}

TEST(Diagnostics, ExceptionEscapingTheKernel) {
  const std::string error = dispatch_error(
      test_executor(), make_launch("throwing", &throw_from_one_thread, {1, 1, 1}, {32, 1, 1}));
  expect_contains(error, {"thread (5, 0, 0)",
                          "a C++ exception escaped the kernel: bad thing happened"});

  // The executor is still usable after a failed group.
  std::vector<std::uint32_t> ran(1, 0);
  Launch next = make_launch("after_failure", &mark_ran, {1, 1, 1}, {32, 1, 1});
  bind_buffer(next, 0, ran);
  test_executor().run(next);
  EXPECT_EQ(ran[0], 1u);
}

void spin_forever_in_thread_zero(ThreadState* thread) {
  if (thread->thread_index_in_threadgroup != 0) return;
  for (;;) yield(thread, 170);
}

TEST(Diagnostics, SpinWaitWithoutProgressTimesOut) {
  setenv("MFA_NATIVE_CPU_TIMEOUT", "0.3", 1);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = dispatch_error(
      test_executor(), make_launch("spinning", &spin_forever_in_thread_zero, {1, 1, 1},
                                   {64, 1, 1}));
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  unsetenv("MFA_NATIVE_CPU_TIMEOUT");
  expect_contains(error, {"no progress for 0.3 s (spin-wait on something that never happens?)",
                          "thread 0 yielded last at atomic_load at kernel.metal:170",
                          "threads 1-63 returned"});
  EXPECT_LT(elapsed.count(), 30.0);
}

TEST(Diagnostics, BadTimeoutIsRejected) {
  setenv("MFA_NATIVE_CPU_TIMEOUT", "soon", 1);
  Launch launch = make_launch("any", &mark_ran, {1, 1, 1}, {1, 1, 1});
  EXPECT_THROW(test_executor().run(launch), ArgumentError);
  unsetenv("MFA_NATIVE_CPU_TIMEOUT");
}

void fail_group_zero_spin_elsewhere(ThreadState* thread) {
  buffer<std::atomic<std::uint32_t>>(thread, 0)->fetch_add(1);
  if (group_index(thread) == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    runtime(thread).fail(thread, "group zero gives up");
  }
  for (;;) yield(thread, 180);  // every other group waits for something that never comes
}

TEST(Diagnostics, AFailingGroupStopsTheDispatch) {
  // Without the stop, the spinning groups would each run into the
  // no-progress timeout (10 s) one after another.
  std::vector<std::atomic<std::uint32_t>> started(1);
  Launch launch = make_launch("stopping", &fail_group_zero_spin_elsewhere, {1000, 1, 1},
                              {1, 1, 1});
  bind_buffer(launch, 0, started);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = dispatch_error(test_executor(), launch);
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  expect_contains(error, {"threadgroup (0, 0, 0), thread (0, 0, 0): group zero gives up"});
  EXPECT_LT(started[0].load(), 10u);
  EXPECT_LT(elapsed.count(), 5.0);
}

TEST(Diagnostics, MalformedLaunchesAreRejected) {
  Launch no_kernel = make_launch("null", nullptr, {1, 1, 1}, {1, 1, 1});
  EXPECT_THROW(test_executor().run(no_kernel), ArgumentError);
  Launch too_many = make_launch("huge", &mark_ran, {1, 1, 1}, {1025, 1, 1});
  EXPECT_THROW(test_executor().run(too_many), ArgumentError);
  Launch empty = make_launch("empty", &mark_ran, {1, 1, 1}, {0, 1, 1});
  EXPECT_THROW(test_executor().run(empty), ArgumentError);
}

}  // namespace
}  // namespace mfa::cpu
