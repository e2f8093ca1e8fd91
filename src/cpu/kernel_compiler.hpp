// Turns the C++ translation of an MSL kernel into a loaded shared object,
// with an on-disk cache keyed by content, so a second process compiles nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "executor.hpp"
#include "kernel_cache.hpp"
#include "precompiled_header.hpp"
#include "shim/mfa_kernel_abi.h"

namespace mfa::cpu {

// A loaded kernel shared object; unloaded when the last reference goes.
class KernelBinary {
 public:
  // dlopens `path` (RTLD_NOW | RTLD_LOCAL) and resolves the ABI symbols.
  // Throws mfa::Error if it does not load, lacks a symbol, or was built for
  // another ABI version.
  explicit KernelBinary(const std::string& path);
  KernelBinary(const KernelBinary&) = delete;
  KernelBinary& operator=(const KernelBinary&) = delete;

  KernelMain main() const { return main_; }
  const mfa_abi::KernelInfo& info() const { return *info_; }

 private:
  struct Unload {
    void operator()(void* handle) const;
  };
  std::unique_ptr<void, Unload> handle_;
  KernelMain main_ = nullptr;
  const mfa_abi::KernelInfo* info_ = nullptr;
};

// The C++ compiler kernels are built with.
struct HostCompiler {
  std::string path;      // what is run (searched on PATH when given without a slash)
  bool is_clang = false;
  int major_version = 0;
  std::string version;   // first line of `--version`
  std::string identity;  // path and full `--version` output: part of the cache key

  // MFA_NATIVE_CXX if set (it must work), else g++ >= 12, else clang++ >= 15
  // found on PATH (also versioned names such as g++-13, clang++-19).
  // Throws UnavailableError saying what was tried.
  static HostCompiler find();
  // Runs `program --version`; throws UnavailableError unless it is g++ >= 12 or clang++ >= 15.
  static HostCompiler probe(const std::string& program);
};

struct ShimFile {
  std::string name;  // path inside the include directory (a/b.h in a subdirectory)
  std::string text;
};

// The shim headers embedded in this library (src/cpu/shim/).
std::vector<ShimFile> embedded_shim_files();

// MFA_NATIVE_CACHE_DIR, else $XDG_CACHE_HOME/mfa_native, else ~/.cache/mfa_native.
std::string default_cache_dir();

// MFA_NATIVE_SHIM_LAYOUT_SEED (a non-negative integer), else 0: the seed from which
// tensor-op kernels draw their cooperative tensors' layout (mfa_cooperative_tensor.h).
// Throws ArgumentError for anything else.
std::uint64_t default_layout_seed();

// "<cache_dir>/pch": the precompiled headers (precompiled_header.hpp).
std::string precompiled_headers_directory(const std::string& cache_dir);

struct CompilerStats {
  std::uint64_t compiles = 0;    // compiler invocations
  std::uint64_t disk_hits = 0;   // loaded from the disk cache
  std::uint64_t rebuilt = 0;     // corrupt or partial cache entries replaced
  std::uint64_t evicted = 0;     // least recently used entries removed to stay under the limit
  double compile_seconds = 0;
  std::uint64_t headers_built = 0;  // precompiled headers built (precompiled_header.hpp)
};

class KernelCompiler {
 public:
  struct Config {
    HostCompiler compiler;
    std::string cache_dir;
    std::vector<ShimFile> shim_files;  // laid out under <cache_dir>/shim-<hash>/ for -I
    std::uint64_t max_bytes = kDefaultCacheMaxBytes;  // of the kernels directory (kernel_cache.hpp)
    std::uint64_t layout_seed = 0;  // tensor-op kernels' MFA_SHIM_LAYOUT_SEED (part of the key)
  };

  explicit KernelCompiler(Config config);

  // The process-wide compiler: HostCompiler::find(), default_cache_dir(),
  // the embedded shim, default_cache_max_bytes() and default_layout_seed().
  // Throws UnavailableError when there is no compiler.
  static KernelCompiler& shared();

  // Compiles (or loads from the disk cache) `cpp_source`, a translation unit
  // produced by translate_msl. Throws CompileError carrying the compiler log,
  // with line numbers of the .metal text. Thread-safe; concurrent compiles of
  // one source, in threads or processes, are safe (one of them wins). A build
  // then evicts least recently used entries past Config::max_bytes.
  // `extra_flags` (e.g. -fsanitize=address) follow the usual flags and are keyed.
  // A unit that includes <metal_tensor> or MetalPerformancePrimitives compiles
  // as C++20 with -DMFA_SHIM_LAYOUT_SEED=<Config::layout_seed>, also keyed.
  std::shared_ptr<const KernelBinary> compile(const std::string& cpp_source, const std::string& kernel_name,
                                              const std::vector<std::string>& extra_flags = {});

  const std::string& compiler() const { return description_; }  // path and version, for `info`
  const std::string& cache_dir() const { return cache_dir_; }
  std::uint64_t max_bytes() const { return max_bytes_; }
  const std::vector<std::string>& flags() const { return flags_; }
  CompilerStats stats() const;

 private:
  // nullptr when there is no intact entry (a damaged one is deleted); a hit
  // makes the entry the most recently used.
  std::shared_ptr<const KernelBinary> load_cached(const std::string& library, const std::string& sidecar);
  std::shared_ptr<const KernelBinary> build(const std::string& cpp_source, const std::string& kernel_name,
                                            const std::vector<std::string>& extra_flags, const std::string& build_key,
                                            const std::string& stem);
  void write_shim();  // lays out the shim headers for -I unless they are there

  HostCompiler host_;
  std::string description_;
  std::string cache_dir_;
  std::string kernels_dir_;
  std::uint64_t max_bytes_;
  std::uint64_t layout_seed_;
  std::vector<ShimFile> shim_files_;
  std::string shim_hash_;
  std::string shim_dir_;
  std::vector<std::string> flags_;
  PrecompiledHeaders headers_;

  std::mutex shim_mutex_;      // one thread writes the shim directory
  mutable std::mutex mutex_;  // guards stats_
  CompilerStats stats_;
};

}  // namespace mfa::cpu
