// Devices, compiled libraries and pipelines, and what reflection reads from
// a kernel's signature.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "bindings.hpp"
#include "mfa/device.hpp"
#include "mfa/errors.hpp"
#include "mfa/pipeline.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace mfa::bindings {

namespace {

const char* to_string(ArgumentKind kind) {
  switch (kind) {
    case ArgumentKind::buffer: return "buffer";
    case ArgumentKind::threadgroup_memory: return "threadgroup_memory";
    case ArgumentKind::builtin: return "builtin";
  }
  return "unknown";
}

const char* to_string(AddressSpace space) {
  switch (space) {
    case AddressSpace::none: return "none";
    case AddressSpace::device: return "device";
    case AddressSpace::constant: return "constant";
    case AddressSpace::threadgroup: return "threadgroup";
  }
  return "unknown";
}

nb::dict to_dict(const std::vector<std::pair<std::string, std::string>>& pairs) {
  nb::dict d;
  for (const auto& [key, value] : pairs) d[key.c_str()] = value;
  return d;
}

using ConstantKey = std::variant<int, std::string>;

CompileOptions make_options(bool fast_math, bool bounds_check, const std::string& sanitize,
                            const std::vector<std::pair<std::string, std::string>>& macros) {
  CompileOptions options;
  options.fast_math = fast_math;
  options.bounds_check = bounds_check;
  options.sanitize = sanitize;
  options.macros = macros;
  return options;
}

}  // namespace

