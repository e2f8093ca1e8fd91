// cpu-backend internals the benchmarks measure.
#include "bindings.hpp"
#include "executor.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace mfa::bindings {

void bind_cpu(nb::module_& m) {
  m.def("cpu_context_switches_per_second", &cpu::measure_context_switches_per_second, "switches"_a,
        nb::call_guard<nb::gil_scoped_release>(), "Fiber context switches per second on this machine.");
  m.def("cpu_fiber_switch", &cpu::fiber_switch_implementation,
        "Which context switch the cpu backend uses: hand-written asm or ucontext.");
}

}  // namespace mfa::bindings
