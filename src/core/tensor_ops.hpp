// Metal 4 tensor ops (the matrix units of Apple10 GPUs, M5 onwards): which
// kernels use them, and which devices may run them. Backend-neutral, so that
// the decisions are tested where no Mac is.
#pragma once

#include <string>
#include <string_view>

namespace mfa {

// A macOS release, as NSProcessInfo.operatingSystemVersion gives it.
struct MacosVersion {
  int major = 0;
  int minor = 0;
  int patch = 0;

  bool at_least(int at_least_major, int at_least_minor) const {
    return major > at_least_major || (major == at_least_major && minor >= at_least_minor);
  }
  std::string text() const {  // "26.2.0"
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  }
};

// MFA_NATIVE_TENSOR_OPS: unset, empty or "auto" is automatic; "on" or "off".
enum class TensorOpsSetting { automatic, on, off };

// `value` is the variable's text, nullptr when unset. Throws ArgumentError
// naming the variable for any other text.
TensorOpsSetting parse_tensor_ops_setting(const char* value);

// MFA_NATIVE_TENSOR_OPS, read once per process (the facts built on it are
// cached with the device). Throws as parse_tensor_ops_setting does.
TensorOpsSetting tensor_ops_setting();

// The Metal backend's fact: an Apple10 GPU on macOS 26.2 or later, unless
// the setting is off. macOS 26.0 and 26.1 compile tensor ops to an older
// cooperative-tensor ABI, so they do not count.
bool metal_tensor_ops(bool apple10, const MacosVersion& macos, TensorOpsSetting setting);

// The cpu backend's fact: it runs tensor-op kernels whatever the setting (the
// shim implements them), but tells code generation to write them only when
// the setting is on, so that tests can have it generate what an M5 runs.
bool cpu_tensor_ops(TensorOpsSetting setting);

// Whether the MSL source includes <metal_tensor> or
// <MetalPerformancePrimitives/MetalPerformancePrimitives.h>: its preprocessor
// tokens, as the MSL lexer splits them (so a comment or a string that names a
// header does not count). Throws CompileError where the lexer does.
bool uses_tensor_ops(std::string_view source);

// Throws the ArgumentError a tensor-op kernel gets on a device without tensor
// ops; `device` names it, e.g. "Apple M3 Max (apple9, macOS 26.2.0)", and an
// `off` setting is named as the reason.
[[noreturn]] void refuse_tensor_op_kernel(const std::string& device, TensorOpsSetting setting);

}  // namespace mfa
