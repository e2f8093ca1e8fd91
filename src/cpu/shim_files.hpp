// The shim headers (src/cpu/shim/), embedded at build time by embed_shim.cmake.
#pragma once

#include <cstddef>

namespace mfa::cpu {

struct EmbeddedFile {
  const char* name;  // path inside the shim include directory (a/b.h in a subdirectory)
  const char* text;
};

extern const EmbeddedFile kShimFiles[];
extern const std::size_t kShimFileCount;

}  // namespace mfa::cpu
