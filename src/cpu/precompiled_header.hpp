// Precompiled headers for kernel units. Every translated kernel starts with
// the same preprocessor lines (the checks' #defines, then the shim: about
// 25,000 lines once preprocessed, more than half of a small kernel's compile
// time). They are parsed once per compiler, flag set and preamble into
// <cache>/pch/<key>/, and every kernel compile reads that instead.
#pragma once

#include <future>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace mfa::cpu {

struct HostCompiler;

// The leading lines of `unit` that are #define or #include directives: what a
// precompiled header can hold. Empty when the unit does not start with them.
std::string_view unit_preamble(std::string_view unit);

class PrecompiledHeaders {
 public:
  explicit PrecompiledHeaders(std::string dir) : dir_(std::move(dir)) {}

  // The flags that make `compiler` (run with `flags`, -I `include_dir`) read
  // `preamble` precompiled. The header is built on first use: one thread of a
  // process builds it while the others wait, and processes race to a rename
  // (each build is whole). `key` holds everything else that changes the
  // header (compiler identity, flags, shim). Empty when the header cannot be
  // built; the kernel compile then parses the preamble itself.
  std::vector<std::string> flags_for(const HostCompiler& compiler, const std::vector<std::string>& flags,
                                     const std::string& include_dir, const std::string& key,
                                     std::string_view preamble);

  // Headers this object built (not those found on disk).
  std::uint64_t built() const;

 private:
  std::vector<std::string> build(const HostCompiler& compiler, const std::vector<std::string>& flags,
                                 const std::string& include_dir, const std::string& dir, std::string_view preamble);

  std::string dir_;
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_future<std::vector<std::string>>> headers_;  // by key
  std::uint64_t built_ = 0;
};

}  // namespace mfa::cpu
