// How shim code reaches the executor beyond the collectives: the caller's
// location for diagnostics, and failing the dispatch. Part of the shim metal_stdlib.
#pragma once

namespace mfa_shim {

// Where a shim function is called from: a defaulted last parameter, so that
// __builtin_FILE/LINE name the caller's (#line'd .metal) file and line.
struct call_site {
  explicit call_site(const char* file_name = __builtin_FILE(), int line_number = __builtin_LINE())
      : file(file_name), line(line_number) {}
  const char* file;
  int line;
};

// Ends the dispatch with `message`; the runtime never returns from fail().
[[noreturn]] inline void fail(mfa_abi::ThreadState* thread, const char* message) {
  thread->dispatch->runtime->fail(thread, message);
  std::abort();
}

}  // namespace mfa_shim
