// The x86-64 SysV context switch: pushes the callee-saved registers, MXCSR and
// the x87 control word on the running stack, swaps stack pointers, pops.
#include "fiber.hpp"

#if !defined(MFA_FIBER_USES_UCONTEXT) && defined(__x86_64__)

#include <cstdint>
#include <cstring>

#include "fiber_asm.hpp"

extern "C" __attribute__((visibility("hidden"))) void mfa_fiber_start();

// mfa_fiber_switch(void** save_stack_pointer /* rdi */, void* resume_stack_pointer /* rsi */)
// Frame, from the saved stack pointer up: MXCSR (4 bytes), x87 control word
// (2 bytes, padded to 8), r15, r14, r13, r12, rbx, rbp, return address.
asm(MFA_ASM_FUNCTION_BEGIN("mfa_fiber_switch")
    "  endbr64\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    MFA_ASM_FUNCTION_END("mfa_fiber_switch")
    // A fresh fiber "returns" here from its first switch with the entry in
    // r12 and its argument in r13, and rsp 16-byte aligned, so the call
    // leaves rsp at 8 mod 16 at the entry as the ABI requires. The entry
    // never returns. No caller frame above: unwinders stop here.
    MFA_ASM_FUNCTION_BEGIN("mfa_fiber_start")
    "  .cfi_startproc\n"
    "  .cfi_undefined rip\n"
    "  endbr64\n"
    "  movq %r13, %rdi\n"
    "  callq *%r12\n"
    "  ud2\n"
    "  .cfi_endproc\n"
    MFA_ASM_FUNCTION_END("mfa_fiber_start"));

namespace mfa::cpu {
namespace {

// The frame mfa_fiber_switch pops, as laid out in memory.
struct InitialFrame {
  std::uint32_t mxcsr;
  std::uint16_t x87_control_word;
  std::uint16_t padding;
  void* r15;
  void* r14;
  void* r13;
  void* r12;
  void* rbx;
  void* rbp;
  void* return_address;
};
static_assert(sizeof(InitialFrame) == 64, "mfa_fiber_switch pops 64 bytes");

}  // namespace

void prepare_fiber(FiberContext& context, FiberStack& stack, FiberEntry entry, void* argument) {
  // The top of the stack is page aligned, so the frame's end (where rsp is
  // when mfa_fiber_start runs) is 16-byte aligned.
#ifdef MFA_FIBER_SANITIZERS
  sanitizer_prepare_fiber(context, stack, entry, argument);
#endif
  InitialFrame frame{};
  asm volatile("stmxcsr %0" : "=m"(frame.mxcsr));
  asm volatile("fnstcw %0" : "=m"(frame.x87_control_word));
  frame.r13 = argument;
  frame.r12 = reinterpret_cast<void*>(entry);
  frame.return_address = reinterpret_cast<void*>(&mfa_fiber_start);
  void* stack_pointer = static_cast<char*>(stack.top()) - sizeof(InitialFrame);
  std::memcpy(stack_pointer, &frame, sizeof frame);
  context.stack_pointer = stack_pointer;
}

const char* fiber_switch_implementation() { return "x86_64-asm"; }

}  // namespace mfa::cpu

#endif
