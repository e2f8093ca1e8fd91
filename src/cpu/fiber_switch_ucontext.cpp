// The portable fallback: glibc's makecontext/swapcontext. It also saves the
// signal mask, one syscall per switch, so it is much slower than the
// hand-written switches.
#include "fiber.hpp"

#ifdef MFA_FIBER_USES_UCONTEXT

#include <cstdint>

#include "mfa/errors.hpp"

namespace mfa::cpu {
namespace {

// makecontext passes only int arguments: the entry and its argument travel
// as 32-bit halves.
void start_fiber(unsigned entry_high, unsigned entry_low, unsigned argument_high,
                 unsigned argument_low) {
  auto join = [](unsigned high, unsigned low) {
    return (std::uintptr_t(high) << 16 << 16) | std::uintptr_t(low);
  };
  const auto entry = reinterpret_cast<FiberEntry>(join(entry_high, entry_low));
  entry(reinterpret_cast<void*>(join(argument_high, argument_low)));
}

unsigned high_half(std::uintptr_t value) { return unsigned(value >> 16 >> 16); }
unsigned low_half(std::uintptr_t value) { return unsigned(value & 0xFFFFFFFFu); }

}  // namespace

void prepare_fiber(FiberContext& context, FiberStack& stack, FiberEntry entry, void* argument) {
#ifdef MFA_FIBER_SANITIZERS
  sanitizer_prepare_fiber(context, stack, entry, argument);
#endif
  if (getcontext(&context.context) != 0) throw Error("getcontext failed");
  context.context.uc_stack.ss_sp = stack.bottom();
  context.context.uc_stack.ss_size = stack.size();
  context.context.uc_link = nullptr;  // the entry never returns
  const auto entry_bits = reinterpret_cast<std::uintptr_t>(entry);
  const auto argument_bits = reinterpret_cast<std::uintptr_t>(argument);
  makecontext(&context.context, reinterpret_cast<void (*)()>(&start_fiber), 4,
              high_half(entry_bits), low_half(entry_bits), high_half(argument_bits),
              low_half(argument_bits));
}

const char* fiber_switch_implementation() { return "ucontext"; }

}  // namespace mfa::cpu

#endif
