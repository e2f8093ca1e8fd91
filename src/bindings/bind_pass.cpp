// Prepared passes: a pass's dispatches resolved once, then run on the caller's
// arrays with one call. This is the warm path of every op, so `run` reads the
// arrays through the buffer protocol directly (no numpy calls, no copies). An
// array over a pool Buffer of the pass's device (an op's output, or a view of
// one) binds that Buffer at its offset: no wrapping, no staging.
#include <Python.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.hpp"
#include "mfa/errors.hpp"
#include "mfa/prepared_pass.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace mfa::bindings {

namespace {

using Extent = std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>;
// (buffer index, "array" | "intermediate" | "constant", slot)
using BindingSpec = std::tuple<int, std::string, std::size_t>;
using DispatchSpec = std::tuple<const Pipeline*, Extent, Extent, std::vector<BindingSpec>, std::vector<std::size_t>>;

Size3 to_size(const Extent& e) { return Size3{std::get<0>(e), std::get<1>(e), std::get<2>(e)}; }

PassBinding::Source source_of(const std::string& name) {
  if (name == "array") return PassBinding::Source::array;
  if (name == "intermediate") return PassBinding::Source::intermediate;
  if (name == "constant") return PassBinding::Source::constant;
  throw ArgumentError("a pass binding's source is 'array', 'intermediate' or 'constant', got '" + name + "'");
}

// The Buffer whose memory `object` views: the end of its chain of numpy `base`s
// (a view's base is the array it views; an op output's is its Buffer), or nullptr.
const Buffer* viewed_buffer(PyObject* object) {
  static PyObject* const base_name = PyUnicode_InternFromString("base");
  nb::object base = nb::borrow(object);
  constexpr int kMaxDepth = 64;  // numpy collapses view chains; this only stops odd objects' endless bases
  for (int depth = 0; depth < kMaxDepth; ++depth) {
    if (nb::isinstance<Buffer>(base)) return nb::inst_ptr<Buffer>(base);
    PyObject* next = PyObject_GetAttr(base.ptr(), base_name);
    if (!next) {
      PyErr_Clear();
      return nullptr;
    }
    base = nb::steal(next);
    if (base.is_none()) return nullptr;
  }
  return nullptr;
}

// Rebinds `array` as part of a pool Buffer of `device` when its memory lies inside one.
void bind_pool_memory(PassArray& array, PyObject* object, const Device& device) {
  const Buffer* buffer = viewed_buffer(object);
  if (!buffer || buffer->pool() != &device.buffer_pool()) return;
  const auto* first = static_cast<const unsigned char*>(array.host);
  const auto* begin = static_cast<const unsigned char*>(buffer->data());
  if (first < begin || std::size_t(first - begin) + array.bytes > buffer->size()) return;
  array = PassArray{nullptr, 0, *buffer, std::size_t(first - begin)};
}

// Buffer-protocol views of a run's arrays, released (with the GIL held) when it ends.
class Views {
 public:
  Views() = default;
  Views(const Views&) = delete;
  Views& operator=(const Views&) = delete;
  ~Views() {
    for (Py_buffer& view : views_) PyBuffer_Release(&view);
  }

  // The memory of `object` from its first element to one past its last.
  PassArray open(PyObject* object, const PassArraySlot& slot) {
    Py_buffer view;
    const int flags = PyBUF_STRIDES | (slot.writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, &view, flags) != 0) {
      PyErr_Clear();
      throw TypeError("'" + slot.name + "' must be a " + (slot.writable ? "writable " : "") +
                      "array exposing the buffer protocol (a numpy array)");
    }
    views_.push_back(view);
    std::size_t last = 0;
    for (int axis = 0; axis < view.ndim; ++axis) {
      const Py_ssize_t n = view.shape[axis];
      if (n == 0) return PassArray{view.buf, 0, {}, 0};
      if (n == 1) continue;  // a single index: its stride never matters
      if (view.strides[axis] < 0) throw ArgumentError("'" + slot.name + "' has a negative stride; pass a copy");
      last += std::size_t(n - 1) * std::size_t(view.strides[axis]);
    }
    return PassArray{view.buf, last + std::size_t(view.itemsize), {}, 0};
  }

 private:
  std::vector<Py_buffer> views_;
};

}  // namespace

void bind_pass(nb::module_& m) {
  nb::class_<PreparedPass>(m, "PreparedPass",
                           "A pass's dispatches, resolved once: run() binds the arrays and runs them in one batch.")
      .def(
          "__init__",
          [](PreparedPass* self, const Device& device, const std::vector<DispatchSpec>& dispatches,
             const std::vector<std::tuple<std::string, bool>>& arrays, const std::vector<std::size_t>& intermediates,
             const std::vector<nb::bytes>& constants) {
            std::vector<PassDispatch> resolved;
            for (const auto& [pipeline, groups, threads, bindings, memory] : dispatches) {
              if (!pipeline) throw ArgumentError("a pass dispatch needs a pipeline");
              PassDispatch dispatch{pipeline->shared_from_this(), to_size(groups), to_size(threads), {}, memory};
              for (const auto& [index, source, slot] : bindings)
                dispatch.bindings.push_back(PassBinding{index, source_of(source), slot});
              resolved.push_back(std::move(dispatch));
            }
            std::vector<PassArraySlot> slots;
            for (const auto& [name, writable] : arrays) slots.push_back(PassArraySlot{name, writable});
            std::vector<std::vector<unsigned char>> bytes;
            for (const nb::bytes& constant : constants) {
              const auto* data = static_cast<const unsigned char*>(constant.data());
              bytes.emplace_back(data, data + constant.size());
            }
            new (self) PreparedPass(device, std::move(resolved), std::move(slots), intermediates, std::move(bytes));
          },
          "device"_a, "dispatches"_a, "arrays"_a, "intermediates"_a, "constants"_a)
      .def(
          "run",
          [](const PreparedPass& pass, nb::handle arrays) {
            PyObject* sequence = PySequence_Fast(arrays.ptr(), "arrays must be a list or tuple");
            if (!sequence) throw nb::python_error();
            nb::object owner = nb::steal(sequence);
            const Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
            const std::vector<PassArraySlot>& slots = pass.arrays();
            if (std::size_t(count) != slots.size())
              throw ArgumentError("the pass takes " + std::to_string(slots.size()) + " arrays, got " +
                                  std::to_string(count));
            Views views;
            std::vector<PassArray> bound;
            bound.reserve(slots.size());
            PyObject** items = PySequence_Fast_ITEMS(sequence);
            for (Py_ssize_t i = 0; i < count; ++i) {
              nb::handle item(items[i]);
              if (nb::isinstance<Buffer>(item)) bound.push_back(PassArray{nullptr, 0, nb::cast<Buffer>(item), 0});
              else bound.push_back(views.open(items[i], slots[std::size_t(i)]));
              if (!bound.back().buffer && bound.back().bytes)
                bind_pool_memory(bound.back(), items[i], pass.device());
            }
            nb::gil_scoped_release release;
            return pass.run(bound);
          },
          "arrays"_a,
          "Runs the pass: arrays[i] fills array slot i (numpy arrays in place, or core Buffers). "
          "Returns each dispatch's DispatchStats.");
}

}  // namespace mfa::bindings
