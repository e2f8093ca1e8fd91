// Command batches: record dispatches with their bindings, run them, and
// report what each did.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <Python.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "bindings.hpp"
#include "mfa/command_batch.hpp"
#include "mfa/dispatch_timing.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace mfa::bindings {

namespace {

using Extent = std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>;
// (index, address, bytes, writable): caller memory that Python keeps alive
// until the batch is waited for.
using HostBinding = std::tuple<int, std::uintptr_t, std::size_t, bool>;
using InlineBinding = std::tuple<int, nb::bytes>;
// (index, buffer, offset): device memory, e.g. a Metal tensor from DLPack.
using BufferBinding = std::tuple<int, Buffer, std::size_t>;

Size3 to_size(const Extent& e) { return Size3{std::get<0>(e), std::get<1>(e), std::get<2>(e)}; }

// Bytes read or written per argument name, or None where the backend cannot count.
using TrafficByName = std::optional<std::map<std::string, std::uint64_t>>;

TrafficByName traffic_by_name(const DispatchStats& stats, std::uint64_t BufferTraffic::*bytes) {
  if (!stats.traffic) return std::nullopt;
  std::map<std::string, std::uint64_t> by_name;
  for (const BufferTraffic& buffer : *stats.traffic) by_name[buffer.name] = buffer.*bytes;
  return by_name;
}

std::string optional_text(const std::optional<std::uint64_t>& value) {
  return value ? std::to_string(*value) : "None";
}

// e.g. "{'q': 1024, 'o': 0}", or "None".
std::string traffic_text(const TrafficByName& traffic) {
  if (!traffic) return "None";
  std::string text;
  for (const auto& [name, bytes] : *traffic) text += (text.empty() ? "'" : ", '") + name + "': " + std::to_string(bytes);
  return "{" + text + "}";
}

// The buffer protocol of a Buffer: its bytes, writable, one dimension of unsigned bytes.
// numpy arrays over it (runtime/pool_arrays.py) keep the Buffer as their base.
int buffer_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  const Buffer* buffer = nb::inst_ptr<Buffer>(self);
  return PyBuffer_FillInfo(view, self, buffer->data(), Py_ssize_t(buffer->size()), 0, flags);
}

PyType_Slot buffer_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(buffer_getbuffer)}, {0, nullptr}};

// A context manager that holds a DispatchTiming request while its block runs.
struct TimingScope {
  std::optional<DispatchTiming> request;
};

}  // namespace

