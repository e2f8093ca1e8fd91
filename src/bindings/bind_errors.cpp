// Maps the core's exceptions to Python's: bad values -> ValueError, bad types
// -> TypeError, and three mfa_native exceptions for the rest.
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
  compile_error_type = new_exception_type(
      m, "CompileError", "Kernel source failed to compile. `.log` holds the compiler's output.");
  dispatch_error_type = new_exception_type(
      m, "DispatchError", "A kernel failed while running (a cpu-backend diagnostic or a Metal command-buffer error).");
  unavailable_error_type =
      new_exception_type(m, "DeviceUnavailableError", "The requested device is not available on this machine.");

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
    } catch (const mfa::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
}

}  // namespace mfa::bindings
