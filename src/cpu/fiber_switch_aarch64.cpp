// The AArch64 (AAPCS64) context switch: stores x19-x30, d8-d15 and FPCR on the
// running stack, swaps stack pointers, loads them back.
#include "fiber.hpp"

#if !defined(MFA_FIBER_USES_UCONTEXT) && defined(__aarch64__)

#include <cstdint>
#include <cstring>

#include "fiber_asm.hpp"

extern "C" __attribute__((visibility("hidden"))) void mfa_fiber_start();

// mfa_fiber_switch(void** save_stack_pointer /* x0 */, void* resume_stack_pointer /* x1 */)
// Frame of 176 bytes, from the saved stack pointer up: x19..x30, d8..d15, FPCR.
// `hint #34` is `bti c` (a no-op without branch target identification).
asm(MFA_ASM_FUNCTION_BEGIN("mfa_fiber_switch")
    "  hint #34\n"
    "  sub sp, sp, #176\n"
    "  stp x19, x20, [sp, #0]\n"
    "  stp x21, x22, [sp, #16]\n"
    "  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n"
    "  stp x27, x28, [sp, #64]\n"
    "  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n"
    "  stp d10, d11, [sp, #112]\n"
    "  stp d12, d13, [sp, #128]\n"
    "  stp d14, d15, [sp, #144]\n"
    "  mrs x9, fpcr\n"
    "  str x9, [sp, #160]\n"
    "  mov x9, sp\n"
    "  str x9, [x0]\n"
    "  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n"
    "  ldp x21, x22, [sp, #16]\n"
    "  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n"
    "  ldp x27, x28, [sp, #64]\n"
    "  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n"
    "  ldp d10, d11, [sp, #112]\n"
    "  ldp d12, d13, [sp, #128]\n"
    "  ldp d14, d15, [sp, #144]\n"
    "  ldr x9, [sp, #160]\n"
    "  msr fpcr, x9\n"
    "  add sp, sp, #176\n"
    "  ret\n"
    MFA_ASM_FUNCTION_END("mfa_fiber_switch")
    // A fresh fiber "returns" here from its first switch with the entry in
    // x19 and its argument in x20. The entry never returns. No caller frame
    // above: unwinders stop here.
    MFA_ASM_FUNCTION_BEGIN("mfa_fiber_start")
    "  .cfi_startproc\n"
    "  .cfi_undefined x30\n"
    "  mov x0, x20\n"
    "  blr x19\n"
    "  brk #0\n"
    "  .cfi_endproc\n"
    MFA_ASM_FUNCTION_END("mfa_fiber_start"));

namespace mfa::cpu {
namespace {

// The frame mfa_fiber_switch loads, as laid out in memory.
struct InitialFrame {
  void* x19_to_x28[10];
  void* x29;  // frame pointer: null ends frame-pointer walks
  void* x30;  // link register: where the switch returns to
  std::uint64_t d8_to_d15[8];
  std::uint64_t fpcr;
  std::uint64_t padding;
};
static_assert(sizeof(InitialFrame) == 176, "mfa_fiber_switch loads 176 bytes");

}  // namespace

void prepare_fiber(FiberContext& context, FiberStack& stack, FiberEntry entry, void* argument) {
  // The top of the stack is page aligned, so sp stays 16-byte aligned.
#ifdef MFA_FIBER_SANITIZERS
  sanitizer_prepare_fiber(context, stack, entry, argument);
#endif
  InitialFrame frame{};
  asm volatile("mrs %0, fpcr" : "=r"(frame.fpcr));
  frame.x19_to_x28[0] = reinterpret_cast<void*>(entry);
  frame.x19_to_x28[1] = argument;
  frame.x30 = reinterpret_cast<void*>(&mfa_fiber_start);
  void* stack_pointer = static_cast<char*>(stack.top()) - sizeof(InitialFrame);
  std::memcpy(stack_pointer, &frame, sizeof frame);
  context.stack_pointer = stack_pointer;
}

const char* fiber_switch_implementation() { return "aarch64-asm"; }

}  // namespace mfa::cpu

#endif
