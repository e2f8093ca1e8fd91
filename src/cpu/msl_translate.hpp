// The cpu backend's MSL front end: rewrites the few MSL constructs a header
// cannot express and appends the glue that binds one GPU thread's arguments.
#pragma once

#include <map>
#include <string>

#include "mfa/reflection.hpp"
#include "mfa/types.hpp"

namespace mfa::cpu {

struct TranslateOptions {
  bool bounds_check = false;         // buffer pointers check every access
  bool race_check = false;           // threadgroup memory accesses go to the race detector
  std::string metal_path = "kernel.metal";  // file name #line directives point at
};

// Returns a C++ translation unit (includes <metal_stdlib> from the shim) for
// one kernel with its function constants baked in as constexpr values.
// Throws CompileError for constructs it cannot translate.
std::string translate_msl(const std::string& source, const FunctionInfo& function,
                          const std::map<int, ConstantValue>& constants,
                          const TranslateOptions& options);

}  // namespace mfa::cpu
