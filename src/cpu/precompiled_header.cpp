#include "precompiled_header.hpp"

#include <filesystem>

#include "core/sha256.hpp"
#include "host_files.hpp"
#include "kernel_compiler.hpp"

namespace mfa::cpu {
namespace {

namespace fs = std::filesystem;

bool is_directive(std::string_view line) {
  return line.rfind("#define ", 0) == 0 || line.rfind("#include ", 0) == 0;
}

// How `compiler` is told to use the header `header` precompiled as `pch`.
std::vector<std::string> use_flags(const HostCompiler& compiler, const std::string& header, const std::string& pch) {
  // g++ finds <header>.gch itself; clang is given the file.
  if (compiler.is_clang) return {"-include-pch", pch};
  return {"-include", header};
}

}  // namespace

std::string_view unit_preamble(std::string_view unit) {
  std::size_t end = 0;
  while (end < unit.size()) {
    std::size_t next = unit.find('\n', end);
    if (next == std::string_view::npos || !is_directive(unit.substr(end, next - end))) break;
    end = next + 1;
  }
  return unit.substr(0, end);
}

std::vector<std::string> PrecompiledHeaders::flags_for(const HostCompiler& compiler,
                                                       const std::vector<std::string>& flags,
                                                       const std::string& include_dir, const std::string& key,
                                                       std::string_view preamble) {
  if (preamble.find("#include ") == std::string_view::npos) return {};
  const std::string hash = sha256_hex(key + "\n" + std::string(preamble)).substr(0, 24);
  std::promise<std::vector<std::string>> promise;
  std::shared_future<std::vector<std::string>> header;
  bool builds = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = headers_.find(hash);
    if (found != headers_.end()) {
      header = found->second;
    } else {
      header = promise.get_future().share();
      headers_.emplace(hash, header);
      builds = true;
    }
  }
  if (builds) promise.set_value(build(compiler, flags, include_dir, dir_ + "/" + hash, preamble));
  return header.get();
}

std::vector<std::string> PrecompiledHeaders::build(const HostCompiler& compiler,
                                                   const std::vector<std::string>& flags,
                                                   const std::string& include_dir, const std::string& dir,
                                                   std::string_view preamble) {
  const std::string header = dir + "/prelude.h";
  const std::string pch = header + (compiler.is_clang ? ".pch" : ".gch");
  std::error_code error;
  if (fs::exists(pch, error)) return use_flags(compiler, header, pch);
  try {
    fs::create_directories(dir, error);
    std::string existing;
    if (!read_file(header, existing) || existing != preamble) write_atomically(header, std::string(preamble));
    TemporaryFile built(pch + unique_suffix());
    std::vector<std::string> command = {compiler.path};
    for (const std::string& flag : flags) {
      if (flag != "-shared" && flag.rfind("-fuse-ld=", 0) != 0) command.push_back(flag);   // no link here
    }
    // clang records the headers' times unless told not to; the key already says what they hold.
    if (compiler.is_clang) command.insert(command.end(), {"-Xclang", "-fno-pch-timestamp"});
    command.insert(command.end(), {"-x", "c++-header", "-I", include_dir, "-o", built.path(), header});
    if (run_process(command).exit_code != 0) return {};
    built.commit(pch);
  } catch (const std::exception&) {
    return {};  // an unwritable cache: kernels still compile, parsing the preamble
  }
  std::lock_guard<std::mutex> lock(mutex_);
  ++built_;
  return use_flags(compiler, header, pch);
}

std::uint64_t PrecompiledHeaders::built() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return built_;
}

}  // namespace mfa::cpu