void bind_device(nb::module_& m) {
  nb::class_<ArgumentInfo>(m, "ArgumentInfo", "One kernel parameter, as reflection reads it.")
      .def_ro("name", &ArgumentInfo::name)
      .def_prop_ro("kind", [](const ArgumentInfo& a) { return to_string(a.kind); })
      .def_ro("index", &ArgumentInfo::index)
      .def_prop_ro("space", [](const ArgumentInfo& a) { return to_string(a.space); })
      .def_ro("type", &ArgumentInfo::type)
      .def_ro("is_pointer", &ArgumentInfo::is_pointer)
      .def_ro("is_const", &ArgumentInfo::is_const)
      .def_ro("builtin", &ArgumentInfo::builtin)
      .def_ro("builtin_type", &ArgumentInfo::builtin_type)
      .def("__repr__", [](const ArgumentInfo& a) {
        return "<ArgumentInfo " + a.name + ": " + to_string(a.kind) + "(" + std::to_string(a.index) + ") " + a.type +
               (a.is_pointer ? "*" : "&") + ">";
      });

  nb::class_<FunctionConstantInfo>(m, "FunctionConstantInfo", "A [[function_constant(i)]] declaration.")
      .def_ro("name", &FunctionConstantInfo::name)
      .def_ro("index", &FunctionConstantInfo::index)
      .def_ro("type", &FunctionConstantInfo::type)
      .def_ro("required", &FunctionConstantInfo::required);

  nb::class_<FunctionInfo>(m, "FunctionInfo", "A kernel's signature.")
      .def_ro("name", &FunctionInfo::name)
      .def_ro("arguments", &FunctionInfo::arguments)
      .def_ro("constants", &FunctionInfo::constants);

  nb::class_<Library>(m, "Library", "Compiled MSL source (cached by source and compile options).")
      .def_prop_ro("key", &Library::key)
      .def_prop_ro("functions", &Library::functions)
      .def("function", &Library::function, "name"_a, nb::rv_policy::copy);

  nb::class_<Pipeline>(m, "Pipeline", "A kernel specialized for function-constant values (cached).")
      .def_prop_ro("name", &Pipeline::name)
      .def_prop_ro("key", &Pipeline::key)
      .def_prop_ro("function", &Pipeline::function)
      .def_prop_ro("max_total_threads_per_threadgroup", &Pipeline::max_total_threads_per_threadgroup)
      .def("argument_size", [](const Pipeline& p, int index) { return p.backend().argument_size(index); },
           "index"_a, "sizeof the type [[buffer(index)]] points or refers to; 0 when unknown");

  nb::class_<TuningFacts>(m, "TuningFacts",
                          "What code generation tunes for: tile-table family, parallel width and tensor ops.")
      .def_ro("family", &TuningFacts::family, "tile-table family, 'apple7' .. 'apple10'")
      .def_ro("parallel_threadgroups", &TuningFacts::parallel_threadgroups, "threadgroups the device runs at once")
      .def_ro("model", &TuningFacts::model, "the device model tuned tables are kept per, e.g. 'Apple M3 Max, 40 GPU cores'")
      .def_ro("tensor_ops", &TuningFacts::tensor_ops,
              "whether codegen may write Metal 4 tensor-op kernels: an M5 on macOS 26.2 or later "
              "(the cpu device: MFA_NATIVE_TENSOR_OPS=on)")
      .def("__repr__", [](const TuningFacts& t) {
        return "<TuningFacts family='" + t.family + "' parallel_threadgroups=" +
               std::to_string(t.parallel_threadgroups) + " model='" + t.model +
               "' tensor_ops=" + (t.tensor_ops ? "True" : "False") + ">";
      });

  // The docstrings are the API reference's (mkdocstrings renders them; Google style, Markdown).
  nb::class_<Device>(m, "Device", R"(A device that runs MSL kernels: kind "metal" or "cpu".

"metal" is an Apple GPU (macOS on Apple silicon); "cpu" is the cpu backend, which compiles
the same MSL to native code and runs it on the CPU's cores, on every platform. Get one from
`mfa_native.devices()` or `mfa_native.default_device()`; the ops, `Kernel` and `precompile`
take a Device, "cpu", "metal" or None (the default device). Devices compare equal by kind.
Each keeps its compiled kernels (`cache_stats()`), the pool of buffers outputs and
intermediates come from (`pool_stats()`), and counts of its command batches
(`batch_stats()`).

Example:
    ```python
    import mfa_native

    device = mfa_native.default_device()
    print(device.kind, device.name, device.limits["simd_width"])   # e.g. cpu ... 32
    print(device.cache_stats()["pipelines"], device.pool_stats()["bytes_in_use"])
    assert device in mfa_native.devices() and mfa_native.devices()[-1].kind == "cpu"
    ```
)")
      .def_prop_ro("kind", [](const Device& d) { return std::string(to_string(d.kind())); },
                   "\"metal\" or \"cpu\".")
      .def_prop_ro("name", &Device::name, "The device's name: the GPU's model, or the cpu backend and its threads.")
      .def_prop_ro("limits",
                   [](const Device& d) {
                     DeviceLimits l = d.limits();
                     nb::dict out;
                     out["max_threads_per_threadgroup"] = l.max_threads_per_threadgroup;
                     out["max_threadgroup_memory"] = l.max_threadgroup_memory;
                     out["simd_width"] = l.simd_width;
                     return out;
                   },
                   "A dict: max_threads_per_threadgroup, max_threadgroup_memory (bytes) and simd_width.")
      .def_prop_ro("properties", [](const Device& d) { return to_dict(d.properties()); },
                   "A dict of the backend's facts as text (the cpu backend: its compiler, cache_dir, "
                   "kernels_compiled, kernels_from_disk_cache, worker_threads, ...).")
      .def_prop_ro("tuning", &Device::tuning, "The typed tuning facts code generation reads (a TuningFacts).")
      .def(
          "library",
          [](const Device& d, const std::string& source, bool fast_math, bool bounds_check,
             const std::string& sanitize, const std::vector<std::pair<std::string, std::string>>& macros) {
            nb::gil_scoped_release release;
            return d.library(source, make_options(fast_math, bounds_check, sanitize, macros));
          },
          "source"_a, nb::kw_only(), "fast_math"_a = false, "bounds_check"_a = false, "sanitize"_a = "",
          "macros"_a = std::vector<std::pair<std::string, std::string>>{},
          "Compiles MSL source into a Library (cached per source and options; raises CompileError). "
          "`mfa_native.Kernel` is the usual way in.")
      .def(
          "pipeline",
          // By reference: a shared_ptr made from a Python object would keep that
          // object alive from inside the process-wide cache.
          [](const Device& d, const Library& library, const std::string& entry,
             const std::vector<std::pair<ConstantKey, ConstantValue>>& constants) {
            FunctionConstants values;
            for (const auto& [key, value] : constants) {
              if (std::holds_alternative<int>(key)) values.set(std::get<int>(key), value);
              else values.set(std::get<std::string>(key), value);
            }
            nb::gil_scoped_release release;
            return d.pipeline(library.shared_from_this(), entry, values);
          },
          "library"_a, "entry"_a, "constants"_a = std::vector<std::pair<ConstantKey, ConstantValue>>{},
          "The Pipeline of a Library's kernel `entry` with function constants (name or index, value); cached.")
      .def("cache_stats",
           [](const Device& d) {
             PipelineCacheStats s = d.pipeline_cache().stats();
             nb::dict out;
             out["library_hits"] = s.library_hits;
             out["library_misses"] = s.library_misses;
             out["pipeline_hits"] = s.pipeline_hits;
             out["pipeline_misses"] = s.pipeline_misses;
             out["libraries"] = s.libraries;
             out["pipelines"] = s.pipelines;
             return out;
           },
           "A dict of the kernel caches' counts: library_hits, library_misses, pipeline_hits, pipeline_misses, "
           "libraries and pipelines held.")
      .def("pool_stats",
           [](const Device& d) {
             BufferPoolStats s = d.buffer_pool().stats();
             nb::dict out;
             out["hits"] = s.hits;
             out["misses"] = s.misses;
             out["trimmed"] = s.trimmed;
             out["bytes_cached"] = s.bytes_cached;
             out["bytes_in_use"] = s.bytes_in_use;
             out["limit"] = s.limit;
             return out;
           },
           "A dict of the buffer pool's counts: hits, misses, trimmed, bytes_cached, bytes_in_use and its limit.")
      .def("new_buffer", &Device::new_buffer, "nbytes"_a,
           "A Buffer of nbytes from the device's pool; it returns to the pool when the last reference dies.")
      .def("batch_stats",
           [](const Device& d) {
             BatchStats s = d.batch_stats();
             nb::dict out;
             out["committed"] = s.committed;
             out["bytes_host_bound"] = s.bytes_host_bound;
             out["bytes_staged_in"] = s.bytes_staged_in;
             out["bytes_copied_back"] = s.bytes_copied_back;
             return out;
           },
           "Command batches run on this device, and caller bytes bound by address, staged in and copied back.")
      .def("__eq__", [](const Device& a, const Device& b) { return a == b; })
      .def("__hash__", [](const Device& d) { return int(d.kind()); })
      .def("__repr__", [](const Device& d) {
        return std::string("<mfa_native.Device kind='") + to_string(d.kind()) + "' name='" + d.name() + "'>";
      });

  m.def("devices", &Device::available, "Every device available on this machine (metal first when present).");
  m.def("default_device", &Device::default_device,
        "MFA_NATIVE_DEVICE=cpu|metal when set, else metal where available, else cpu.");
  m.def("get_device", [](const std::string& kind) { return Device::get(device_kind_from_string(kind)); }, "kind"_a);
}

}  // namespace mfa::bindings
