// Hand-written parsing of compiler file names and `--version` lines, with no
// regular-expression library: that one, built into a module that links
// libstdc++ statically (as manylinux toolchains do), throws std::bad_cast or
// crashes once another libstdc++ is loaded in the same process.
#pragma once

#include <optional>
#include <string_view>

namespace mfa::cpu {

enum class CompilerFamily { gcc, clang };

struct CompilerName {
  CompilerFamily family;
  std::optional<int> version;  // the N of "g++-N" / "clang++-N"
};

// "g++", "g++-13", "clang++", "clang++-19": the family and version; any other
// name (c++, g++-13.2, x86_64-linux-gnu-g++, g++-, ...) gives nullopt.
std::optional<CompilerName> parse_compiler_name(std::string_view file_name);

// The major version of the first "<digits>.<digits>" in `text`; 0 if none.
int first_major_version(std::string_view text);

}  // namespace mfa::cpu
