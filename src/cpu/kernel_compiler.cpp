// Compiles translated kernels with the host C++ compiler and caches the
// shared objects on disk. A cache entry is <key>.so plus a sidecar
// <key>.so.sha256 ("<size> <sha256>") written before it; <key>.cpp keeps the
// source for debugging. Every file appears by rename, so readers see whole
// files or none; an entry whose sidecar is missing or does not match, or that
// does not load, is deleted and rebuilt. The size bound, the last-use order
// and the locks that keep eviction off entries being loaded: kernel_cache.hpp.
#include "kernel_compiler.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>

#include "compiler_names.hpp"
#include "core/sha256.hpp"
#include "host_files.hpp"
#include "mfa/errors.hpp"
#include "shim_files.hpp"

namespace mfa::cpu {
namespace {

namespace fs = std::filesystem;

constexpr int kMinGccMajor = 12;    // _Float16 in C++
constexpr int kMinClangMajor = 15;
const std::string kWanted =
    "g++ >= " + std::to_string(kMinGccMajor) + " or clang++ >= " + std::to_string(kMinClangMajor);

std::string environment(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

std::vector<std::string> path_directories() {
  std::vector<std::string> dirs;
  std::stringstream list(environment("PATH"));
  for (std::string dir; std::getline(list, dir, ':');) dirs.push_back(dir.empty() ? "." : dir);
  return dirs;
}

// `name` as a path: searched on PATH unless it has a slash; unchanged if not found.
std::string program_path(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  for (const std::string& dir : path_directories()) {
    std::string candidate = dir + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return name;
}

std::string sidecar_text(const std::string& library_bytes) {
  return std::to_string(library_bytes.size()) + " " + sha256_hex(library_bytes) + "\n";
}

std::vector<std::string> compile_flags(const HostCompiler& compiler) {
  // Not -ffast-math: NaN and infinity must behave as on the GPU. -O1, not -O2: a kernel
  // compiles in about 0.7x the time (0.55x with bounds checks) and runs about 10 % slower.
  std::vector<std::string> flags = {"-std=c++17", "-O1", "-fPIC", "-shared", "-fno-math-errno",
                                    "-ffp-contract=fast", "-fvisibility=hidden", "-w"};
  // Unsuffixed literals are float, as in Metal (clang's shim overloads cover it).
  if (!compiler.is_clang) flags.push_back("-fsingle-precision-constant");
#if defined(__x86_64__) || defined(__i386__)
  // Without -mfma, fmaf is a library call that dominates kernels' profiles.
  if (__builtin_cpu_supports("fma")) flags.push_back("-mfma");
  if (__builtin_cpu_supports("f16c")) flags.push_back("-mf16c");
#endif
#if defined(__linux__)
  // gold links a kernel's shared object in a third of ld.bfd's time (0.01 s against 0.04 s,
  // about 15 % of a small kernel's whole compile); used where binutils installed it.
  const std::string gold = program_path("ld.gold");
  if (gold.find('/') != std::string::npos && access(gold.c_str(), X_OK) == 0) flags.push_back("-fuse-ld=gold");
#endif
  return flags;
}

// Metal 4 tensor-op kernels (<metal_tensor>, MetalPerformancePrimitives) compile as C++20:
// matmul2d takes its descriptor as a class-type template argument. The later -std wins over
// compile_flags' -std=c++17. They also get the layout seed of their cooperative tensors.
std::vector<std::string> tensor_op_flags(const std::string& cpp_source, std::uint64_t layout_seed) {
  const bool uses_tensor_ops = cpp_source.find("<metal_tensor>") != std::string::npos ||
                               cpp_source.find("MetalPerformancePrimitives/") != std::string::npos;
  if (!uses_tensor_ops) return {};
  return {"-std=c++20", "-DMFA_SHIM_LAYOUT_SEED=" + std::to_string(layout_seed)};
}

std::string hash_shim(const std::vector<ShimFile>& files) {
  std::string all;
  for (const ShimFile& file : files) {
    all += file.name + '\0' + std::to_string(file.text.size()) + '\0' + file.text;
  }
  return sha256_hex(all);
}

bool shim_dir_matches(const std::string& dir, const std::vector<ShimFile>& files) {
  for (const ShimFile& file : files) {
    std::string text;
    if (!read_file(dir + "/" + file.name, text) || text != file.text) return false;
  }
  return true;
}

}  // namespace

// ---- KernelBinary ----------------------------------------------------------

void KernelBinary::Unload::operator()(void* handle) const { dlclose(handle); }

KernelBinary::KernelBinary(const std::string& path) {
  handle_.reset(dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL));
  if (!handle_) throw Error("cannot load " + path + ": " + dlerror());
  auto version = reinterpret_cast<int (*)()>(dlsym(handle_.get(), "mfa_kernel_abi_version"));
  auto info = reinterpret_cast<const mfa_abi::KernelInfo* (*)()>(dlsym(handle_.get(), "mfa_kernel_info"));
  main_ = reinterpret_cast<KernelMain>(dlsym(handle_.get(), "mfa_kernel_main"));
  if (!version || !info || !main_) throw Error(path + " does not export the kernel ABI symbols");
  if (version() != mfa_abi::kVersion) {
    throw Error(path + " was built for kernel ABI version " + std::to_string(version()) +
                "; this library needs version " + std::to_string(mfa_abi::kVersion));
  }
  info_ = info();
}

// ---- HostCompiler ----------------------------------------------------------

HostCompiler HostCompiler::probe(const std::string& program) {
  const std::string path = program_path(program);
  ProcessResult version = run_process({path, "--version"});
  if (version.exit_code != 0) {
    throw UnavailableError("'" + path + " --version' failed: " + version.output);
  }
  HostCompiler compiler;
  compiler.path = path;
  compiler.version = version.output.substr(0, version.output.find('\n'));
  compiler.identity = path + "\n" + version.output;
  std::size_t clang = compiler.version.find("clang version");
  compiler.is_clang = clang != std::string::npos;
  bool is_gcc = !compiler.is_clang && version.output.find("Free Software Foundation") != std::string::npos;
  // "Debian clang version 19.1.7", "g++ (Debian 12.2.0-14) 12.2.0": g++'s version follows the parentheses.
  std::size_t paren = compiler.version.rfind(')');
  std::size_t from = compiler.is_clang ? clang : paren == std::string::npos ? 0 : paren + 1;
  compiler.major_version = first_major_version(compiler.version.substr(from));
  if ((compiler.is_clang && compiler.major_version >= kMinClangMajor) ||
      (is_gcc && compiler.major_version >= kMinGccMajor)) {
    return compiler;
  }
  throw UnavailableError("'" + path + "' is " + compiler.version + "; the cpu backend needs " + kWanted);
}

HostCompiler HostCompiler::find() {
  std::string override_path = environment("MFA_NATIVE_CXX");
  if (!override_path.empty()) {
    try {
      return probe(override_path);
    } catch (const UnavailableError& e) {
      throw UnavailableError("MFA_NATIVE_CXX=" + override_path + " cannot be used: " + e.what() +
                             "\nTo fix: point MFA_NATIVE_CXX at " + kWanted + ", or unset it to search PATH.");
    }
  }
  // Candidates on PATH, by preference: g++ then clang++, unversioned first,
  // then the highest version number.
  std::map<std::tuple<int, int>, std::string> candidates;  // (family, -version) -> path
  for (const std::string& dir : path_directories()) {
    std::error_code error;
    for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
      std::optional<CompilerName> name = parse_compiler_name(entry.path().filename().string());
      if (!name) continue;
      int family = name->family == CompilerFamily::gcc ? 0 : 1;
      candidates.emplace(std::make_tuple(family, -name->version.value_or(1 << 20)), entry.path().string());
    }
  }
  std::string tried;
  for (const auto& [order, path] : candidates) {
    try {
      return probe(path);
    } catch (const UnavailableError& e) {
      tried += std::string("\n  ") + e.what();
    }
  }
  throw UnavailableError("no C++ compiler for the cpu backend: it needs " + kWanted +
                         " on PATH, or MFA_NATIVE_CXX naming one; " +
                         (tried.empty() ? "PATH has no g++, g++-N, clang++ or clang++-N" : "tried:" + tried) +
                         "\nTo fix: install one (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++;"
                         " macOS: xcode-select --install), or set MFA_NATIVE_CXX to its path.");
}

// ---- defaults --------------------------------------------------------------

std::vector<ShimFile> embedded_shim_files() {
  std::vector<ShimFile> files;
  for (std::size_t i = 0; i < kShimFileCount; ++i) files.push_back({kShimFiles[i].name, kShimFiles[i].text});
  return files;
}

std::uint64_t default_layout_seed() {
  const std::string text = environment("MFA_NATIVE_SHIM_LAYOUT_SEED");
  if (text.empty()) return 0;
  std::size_t used = 0;
  unsigned long long seed = 0;
  try {
    seed = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text[0] == '-') {
    throw ArgumentError("MFA_NATIVE_SHIM_LAYOUT_SEED=" + text + " is not a non-negative integer");
  }
  return seed;
}

std::string precompiled_headers_directory(const std::string& cache_dir) { return cache_dir + "/pch"; }

std::string default_cache_dir() {
  if (std::string dir = environment("MFA_NATIVE_CACHE_DIR"); !dir.empty()) return dir;
  if (std::string dir = environment("XDG_CACHE_HOME"); !dir.empty()) return dir + "/mfa_native";
  if (std::string home = environment("HOME"); !home.empty()) return home + "/.cache/mfa_native";
  return (fs::temp_directory_path() / ("mfa_native-" + std::to_string(getuid()))).string();
}

// ---- KernelCompiler --------------------------------------------------------

KernelCompiler::KernelCompiler(Config config)
    : host_(std::move(config.compiler)),
      description_(host_.path + " (" + host_.version + ")"),
      cache_dir_(std::move(config.cache_dir)),
      kernels_dir_(kernels_directory(cache_dir_)),
      max_bytes_(config.max_bytes),
      layout_seed_(config.layout_seed),
      shim_files_(std::move(config.shim_files)),
      shim_hash_(hash_shim(shim_files_)),
      shim_dir_(cache_dir_ + "/shim-" + shim_hash_.substr(0, 16)),
      flags_(compile_flags(host_)),
      headers_(precompiled_headers_directory(cache_dir_)) {}

KernelCompiler& KernelCompiler::shared() {
  static KernelCompiler compiler(
      Config{HostCompiler::find(), default_cache_dir(), embedded_shim_files(), default_cache_max_bytes(),
             default_layout_seed()});
  return compiler;
}

CompilerStats KernelCompiler::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CompilerStats stats = stats_;
  stats.headers_built = headers_.built();
  return stats;
}

