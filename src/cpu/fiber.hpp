// Fibers: user-space execution contexts, one per GPU thread, switched
// cooperatively. The switch is hand-written for x86-64 SysV and AArch64
// (about ten times cheaper than glibc's swapcontext, which makes a syscall per
// switch); ucontext is the fallback, chosen at build time with
// -DMFA_FIBER_UCONTEXT and used on every other architecture.
#pragma once

#include <cstddef>

#if defined(MFA_FIBER_UCONTEXT) || !(defined(__x86_64__) || defined(__aarch64__))
#define MFA_FIBER_USES_UCONTEXT 1
#include <ucontext.h>
#endif

// Sanitizer builds tell AddressSanitizer and ThreadSanitizer about every
// stack switch (fiber_sanitizers.cpp).
#if defined(__SANITIZE_ADDRESS__)
#define MFA_FIBER_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define MFA_FIBER_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MFA_FIBER_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define MFA_FIBER_TSAN 1
#endif
#endif
#if defined(MFA_FIBER_ASAN) || defined(MFA_FIBER_TSAN)
#define MFA_FIBER_SANITIZERS 1
#endif

namespace mfa::cpu {

// Memory for a fiber's stack, mmap'd with an inaccessible guard page below it
// so an overflow faults instead of corrupting a neighbour. Pages are touched
// (and committed) only as the stack grows.
class FiberStack {
 public:
  explicit FiberStack(std::size_t bytes);
  ~FiberStack();
  FiberStack(FiberStack&& other) noexcept;
  FiberStack& operator=(FiberStack&&) = delete;
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;

  void* bottom() const { return usable_; }  // lowest usable address
  void* top() const { return static_cast<char*>(usable_) + usable_bytes_; }
  std::size_t size() const { return usable_bytes_; }

#ifdef MFA_FIBER_TSAN
  // ThreadSanitizer's state for the code on this stack, new for every fiber
  // started on it: a fiber that never returns leaves frames on its old one.
  void* renew_tsan_fiber();
#endif

 private:
  void* mapping_ = nullptr;
  std::size_t mapping_bytes_ = 0;
  void* usable_ = nullptr;
  std::size_t usable_bytes_ = 0;
#ifdef MFA_FIBER_TSAN
  void* tsan_fiber_ = nullptr;
#endif
};

#ifdef MFA_FIBER_TSAN
void destroy_tsan_fiber(void* fiber);
#endif

// Runs on a fresh fiber; must never return (it switches away for good).
using FiberEntry = void (*)(void* argument);

// The saved state of a suspended context. A context that is running needs
// none; switch_fiber fills `from` as it leaves.
struct FiberContext {
#ifdef MFA_FIBER_USES_UCONTEXT
  ucontext_t context;
#else
  void* stack_pointer = nullptr;  // callee-saved registers and FP control words are pushed below it
#endif
#ifdef MFA_FIBER_ASAN
  const void* stack_bottom = nullptr;  // of the stack it runs on
  std::size_t stack_size = 0;
  void* fake_stack = nullptr;  // ASan's detect_stack_use_after_return state while suspended
  FiberEntry entry = nullptr;  // what a fresh fiber runs once ASan knows it started
  void* argument = nullptr;
#endif
#ifdef MFA_FIBER_TSAN
  void* tsan_fiber = nullptr;  // owned by the FiberStack, or an OS thread's own
#endif
};

#ifdef MFA_FIBER_SANITIZERS
// May make a fresh fiber start in a wrapper (rewrites entry and argument).
void sanitizer_prepare_fiber(FiberContext& context, FiberStack& stack, FiberEntry& entry,
                             void*& argument);
void sanitizer_before_switch(FiberContext& from, const FiberContext& to);
void sanitizer_after_switch(FiberContext& resumed);
#endif

// Makes `context` start entry(argument) on `stack` when it is next switched to.
// The new context inherits the calling thread's floating-point control state.
void prepare_fiber(FiberContext& context, FiberStack& stack, FiberEntry entry, void* argument);

#ifndef MFA_FIBER_USES_UCONTEXT
// The hand-written switch (fiber_switch_<arch>.cpp).
extern "C" __attribute__((visibility("hidden"))) void mfa_fiber_switch(
    void** save_stack_pointer, void* resume_stack_pointer);
#endif

// Saves the running context into `from` and resumes `to`. Returns when some
// other context switches back to `from`.
inline void switch_fiber(FiberContext& from, FiberContext& to) {
#ifdef MFA_FIBER_SANITIZERS
  sanitizer_before_switch(from, to);
#endif
#ifdef MFA_FIBER_USES_UCONTEXT
  swapcontext(&from.context, &to.context);
#else
  mfa_fiber_switch(&from.stack_pointer, to.stack_pointer);
#endif
#ifdef MFA_FIBER_SANITIZERS
  sanitizer_after_switch(from);
#endif
}

// "x86_64-asm", "aarch64-asm" or "ucontext".
const char* fiber_switch_implementation();

}  // namespace mfa::cpu
