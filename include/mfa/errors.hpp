// Exceptions thrown by the mfa core. Every message names what was wrong and
// what was expected; the Python bindings map each class to a Python exception.
#pragma once

#include <stdexcept>
#include <string>

namespace mfa {

// Base class of everything the core throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed a bad value (Python: ValueError).
class ArgumentError : public Error {
 public:
  using Error::Error;
};

// A caller passed a value of the wrong type (Python: TypeError).
class TypeError : public Error {
 public:
  using Error::Error;
};

// A call the op does not compute, though each argument is valid (Python:
// NotImplementedError), as a gradient of a forward-only argument.
class NotImplementedError : public Error {
 public:
  using Error::Error;
};

// A backend or device that is not available on this machine.
class UnavailableError : public Error {
 public:
  using Error::Error;
};

// Kernel source failed to compile; log() holds the compiler's full output.
class CompileError : public Error {
 public:
  CompileError(const std::string& what, std::string log)
      : Error(what + (log.empty() ? std::string() : "\n" + log)), log_(std::move(log)) {}
  const std::string& log() const noexcept { return log_; }

 private:
  std::string log_;
};

// A dispatch failed while running (a diagnostic from the cpu backend, or a
// command-buffer error from Metal). The message starts with the kernel name.
class DispatchError : public Error {
 public:
  DispatchError(std::string kernel, const std::string& what)
      : Error("kernel '" + kernel + "': " + what), kernel_(std::move(kernel)) {}
  const std::string& kernel() const noexcept { return kernel_; }

 private:
  std::string kernel_;
};

}  // namespace mfa