std::shared_ptr<const KernelBinary> KernelCompiler::compile(const std::string& cpp_source,
                                                            const std::string& kernel_name,
                                                            const std::vector<std::string>& extra_flags) {
  std::vector<std::string> unit_flags = tensor_op_flags(cpp_source, layout_seed_);
  unit_flags.insert(unit_flags.end(), extra_flags.begin(), extra_flags.end());
  // Everything that changes the binary is in the key.
  std::string build_key = "mfa kernel ABI " + std::to_string(mfa_abi::kVersion) + "\n" + host_.identity + "\n";
  for (const std::string& flag : flags_) build_key += flag + "\n";
  for (const std::string& flag : unit_flags) build_key += flag + "\n";
  build_key += shim_hash_ + "\n";
  std::string stem = kernels_dir_ + "/" + sha256_hex(build_key + cpp_source);

  if (auto cached = load_cached(stem + ".so", stem + ".so.sha256")) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.disk_hits;
    return cached;
  }
  std::error_code error;
  fs::create_directories(kernels_dir_, error);
  if (error) throw Error("cannot create the kernel cache " + kernels_dir_ + ": " + error.message());
  return build(cpp_source, kernel_name, unit_flags, build_key, stem);
}

std::shared_ptr<const KernelBinary> KernelCompiler::load_cached(const std::string& library,
                                                                const std::string& sidecar) {
  // Held until the library is loaded: eviction in any process leaves it alone.
  std::optional<EntryLoadLock> lock = EntryLoadLock::acquire(library);
  if (!lock) return nullptr;
  std::string bytes, recorded;
  if (!lock->read(bytes)) return nullptr;
  bool intact = read_file(sidecar, recorded) && recorded == sidecar_text(bytes);
  if (intact) {
    try {
      auto binary = std::make_shared<const KernelBinary>(library);
      lock->mark_used();
      return binary;
    } catch (const Error&) {
      // does not load: rebuilt below
    }
  }
  std::error_code ignored;
  fs::remove(library, ignored);
  fs::remove(sidecar, ignored);
  std::lock_guard<std::mutex> stats_lock(mutex_);
  ++stats_.rebuilt;
  return nullptr;
}

