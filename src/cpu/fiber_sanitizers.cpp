// Sanitizer annotations for fiber switches, compiled in sanitizer builds only.
// AddressSanitizer must know which stack runs, and a reused stack must not
// keep the poisoned redzones of frames abandoned on it. ThreadSanitizer needs
// a shadow call stack per fiber; its switches synchronize (happens-before),
// so it checks the executor and the races between threadgroups.
#include "fiber.hpp"

#ifdef MFA_FIBER_SANITIZERS

#ifdef MFA_FIBER_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#ifdef MFA_FIBER_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace mfa::cpu {

#ifdef MFA_FIBER_ASAN
namespace {

// The context this OS thread is switching away from. Once on the new stack,
// ASan reports the bounds of the stack left behind; recording them keeps an
// OS thread's own context right even when several threads use it in turn.
thread_local FiberContext* leaving = nullptr;

void finish_asan_switch(void* fake_stack) {
  const void* bottom = nullptr;
  std::size_t size = 0;
  __sanitizer_finish_switch_fiber(fake_stack, &bottom, &size);
  leaving->stack_bottom = bottom;
  leaving->stack_size = size;
}

void start_fiber_under_asan(void* context_address) {
  auto& context = *static_cast<FiberContext*>(context_address);
  finish_asan_switch(nullptr);
  context.entry(context.argument);
}

}  // namespace
#endif

#ifdef MFA_FIBER_TSAN
void* FiberStack::renew_tsan_fiber() {
  if (tsan_fiber_ != nullptr) __tsan_destroy_fiber(tsan_fiber_);
  tsan_fiber_ = __tsan_create_fiber(0);
  return tsan_fiber_;
}

void destroy_tsan_fiber(void* fiber) { __tsan_destroy_fiber(fiber); }
#endif

void sanitizer_prepare_fiber(FiberContext& context, FiberStack& stack,
                             [[maybe_unused]] FiberEntry& entry,
                             [[maybe_unused]] void*& argument) {
#ifdef MFA_FIBER_ASAN
  __asan_unpoison_memory_region(stack.bottom(), stack.size());
  context.stack_bottom = stack.bottom();
  context.stack_size = stack.size();
  context.fake_stack = nullptr;
  context.entry = entry;
  context.argument = argument;
  entry = &start_fiber_under_asan;
  argument = &context;
#endif
#ifdef MFA_FIBER_TSAN
  context.tsan_fiber = stack.renew_tsan_fiber();
#endif
}

// Not instrumented: a ThreadSanitizer function exit after the switch to the
// next fiber's shadow stack would pop from that (empty) stack.
#if defined(__clang__)
#define MFA_NOT_INSTRUMENTED __attribute__((disable_sanitizer_instrumentation))
#else
#define MFA_NOT_INSTRUMENTED __attribute__((no_sanitize("thread")))
#endif
MFA_NOT_INSTRUMENTED void sanitizer_before_switch(FiberContext& from, const FiberContext& to) {
#ifdef MFA_FIBER_ASAN
  leaving = &from;
  __sanitizer_start_switch_fiber(&from.fake_stack, to.stack_bottom, to.stack_size);
#endif
#ifdef MFA_FIBER_TSAN
  from.tsan_fiber = __tsan_get_current_fiber();  // an OS thread's context may move between threads
  __tsan_switch_to_fiber(to.tsan_fiber, 0);
#endif
}

void sanitizer_after_switch([[maybe_unused]] FiberContext& resumed) {
#ifdef MFA_FIBER_ASAN
  finish_asan_switch(resumed.fake_stack);
#endif
}

}  // namespace mfa::cpu

#endif
