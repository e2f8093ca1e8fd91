// What a kernel's signature says, read from its MSL text the way Metal's
// reflection reports it. Both backends use it to validate bindings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mfa {

enum class ArgumentKind {
  buffer,             // [[buffer(i)]]: device or constant pointer / reference
  threadgroup_memory, // [[threadgroup(i)]]: length set per dispatch
  builtin,            // [[thread_position_in_grid]] and friends
};

enum class AddressSpace { none, device, constant, threadgroup };

struct ArgumentInfo {
  std::string name;          // parameter name in the source
  ArgumentKind kind = ArgumentKind::buffer;
  int index = -1;            // buffer / threadgroup index; -1 for builtins
  AddressSpace space = AddressSpace::none;
  std::string type;          // pointee or referenced type, e.g. "float", "half4", "Params"
  bool is_pointer = false;   // T* (array) rather than T& (one value)
  bool is_const = false;     // read-only: `constant` space or `const` qualified
  std::string builtin;       // attribute name for builtins, e.g. "thread_position_in_grid"
  std::string builtin_type;  // declared type of a builtin, e.g. "uint3"
};

struct FunctionConstantInfo {
  std::string name;
  int index = -1;
  std::string type;          // "bool", "int", "uint", "float", "half", ...
  bool required = true;      // false when the source tests is_function_constant_defined(name)
};

struct FunctionInfo {
  std::string name;                              // kernel entry point
  std::vector<ArgumentInfo> arguments;           // in declaration order
  std::vector<FunctionConstantInfo> constants;   // program-scope constants the kernel may use
  std::uint32_t max_total_threads_per_threadgroup = 0;  // [[max_total_threads_per_threadgroup(N)]]; 0 if absent

  const ArgumentInfo* buffer(int index) const;   // nullptr when the kernel has no such buffer
};

// Parses every `kernel` function and program-scope function constant in an
// MSL source. Throws CompileError (with the offending line) on signatures it
// cannot read.
std::vector<FunctionInfo> reflect_msl(const std::string& source);

}  // namespace mfa