std::shared_ptr<const KernelBinary> KernelCompiler::build(const std::string& cpp_source,
                                                          const std::string& kernel_name,
                                                          const std::vector<std::string>& extra_flags,
                                                          const std::string& build_key, const std::string& stem) {
  // Compiled from a temporary copy that no eviction removes, kept as <key>.cpp afterwards.
  const std::string source_path = stem + ".cpp";
  TemporaryFile source(stem + unique_suffix() + ".cpp");
  write_file(source.path(), cpp_source);
  TemporaryFile library(stem + ".so" + unique_suffix());
  write_shim();
  std::vector<std::string> flags = flags_;
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  auto compile_with = [&](const std::vector<std::string>& header_flags) {
    std::vector<std::string> command = {host_.path};
    command.insert(command.end(), flags.begin(), flags.end());
    command.insert(command.end(), header_flags.begin(), header_flags.end());
    command.insert(command.end(), {"-I", shim_dir_, "-o", library.path(), source.path()});
    return run_process(command);
  };

  auto start = std::chrono::steady_clock::now();
  std::vector<std::string> header =
      headers_.flags_for(host_, flags, shim_dir_, build_key, unit_preamble(cpp_source));
  ProcessResult result = compile_with(header);
  // A header the compiler refuses (removed by `cache clear` meanwhile, say) costs a second compile, never a kernel.
  if (result.exit_code != 0 && !header.empty()) result = compile_with({});
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.compiles;
    stats_.compile_seconds += seconds;
  }
  if (result.exit_code != 0) {
    source.commit(source_path);
    throw CompileError("kernel '" + kernel_name + "' failed to compile with " + host_.path +
                           " (translated source: " + source_path + ")",
                       result.output);
  }
  std::string bytes;
  if (!read_file(library.path(), bytes)) throw Error("cannot read the compiled kernel " + library.path());
  // Loaded before it is published: once loaded, another process replacing or
  // removing the cache entry cannot take it away from this one.
  std::shared_ptr<const KernelBinary> binary;
  try {
    binary = std::make_shared<const KernelBinary>(library.path());
  } catch (const Error& e) {
    throw CompileError("kernel '" + kernel_name + "' compiled but does not load", e.what());
  }
  // The sidecar goes first, so a reader that finds the library finds its sidecar.
  write_atomically(stem + ".so.sha256", sidecar_text(bytes));
  library.commit(stem + ".so");
  source.commit(source_path);
  Eviction eviction = evict_least_recently_used(kernels_dir_, max_bytes_);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.evicted += eviction.entries;
  return binary;
}