void bind_dispatch(nb::module_& m) {
  // The docstring is the API reference's (mkdocstrings renders it; Google style, Markdown).
  nb::class_<DispatchStats>(m, "DispatchStats", R"(What one dispatch did; None where the backend cannot count it.

`Kernel.__call__` returns one; `mfa_native.profile()` records one per dispatch of the ops (as a
DispatchRecord). The cpu backend counts everything exactly; Metal gives the time, not the
traffic or the matrix operations. Byte counts are accesses, not distinct bytes: an element
read n times counts n times.

Example:
    ```python
    import numpy as np
    import mfa_native

    source = '''
    kernel void twice(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
        x[i] = 2.0f * x[i];
    }
    '''
    x = np.ones(64, dtype=np.float32)
    stats = mfa_native.Kernel(source, "twice", device="cpu")([x], threadgroups=2, threads_per_threadgroup=32)
    print(stats)   # <DispatchStats kernel='twice' threadgroups=2 ... bytes_read={'x': 256} ...>
    assert stats.threadgroups == 2 and stats.bytes_read == {"x": 256} and stats.bytes_written == {"x": 256}
    ```
)")
      .def_ro("kernel", &DispatchStats::kernel, "The kernel's entry point name.")
      .def_ro("threadgroups", &DispatchStats::threadgroups, "Threadgroups dispatched (the grid's product).")
      .def_ro("simdgroup_matrix_ops", &DispatchStats::simdgroup_matrix_ops,
              "Simdgroup 8x8x8 multiply-accumulates issued (cpu backend), or None.")
      .def_ro("barriers", &DispatchStats::barriers, "Threadgroup barriers passed (cpu backend), or None.")
      .def_ro("seconds", &DispatchStats::seconds,
              "The dispatch's time: the cpu backend's wall time, Metal's GPU timestamps; None where not sampled.")
      .def_prop_ro(
          "bytes_read", [](const DispatchStats& s) { return traffic_by_name(s, &BufferTraffic::bytes_read); },
          "Device bytes read per pointer argument name (cpu backend: exact), or None.")
      .def_prop_ro(
          "bytes_written", [](const DispatchStats& s) { return traffic_by_name(s, &BufferTraffic::bytes_written); },
          "Device bytes written per pointer argument name (cpu backend: exact), or None.")
      .def("__repr__", [](const DispatchStats& s) {
        std::string secs = s.seconds ? std::to_string(*s.seconds) : "None";
        return "<DispatchStats kernel='" + s.kernel + "' threadgroups=" + std::to_string(s.threadgroups) +
               " simdgroup_matrix_ops=" + optional_text(s.simdgroup_matrix_ops) +
               " barriers=" + optional_text(s.barriers) + " seconds=" + secs +
               " bytes_read=" + traffic_text(traffic_by_name(s, &BufferTraffic::bytes_read)) +
               " bytes_written=" + traffic_text(traffic_by_name(s, &BufferTraffic::bytes_written)) + ">";
      });

  nb::class_<Buffer>(m, "Buffer",
                     "Device memory owned by the core (or wrapped from another framework); its bytes are "
                     "host-visible through the buffer protocol.",
                     nb::type_slots(buffer_slots))
      .def_prop_ro("size", &Buffer::size);

  nb::class_<CommandBatch>(m, "CommandBatch", "Dispatches run in order: record, commit(), wait().")
      .def(nb::init<Device>(), "device"_a)
      .def(
          "dispatch",
          [](CommandBatch& batch, const Pipeline& pipeline, const Extent& threadgroups,
             const Extent& threads, const std::vector<HostBinding>& host, const std::vector<InlineBinding>& inline_bytes,
             const std::vector<BufferBinding>& buffers, const std::vector<std::size_t>& threadgroup_memory) {
            auto ref = batch.dispatch(pipeline.shared_from_this(), to_size(threadgroups), to_size(threads));
            for (const auto& [index, address, bytes, writable] : host)
              ref.host(index, reinterpret_cast<void*>(address), bytes, writable);
            for (const auto& [index, data] : inline_bytes) ref.bytes(index, data.c_str(), data.size());
            for (const auto& [index, buffer, offset] : buffers) ref.buffer(index, buffer, offset);
            for (std::size_t i = 0; i < threadgroup_memory.size(); ++i)
              if (threadgroup_memory[i]) ref.threadgroup_memory(int(i), threadgroup_memory[i]);
          },
          "pipeline"_a, "threadgroups"_a, "threads_per_threadgroup"_a, "host"_a, "inline"_a, "buffers"_a,
          "threadgroup_memory"_a)
      .def("commit", &CommandBatch::commit)
      .def("wait", &CommandBatch::wait, nb::call_guard<nb::gil_scoped_release>())
      .def("run", &CommandBatch::run, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<TimingScope>(m, "DispatchTiming",
                          "with DispatchTiming(): batches committed inside the block time every dispatch "
                          "(DispatchStats.seconds), also where that costs something (Metal)")
      .def(nb::init<>())
      .def("__enter__", [](TimingScope& scope) { scope.request.emplace(); })
      .def("__exit__", [](TimingScope& scope, nb::args) { scope.request.reset(); });
  m.def("dispatch_timing_requested", &DispatchTiming::requested,
        "whether some DispatchTiming block is active (in any thread)");
}

}  // namespace mfa::bindings
