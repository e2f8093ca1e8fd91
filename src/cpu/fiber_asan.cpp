// AddressSanitizer annotations for fiber switches (ASan builds only): ASan
// must know which stack runs, and a reused stack must not keep the poisoned
// redzones of frames that were abandoned on it.
#include "fiber.hpp"

#ifdef MFA_FIBER_ASAN

#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>

namespace mfa::cpu {
namespace {

// The context this OS thread is switching away from. Once on the new stack,
// ASan reports the bounds of the stack left behind; recording them keeps an
// OS thread's own context right even when several threads use it in turn.
thread_local FiberContext* leaving = nullptr;

void finish_switch(void* fake_stack) {
  const void* bottom = nullptr;
  std::size_t size = 0;
  __sanitizer_finish_switch_fiber(fake_stack, &bottom, &size);
  leaving->stack_bottom = bottom;
  leaving->stack_size = size;
}

void start_fiber(void* context_address) {
  auto& context = *static_cast<FiberContext*>(context_address);
  finish_switch(nullptr);
  context.entry(context.argument);
}

}  // namespace

void asan_prepare_fiber(FiberContext& context, const FiberStack& stack, FiberEntry& entry,
                        void*& argument) {
  __asan_unpoison_memory_region(stack.bottom(), stack.size());
  context.stack_bottom = stack.bottom();
  context.stack_size = stack.size();
  context.fake_stack = nullptr;
  context.entry = entry;
  context.argument = argument;
  entry = &start_fiber;
  argument = &context;
}

void asan_before_switch(FiberContext& from, const FiberContext& to) {
  leaving = &from;
  __sanitizer_start_switch_fiber(&from.fake_stack, to.stack_bottom, to.stack_size);
}

void asan_after_switch(FiberContext& resumed) { finish_switch(resumed.fake_stack); }

}  // namespace mfa::cpu

#endif
