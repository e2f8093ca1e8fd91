// The interface each backend (cpu, metal) implements. Everything that is not
// backend-specific (caching, pooling, validation, host-memory staging) lives
// in the core around it, so a backend stays thin.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mfa/buffer.hpp"
#include "mfa/reflection.hpp"
#include "mfa/types.hpp"

namespace mfa {

class Pipeline;

// How MSL source is compiled. Part of the library cache key.
struct CompileOptions {
  std::string language_version = "3.1";  // Metal: pinned (or the OS's highest if above)
  bool fast_math = false;                 // Metal math mode; kernels call fast:: explicitly
  // cpu backend: check every access to a device buffer, threadgroup array,
  // [[threadgroup(i)]] block and thread-local array against its exact extent
  // (MFA_NATIVE_BOUNDS_CHECK=1 turns it on for every library of the cpu device).
  bool bounds_check = false;
  // cpu backend: "" or "race" (report threadgroup-memory data races as
  // DispatchError). Left empty, the cpu device takes MFA_NATIVE_SANITIZE.
  std::string sanitize;
  std::vector<std::pair<std::string, std::string>> macros;  // preprocessor definitions

  std::string cache_key() const;  // canonical text of every field
};

class BackendLibrary {
 public:
  virtual ~BackendLibrary() = default;
};

class BackendPipeline {
 public:
  virtual ~BackendPipeline() = default;
  virtual std::uint32_t max_total_threads_per_threadgroup() const = 0;
  // sizeof the type a [[buffer(index)]] argument points or refers to, or 0
  // when the backend cannot tell (used to check inline bytes and references).
  virtual std::size_t argument_size(int index) const = 0;
};

// One bound argument of a dispatch: a buffer at an offset, or inline bytes
// (Metal's setBytes) for small constant arguments.
struct Binding {
  int index = -1;
  Buffer buffer;                    // set for buffers
  std::size_t offset = 0;
  std::vector<unsigned char> bytes; // set for inline bytes
  bool read_only = false;           // caller memory the kernel must not write
};

// A validated dispatch, as the core hands it to a backend.
struct Dispatch {
  std::shared_ptr<const Pipeline> pipeline;
  Size3 threadgroups;
  Size3 threads_per_threadgroup;
  std::vector<Binding> bindings;                // sorted by index, each index once
  std::vector<std::size_t> threadgroup_memory;  // byte length of [[threadgroup(i)]]
};

// Work handed to a backend; wait() blocks until it is done and throws
// DispatchError naming the kernel if any dispatch failed.
class Submission {
 public:
  virtual ~Submission() = default;
  virtual std::vector<DispatchStats> wait() = 0;
};

// What code generation tunes for, as typed values.
struct TuningFacts {
  std::string family;                        // tile-table family: "apple7" .. "apple10"
  std::uint32_t parallel_threadgroups = 0;   // threadgroups the device runs at once
  // The device model tuned tables are kept per: Metal, the GPU's name and core
  // count ("Apple M3 Max, 40 GPU cores"; the name alone where the registry has
  // no count); cpu, "cpu". Stable across runs and processes.
  std::string model;
  // Whether code generation may write Metal 4 tensor-op kernels (<metal_tensor>,
  // MetalPerformancePrimitives) for the device: Metal, an Apple10 GPU (M5) on macOS 26.2 or
  // later; cpu, only when MFA_NATIVE_TENSOR_OPS=on. MFA_NATIVE_TENSOR_OPS=off makes it false.
  bool tensor_ops = false;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DeviceKind kind() const = 0;
  virtual std::string name() const = 0;
  virtual DeviceLimits limits() const = 0;
  // Facts for `python -m mfa_native info`: GPU family, compiler, cache dir, ...
  virtual std::vector<std::pair<std::string, std::string>> properties() const = 0;
  virtual TuningFacts tuning() const = 0;

  virtual std::shared_ptr<BackendLibrary> compile_library(const std::string& source,
                                                          const CompileOptions& options) = 0;
  // The library of `source` made from `binary`, this backend's compiled form
  // of it (a Metal library a bundle stores: `bundle --metallib`), built from
  // `source` with `options`. A backend that runs no such binaries (cpu) keeps
  // this default and compiles the source.
  virtual std::shared_ptr<BackendLibrary> load_library(const std::string& source,
                                                       const std::vector<unsigned char>& binary,
                                                       const CompileOptions& options) {
    (void)binary;
    return compile_library(source, options);
  }
  // `constants` maps every function constant the caller set, by index, to its value.
  virtual std::shared_ptr<BackendPipeline> make_pipeline(
      const BackendLibrary& library, const FunctionInfo& function,
      const std::map<int, ConstantValue>& constants) = 0;

  virtual std::shared_ptr<BufferStorage> allocate(std::size_t bytes) = 0;
  // Storage over caller memory without a copy, or nullptr when this backend
  // cannot use that memory directly (the core then stages through the pool).
  virtual std::shared_ptr<BufferStorage> wrap_host(void* data, std::size_t bytes) = 0;
  virtual std::size_t page_size() const = 0;
  virtual std::size_t recommended_pool_limit() const = 0;

  // Runs the dispatches in order; each sees the writes of the ones before.
  // With `time_each_dispatch` (DispatchTiming::requested()), every dispatch's
  // stats carry its seconds even where measuring them costs something (Metal:
  // an encoder per dispatch); without, a backend reports the seconds it has
  // for free.
  virtual std::unique_ptr<Submission> submit(std::vector<Dispatch> dispatches, bool time_each_dispatch) = 0;
};

}  // namespace mfa
