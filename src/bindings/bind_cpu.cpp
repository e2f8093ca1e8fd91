// cpu-backend internals: what the benchmarks measure, and the kernel disk cache.
#include <nanobind/stl/string.h>

#include <filesystem>

#include "bindings.hpp"
#include "executor.hpp"
#include "kernel_cache.hpp"
#include "kernel_compiler.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace mfa::bindings {
namespace {

// The cache the cpu backend of this process uses (MFA_NATIVE_CACHE_DIR, ...):
// found without a compiler, so `cache info|clear` work where kernels cannot be built.
std::string kernels_dir() { return cpu::kernels_directory(cpu::default_cache_dir()); }

nb::dict cache_info() {
  const std::string dir = kernels_dir();
  const std::uint64_t max_bytes = cpu::default_cache_max_bytes();
  cpu::CacheUsage usage;
  {
    nb::gil_scoped_release released;
    usage = cpu::cache_usage(dir);
  }
  nb::dict info;
  info["dir"] = dir;
  info["entries"] = usage.entries;
  info["bytes"] = usage.bytes;
  info["max_bytes"] = max_bytes;
  return info;
}

nb::dict cache_clear() {
  const std::string dir = kernels_dir();
  cpu::Eviction eviction;
  {
    nb::gil_scoped_release released;
    eviction = cpu::evict_least_recently_used(dir, 0);
    // The precompiled headers go too; a compile that was about to read one parses its preamble instead.
    std::error_code ignored;
    std::filesystem::remove_all(cpu::precompiled_headers_directory(cpu::default_cache_dir()), ignored);
  }
  nb::dict cleared;
  cleared["dir"] = dir;
  cleared["entries"] = eviction.entries;
  cleared["bytes"] = eviction.bytes;
  cleared["in_use"] = eviction.in_use;
  return cleared;
}

}  // namespace

void bind_cpu(nb::module_& m) {
  m.def("cpu_context_switches_per_second", &cpu::measure_context_switches_per_second, "switches"_a,
        nb::call_guard<nb::gil_scoped_release>(), "Fiber context switches per second on this machine.");
  m.def("cpu_fiber_switch", &cpu::fiber_switch_implementation,
        "Which context switch the cpu backend uses: hand-written asm or ucontext.");
  m.def("cpu_kernel_cache_info", &cache_info,
        "The cpu backend's kernel disk cache: dir, entries, bytes and max_bytes (MFA_NATIVE_CACHE_MAX_BYTES).");
  m.def("cpu_kernel_cache_clear", &cache_clear,
        "Removes every entry of the kernel disk cache that no process is loading; returns dir, entries and "
        "bytes removed, and in_use (entries kept).");
}

}  // namespace mfa::bindings