void KernelCompiler::write_shim() {
  // Checked before every compile (a few small reads): the cache may be cleared at any time.
  std::lock_guard<std::mutex> lock(shim_mutex_);
  if (shim_dir_matches(shim_dir_, shim_files_)) return;
  // Written completely under a temporary name, then renamed into place.
  std::string temporary = shim_dir_ + unique_suffix();
  std::error_code error;
  fs::create_directories(temporary, error);
  for (const ShimFile& file : shim_files_) {
    const fs::path path = fs::path(temporary) / file.name;
    fs::create_directories(path.parent_path(), error);
    std::ofstream(path, std::ios::binary) << file.text;
  }
  if (fs::exists(shim_dir_, error)) {
    if (shim_dir_matches(shim_dir_, shim_files_)) {  // another process just wrote it: keep theirs
      fs::remove_all(temporary, error);
      return;
    }
    // Damaged: moved away, then removed.
    std::string damaged = shim_dir_ + unique_suffix();
    fs::rename(shim_dir_, damaged, error);
    fs::remove_all(damaged, error);
  }
  fs::rename(temporary, shim_dir_, error);
  if (error) fs::remove_all(temporary, error);  // another process won the race
  if (!shim_dir_matches(shim_dir_, shim_files_)) throw Error("cannot write the shim headers to " + shim_dir_);
}

}  // namespace mfa::cpu
