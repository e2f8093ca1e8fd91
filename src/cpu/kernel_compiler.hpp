// Turns the C++ translation of an MSL kernel into a loaded shared object,
// with an on-disk cache keyed by content, so a second process compiles nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "executor.hpp"
#include "shim/mfa_kernel_abi.h"

namespace mfa::cpu {

// A loaded kernel shared object; unloaded when the last reference goes.
class KernelBinary {
 public:
  KernelBinary(void* handle, std::string path);
  ~KernelBinary();
  KernelBinary(const KernelBinary&) = delete;
  KernelBinary& operator=(const KernelBinary&) = delete;

  KernelMain main() const { return main_; }
  const mfa_abi::KernelInfo& info() const { return *info_; }
  const std::string& path() const { return path_; }

 private:
  void* handle_;
  std::string path_;
  KernelMain main_ = nullptr;
  const mfa_abi::KernelInfo* info_ = nullptr;
};

struct CompilerStats {
  std::uint64_t compiles = 0;    // compiler invocations
  std::uint64_t disk_hits = 0;   // loaded from the disk cache
  std::uint64_t rebuilt = 0;     // corrupt or partial cache entries replaced
  double compile_seconds = 0;
};

class KernelCompiler {
 public:
  // The process-wide compiler: MFA_NATIVE_CXX, else g++ >= 12, else clang++ >= 15;
  // cache under MFA_NATIVE_CACHE_DIR, else $XDG_CACHE_HOME/mfa_native, else ~/.cache/mfa_native.
  static KernelCompiler& shared();

  // Compiles (or loads from the disk cache) `cpp_source`, a translation unit
  // produced by translate_msl. Throws CompileError carrying the compiler log,
  // with line numbers of the .metal text. Thread-safe.
  std::shared_ptr<const KernelBinary> compile(const std::string& cpp_source,
                                              const std::string& kernel_name);

  const std::string& compiler() const;        // path and version, for `info`
  const std::string& cache_dir() const;
  CompilerStats stats() const;
};

}  // namespace mfa::cpu
