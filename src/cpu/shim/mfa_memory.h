// Threadgroup memory the front end's rewrites rely on: kernel-scope
// threadgroup variables (threadgroup_alloc). Part of the shim metal_stdlib.
#pragma once

#ifdef MFA_SHIM_ADDRESS_CHECK
#include <sanitizer/asan_interface.h>
#endif

namespace mfa_shim {

#ifdef MFA_SHIM_ADDRESS_CHECK
// sanitize="address": a poisoned gap after each variable, so that ASan reports
// an access past its end (the scheduler unpoisons the block at group start).
constexpr size_t kThreadgroupRedzone = 32;
#else
constexpr size_t kThreadgroupRedzone = 0;
#endif

// Storage for one kernel-scope `threadgroup` variable. Every thread of the
// group declares the same variables in the same order, so every thread gets
// the same address. Fails the dispatch when the variables no longer fit
// beside the [[threadgroup(i)]] arguments.
inline void* threadgroup_alloc(size_t bytes, size_t align) {
  mfa_abi::ThreadState* const thread = mfa_abi::current_thread;
  unsigned char* const memory = thread->group->threadgroup_memory;
  const uintptr_t base = reinterpret_cast<uintptr_t>(memory);
  const size_t start = ((base + thread->static_cursor + align - 1) & ~(uintptr_t(align) - 1)) - base;
  const size_t end = start + bytes;
  const size_t limit = thread->dispatch->threadgroup_memory_limit;
  if (end > limit) {
    const size_t arguments = thread->group->static_base;
    char message[200];
    std::snprintf(message, sizeof message,
                  "threadgroup memory over %zu KiB: kernel-scope threadgroup variables need %zu "
                  "bytes after %zu bytes of [[threadgroup]] arguments",
                  limit / 1024, end - arguments, arguments);
    fail(thread, message);
  }
  thread->static_cursor = end + kThreadgroupRedzone < limit ? end + kThreadgroupRedzone : limit;
#ifdef MFA_SHIM_ADDRESS_CHECK
  ASAN_POISON_MEMORY_REGION(memory + end, thread->static_cursor - end);
#endif
  return memory + start;
}

}  // namespace mfa_shim
