// Assembler directives shared by the hand-written context switches (and the
// tests that check them), so one asm text serves ELF (Linux) and Mach-O
// (macOS) objects.
#pragma once

#if defined(__APPLE__)
#define MFA_ASM_SYMBOL(name) "_" name
#define MFA_ASM_FUNCTION_BEGIN(name) \
  ".text\n.globl _" name "\n.private_extern _" name "\n.p2align 4\n_" name ":\n"
#define MFA_ASM_FUNCTION_END(name) ""
#else
#define MFA_ASM_SYMBOL(name) name
#define MFA_ASM_FUNCTION_BEGIN(name) \
  ".text\n.globl " name "\n.hidden " name "\n.type " name ", %function\n.p2align 4\n" name ":\n"
#define MFA_ASM_FUNCTION_END(name) ".size " name ", .-" name "\n"
#endif
