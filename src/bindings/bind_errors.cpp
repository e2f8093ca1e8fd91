// Maps the core's exceptions to Python's: bad values -> ValueError, bad types
// -> TypeError, a call the op does not compute -> NotImplementedError, and
// three mfa_native exceptions for the rest.
#include <Python.h>

#include "bindings.hpp"
#include "mfa/errors.hpp"

namespace nb = nanobind;

namespace mfa::bindings {

namespace {
PyObject* compile_error_type = nullptr;
PyObject* dispatch_error_type = nullptr;
PyObject* unavailable_error_type = nullptr;

PyObject* new_exception_type(nb::module_& m, const char* name, const char* doc) {
  const std::string qualified = std::string("mfa_native.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, PyExc_RuntimeError, nullptr);
  m.attr(name) = nb::handle(type);
  return type;
}
}  // namespace

void bind_errors(nb::module_& m) {
  // The docstrings are the API reference's (mkdocstrings renders them; Google style, Markdown).
  compile_error_type = new_exception_type(m, "CompileError", R"(Kernel source failed to compile.

`.log` holds the compiler's output (the Metal compiler's, or on the cpu backend the host
compiler's diagnostics, located in the `.metal` source); the message holds it too. Source
that mfa_native's own MSL reader rejects before any compiler runs (an unclosed bracket, no
kernel of that name) has an empty `.log`, and the message names the `.metal` line. Raised by
`Kernel` for source that does not compile (an op raises it only for a bug in its generated
code). A subclass of RuntimeError.

Example:
    ```python
    import mfa_native

    try:
        mfa_native.Kernel("kernel void broken() { undeclared_name = 1; }", "broken", device="cpu")
    except mfa_native.CompileError as error:
        log = error.log
    print(log)   # broken.metal:1:...: error: 'undeclared_name' was not declared in this scope
    assert "undeclared_name" in log
    ```
)");
  dispatch_error_type = new_exception_type(m, "DispatchError", R"(A kernel failed while running.

A cpu-backend diagnostic (with `Kernel(..., bounds_check=True)` or `sanitize`: the
out-of-bounds access or the data race, named with its thread and `.metal` line; a trap) or
a Metal command-buffer error. A subclass of RuntimeError.

Example:
    ```python
    import numpy as np
    import mfa_native

    source = '''
    kernel void fill(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
        out[i] = 1.0f;
    }
    '''
    kernel = mfa_native.Kernel(source, "fill", device="cpu", bounds_check=True)
    try:   # 8 threads write a buffer of 4 floats
        kernel([np.zeros(4, dtype=np.float32)], threadgroups=1, threads_per_threadgroup=8)
    except mfa_native.DispatchError as error:
        message = str(error)
    print(message)   # kernel 'fill': threadgroup (0, 0, 0), thread (4, 0, 0): out-of-bounds access ...
    assert "out-of-bounds" in message
    ```
)");
  unavailable_error_type = new_exception_type(m, "DeviceUnavailableError",
                                              R"(The requested device is not available on this machine.

Raised where "metal" is asked for (device="metal", or MFA_NATIVE_DEVICE=metal) on a machine
or a build without Metal; the cpu device is always available. A subclass of RuntimeError.

Example:
    ```python
    import numpy as np
    import mfa_native

    q = np.zeros((1, 2, 16, 32), dtype=np.float32)
    try:
        mfa_native.attention(q, q, q, device="metal")
        print("Metal is available here")
    except mfa_native.DeviceUnavailableError as error:
        print(error)   # the metal device is not available: ...
        assert "metal" not in [device.kind for device in mfa_native.devices()]
    ```
)");

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mfa::CompileError& e) {
      PyObject* instance = PyObject_CallFunction(compile_error_type, "s", e.what());
      if (instance) {
        PyObject* log = PyUnicode_DecodeUTF8(e.log().data(), Py_ssize_t(e.log().size()), "replace");
        PyObject_SetAttrString(instance, "log", log);
        Py_XDECREF(log);
        PyErr_SetObject(compile_error_type, instance);
        Py_DECREF(instance);
      }
    } catch (const mfa::DispatchError& e) {
      PyErr_SetString(dispatch_error_type, e.what());
    } catch (const mfa::UnavailableError& e) {
      PyErr_SetString(unavailable_error_type, e.what());
    } catch (const mfa::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const mfa::ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const mfa::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    } catch (const mfa::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
}

}  // namespace mfa::bindings
