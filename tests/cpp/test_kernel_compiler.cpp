// The kernel compiler: finding the host compiler, compiling translated MSL
// into shared objects, and the disk cache (hits, corruption, concurrency).
// Kernels compile against a small stub shim, so these tests do not depend on
// the real one; one test runs the real shim when it is built in.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/sha256.hpp"
#include "kernel_cache.hpp"
#include "kernel_compiler.hpp"
#include "mfa/errors.hpp"
#include "mfa/reflection.hpp"
#include "msl_translate.hpp"

namespace {

namespace fs = std::filesystem;
using mfa::cpu::HostCompiler;
using mfa::cpu::KernelBinary;
using mfa::cpu::KernelCompiler;
using mfa::cpu::ShimFile;

// Just what the test kernels use, with the real ABI header, buffer pointers and threadgroup variables.
const char* kStubShim = R"(#pragma once
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include "mfa_kernel_abi.h"
#include "mfa_runtime.h"
#include "mfa_buffer_ptr.h"
#define device
#define constant const
#define threadgroup
using uint = unsigned int;
using ushort = unsigned short;
struct uint3 { uint x, y, z; uint3(uint a, uint b, uint c) : x(a), y(b), z(c) {} };
namespace metal {}
namespace mfa_shim {
inline void* threadgroup_alloc(std::size_t bytes, std::size_t align) {
  mfa_abi::ThreadState* t = mfa_abi::current_thread;
  std::size_t at = (t->static_cursor + align - 1) / align * align;
  t->static_cursor = at + bytes;
  return t->group->threadgroup_memory + at;
}
}  // namespace mfa_shim
#include "mfa_threadgroup_ptr.h"
)";

const char* kAffine = R"(#include <metal_stdlib>
using namespace metal;
struct Params { uint n; float scale; };
constant float bias [[function_constant(0)]];
kernel void affine(device const float* x [[buffer(0)]],
                   device float* y [[buffer(1)]],
                   constant Params& p [[buffer(2)]],
                   uint3 gid [[thread_position_in_grid]],
                   ushort lid [[thread_index_in_threadgroup]]) {
  threadgroup float staged[64];
  if (gid.x >= p.n) return;
  staged[lid] = x[gid.x];
  y[gid.x] = staged[lid] * p.scale + bias;
}
)";

struct Params {
  std::uint32_t n;
  float scale;
};

std::string translate(const std::string& source, const std::string& kernel,
                      const std::map<int, mfa::ConstantValue>& constants) {
  for (const mfa::FunctionInfo& function : mfa::reflect_msl(source)) {
    if (function.name == kernel) return mfa::cpu::translate_msl(source, function, constants, {});
  }
  throw std::runtime_error("no kernel " + kernel);
}

[[noreturn]] void throw_failure(mfa_abi::ThreadState*, const char* message) { throw std::runtime_error(message); }

// Runs the threads of a 1-D grid one after another: enough for kernels
// without barriers or SIMD-group functions.
void run_sequentially(const KernelBinary& binary, std::vector<void*> buffers, std::vector<std::size_t> sizes,
                      std::uint32_t groups, std::uint32_t threads) {
  mfa_abi::Runtime runtime{};
  runtime.fail = throw_failure;
  buffers.resize(mfa_abi::kMaxBuffers);
  sizes.resize(mfa_abi::kMaxBuffers);
  const std::vector<std::size_t> threadgroup_arg_sizes(mfa_abi::kMaxThreadgroupArgs, 0);  // no [[threadgroup(i)]]
  mfa_abi::DispatchContext dispatch{&runtime, buffers.data(), sizes.data(), {groups, 1, 1}, {threads, 1, 1},
                                    (threads + 31) / 32, 32 * 1024, threadgroup_arg_sizes.data()};
  std::vector<unsigned char> memory(dispatch.threadgroup_memory_limit);
  std::vector<void*> threadgroup_args(mfa_abi::kMaxThreadgroupArgs);
  mfa_abi::Counters counters{};
  for (std::uint32_t g = 0; g < groups; ++g) {
    mfa_abi::GroupContext group{{g, 0, 0}, memory.data(), threadgroup_args.data(), 0, &counters};
    for (std::uint32_t l = 0; l < threads; ++l) {
      mfa_abi::ThreadState thread{};
      thread.dispatch = &dispatch;
      thread.group = &group;
      thread.thread_position_in_threadgroup[0] = l;
      thread.thread_index_in_threadgroup = l;
      thread.simdgroup_index_in_threadgroup = l / 32;
      thread.thread_index_in_simdgroup = l % 32;
      binary.main()(&thread);
    }
  }
}

// Runs `affine` on fresh random input and checks y = x * scale + bias.
void expect_affine_works(const KernelBinary& binary, float bias) {
  std::mt19937 random(std::random_device{}());
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  const std::uint32_t n = 150;  // not a multiple of the threadgroup size
  std::vector<float> x(n), y(n + 8, std::numeric_limits<float>::quiet_NaN());
  for (float& v : x) v = uniform(random);
  Params params{n, uniform(random)};
  run_sequentially(binary, {x.data(), y.data(), &params}, {n * 4, y.size() * 4, sizeof params}, 3, 64);
  for (std::uint32_t i = 0; i < n; ++i) {
    // Kernels may fuse the multiply-add (one rounding instead of two).
    double product = double(x[i]) * params.scale;
    ASSERT_NEAR(y[i], product + bias, 1e-6 * (std::abs(product) + std::abs(bias))) << i;
  }
  for (std::size_t i = n; i < y.size(); ++i) ASSERT_TRUE(std::isnan(y[i])) << "wrote past the end at " << i;
  EXPECT_STREQ(binary.info().name, "affine");
  EXPECT_EQ(binary.info().argument_bytes[0], sizeof(float));
  EXPECT_EQ(binary.info().argument_bytes[2], sizeof(Params));
  EXPECT_EQ(binary.info().argument_bytes[3], 0u);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Replaces a file by rename, as a crash or another process would: a library
// this process may still have mapped is never modified in place.
void replace_file(const fs::path& path, const std::string& text) {
  fs::path temporary = path.string() + ".test-tmp";
  std::ofstream(temporary, std::ios::binary) << text;
  fs::rename(temporary, path);
}

// Sets an environment variable for one scope.
class ScopedEnvironment {
 public:
  ScopedEnvironment(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnvironment() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

const HostCompiler* host_compiler() {
  static const std::optional<HostCompiler> found = []() -> std::optional<HostCompiler> {
    try {
      return HostCompiler::find();
    } catch (const mfa::UnavailableError&) {
      return std::nullopt;
    }
  }();
  return found ? &*found : nullptr;
}

class KernelCompilerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!host_compiler()) GTEST_SKIP() << "no g++ >= 12 or clang++ >= 15 here";
    char pattern[] = "/tmp/mfa_kernel_compiler_test_XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    cache_dir_ = pattern;
  }
  void TearDown() override {
    if (!cache_dir_.empty()) fs::remove_all(cache_dir_);
  }

  KernelCompiler::Config config(std::vector<ShimFile> shim = stub_shim()) const {
    return {*host_compiler(), cache_dir_.string(), std::move(shim)};
  }

  static std::vector<ShimFile> stub_shim() {
    std::vector<ShimFile> files = {{"metal_stdlib", kStubShim}};
    for (const ShimFile& file : mfa::cpu::embedded_shim_files()) {
      if (file.name == "mfa_kernel_abi.h" || file.name == "mfa_runtime.h" || file.name == "mfa_scalar.h" ||
          file.name == "mfa_buffer_ptr.h" || file.name == "mfa_arrays.h" || file.name == "mfa_threadgroup_ptr.h") {
        files.push_back(file);
      }
    }
    return files;
  }

  std::vector<fs::path> cache_files(const std::string& extension) const {
    std::vector<fs::path> found;
    for (const auto& entry : fs::directory_iterator(cache_dir_ / "kernels")) {
      if (entry.path().string().size() >= extension.size() &&
          entry.path().string().compare(entry.path().string().size() - extension.size(), extension.size(),
                                        extension) == 0) {
        found.push_back(entry.path());
      }
    }
    return found;
  }

  fs::path cache_dir_;
};

TEST(Sha256, KnownDigests) {
  EXPECT_EQ(mfa::sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(mfa::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(mfa::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(mfa::sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Padding edges: 55 bytes fit one final block, 56 need two, 64 is one full block.
  EXPECT_EQ(mfa::sha256_hex(std::string(55, 'a')),
            "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(mfa::sha256_hex(std::string(56, 'a')),
            "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(mfa::sha256_hex(std::string(64, 'a')),
            "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

TEST_F(KernelCompilerTest, CompilesLoadsAndRunsATranslatedKernel) {
  KernelCompiler compiler(config());
  const float bias = 0.375f;
  auto binary = compiler.compile(translate(kAffine, "affine", {{0, double(bias)}}), "affine");
  expect_affine_works(*binary, bias);
  EXPECT_EQ(compiler.stats().compiles, 1u);
  EXPECT_EQ(compiler.stats().disk_hits, 0u);
  EXPECT_GT(compiler.stats().compile_seconds, 0.0);
  // The shim was laid out once under the cache directory.
  int shim_dirs = 0;
  for (const auto& entry : fs::directory_iterator(cache_dir_)) {
    if (entry.path().filename().string().rfind("shim-", 0) == 0) {
      ++shim_dirs;
      EXPECT_EQ(read_text(entry.path() / "metal_stdlib"), kStubShim);
    }
  }
  EXPECT_EQ(shim_dirs, 1);
}

TEST_F(KernelCompilerTest, FlagsKeepIeeeSemanticsAndUseTheHostsFmaAndF16c) {
  KernelCompiler compiler(config());
  auto has = [&](const std::string& flag) {
    return std::find(compiler.flags().begin(), compiler.flags().end(), flag) != compiler.flags().end();
  };
  EXPECT_TRUE(has("-std=c++17") && has("-O1") && has("-fPIC") && has("-shared") && has("-fno-math-errno"));
  EXPECT_FALSE(has("-ffast-math"));
  EXPECT_EQ(has("-fsingle-precision-constant"), !host_compiler()->is_clang);
#if defined(__x86_64__)
  EXPECT_EQ(has("-mfma"), bool(__builtin_cpu_supports("fma")));
  EXPECT_EQ(has("-mf16c"), bool(__builtin_cpu_supports("f16c")));
#endif
}

// A tensor-op unit is built once per layout seed, and a build under one seed
// is never loaded under another; other units do not depend on the seed.
TEST_F(KernelCompilerTest, TensorOpUnitsAreKeyedByTheLayoutSeed) {
  const std::string plain = translate(kAffine, "affine", {{0, 1.0}});
  const std::string tensor_ops = "// a unit that includes <metal_tensor>\n" + plain;
  KernelCompiler::Config seeded = config();
  std::vector<std::uint64_t> compiles;
  for (std::uint64_t seed : {1, 2, 1}) {
    seeded.layout_seed = seed;
    KernelCompiler compiler(seeded);
    compiler.compile(tensor_ops, "affine");
    compiler.compile(plain, "affine");
    compiles.push_back(compiler.stats().compiles);
  }
  EXPECT_EQ(compiles, (std::vector<std::uint64_t>{2, 1, 0}));
  EXPECT_EQ(cache_files(".so").size(), 3u);
}

TEST_F(KernelCompilerTest, ShimFilesInSubdirectoriesAreLaidOutThere) {
  std::vector<ShimFile> shim = stub_shim();
  shim.push_back({"Framework/Framework.h", "#pragma once\n"});
  KernelCompiler compiler(config(shim));
  compiler.compile(translate(kAffine, "affine", {{0, 1.0}}), "affine");
  int found = 0;
  for (const auto& entry : fs::directory_iterator(cache_dir_)) {
    if (entry.path().filename().string().rfind("shim-", 0) == 0) {
      found += read_text(entry.path() / "Framework" / "Framework.h") == "#pragma once\n";
    }
  }
  EXPECT_EQ(found, 1);
}

TEST(LayoutSeed, ComesFromTheEnvironmentAsANonNegativeInteger) {
  {
    ScopedEnvironment unset("MFA_NATIVE_SHIM_LAYOUT_SEED", nullptr);
    EXPECT_EQ(mfa::cpu::default_layout_seed(), 0u);
  }
  {
    ScopedEnvironment seed("MFA_NATIVE_SHIM_LAYOUT_SEED", "6");
    EXPECT_EQ(mfa::cpu::default_layout_seed(), 6u);
  }
  for (const char* bad : {"-1", "two", "3x"}) {
    ScopedEnvironment seed("MFA_NATIVE_SHIM_LAYOUT_SEED", bad);
    EXPECT_THROW(mfa::cpu::default_layout_seed(), mfa::ArgumentError) << bad;
  }
}

TEST_F(KernelCompilerTest, ASecondCompilerLoadsFromDiskWithoutCompiling) {
  const std::string unit = translate(kAffine, "affine", {{0, 1.25}});
  {
    KernelCompiler first(config());
    first.compile(unit, "affine");
    ASSERT_EQ(first.stats().compiles, 1u);
  }
  KernelCompiler second(config());  // a fresh instance, as in a new process
  auto binary = second.compile(unit, "affine");
  expect_affine_works(*binary, 1.25f);
  EXPECT_EQ(second.stats().compiles, 0u);
  EXPECT_EQ(second.stats().disk_hits, 1u);
  EXPECT_EQ(second.stats().rebuilt, 0u);
  // The translated source sits next to the library, for debugging.
  ASSERT_EQ(cache_files(".cpp").size(), 1u);
  EXPECT_EQ(read_text(cache_files(".cpp")[0]), unit);
  // Other constants are another kernel.
  second.compile(translate(kAffine, "affine", {{0, 1.5}}), "affine");
  EXPECT_EQ(second.stats().compiles, 1u);
}

TEST_F(KernelCompilerTest, CorruptOrPartialEntriesAreDetectedAndRebuilt) {
  const std::string unit = translate(kAffine, "affine", {{0, -2.0}});
  KernelCompiler(config()).compile(unit, "affine");
  const fs::path library = cache_files(".so").at(0);
  const fs::path sidecar = library.string() + ".sha256";
  const std::string good_library = read_text(library);
  const std::string good_sidecar = read_text(sidecar);

  // A library of another ABI version, with a sidecar that matches it.
  const fs::path foreign_source = cache_dir_ / "foreign.cpp";
  std::ofstream(foreign_source) << "extern \"C\" int mfa_kernel_abi_version() { return 999; }\n"
                                   "extern \"C\" const void* mfa_kernel_info() { return nullptr; }\n"
                                   "extern \"C\" void mfa_kernel_main(void*) {}\n";
  const fs::path foreign = cache_dir_ / "foreign.so";
  ASSERT_EQ(std::system((host_compiler()->path + " -shared -fPIC -o " + foreign.string() + " " +
                         foreign_source.string()).c_str()), 0);
  const std::string foreign_library = read_text(foreign);
  const std::string foreign_sidecar =
      std::to_string(foreign_library.size()) + " " + mfa::sha256_hex(foreign_library) + "\n";

  std::string flipped = good_library;
  flipped[flipped.size() / 2] ^= 0x5a;
  struct Damage {
    const char* what;
    std::string library, sidecar;  // "" for the sidecar: deleted
  };
  const Damage damages[] = {
      {"truncated library", good_library.substr(0, good_library.size() / 3), good_sidecar},
      {"flipped byte", flipped, good_sidecar},
      {"empty library", "", good_sidecar},
      {"missing sidecar", good_library, ""},
      {"wrong sidecar", good_library, "12 " + std::string(64, '0') + "\n"},
      {"another ABI version", foreign_library, foreign_sidecar},
  };
  for (const Damage& damage : damages) {
    SCOPED_TRACE(damage.what);
    replace_file(library, damage.library);
    if (damage.sidecar.empty()) {
      fs::remove(sidecar);
    } else {
      replace_file(sidecar, damage.sidecar);
    }
    KernelCompiler compiler(config());
    auto binary = compiler.compile(unit, "affine");
    EXPECT_EQ(compiler.stats().rebuilt, 1u);
    EXPECT_EQ(compiler.stats().compiles, 1u);
    EXPECT_EQ(compiler.stats().disk_hits, 0u);
    expect_affine_works(*binary, -2.0f);
    EXPECT_EQ(read_text(sidecar), std::to_string(read_text(library).size()) + " " +
                                      mfa::sha256_hex(read_text(library)) + "\n");
  }
}

TEST_F(KernelCompilerTest, CompileErrorsCarryTheLogWithMetalLineNumbers) {
  // Rewrites spanning lines come first: the error must still be reported at line 9.
  const std::string source = R"(#include <metal_stdlib>
constant float scale
    [[function_constant(0)]];
kernel void broken(device float* y [[buffer(0)]],
                   uint3 gid [[thread_position_in_grid]]) {
  threadgroup float
      staged[4];
  staged[0] = scale;
  y[gid.x] = undeclared_name * 2.0f;
}
)";
  KernelCompiler compiler(config());
  try {
    compiler.compile(translate(source, "broken", {{0, 1.0}}), "broken");
    FAIL() << "no CompileError";
  } catch (const mfa::CompileError& e) {
    EXPECT_NE(std::string(e.what()).find("kernel 'broken' failed to compile"), std::string::npos) << e.what();
    EXPECT_NE(e.log().find("kernel.metal:9:"), std::string::npos) << e.log();
    EXPECT_NE(e.log().find("undeclared_name"), std::string::npos) << e.log();
  }
  EXPECT_EQ(compiler.stats().compiles, 1u);
  EXPECT_TRUE(cache_files(".so").empty());  // failures are not cached
  EXPECT_TRUE(cache_files(".sha256").empty());
}

TEST_F(KernelCompilerTest, ConcurrentCompilersOfOneSourceAllSucceed) {
  const std::string unit = translate(kAffine, "affine", {{0, 0.5}});
  constexpr int kCompilers = 3;  // separate instances race as separate processes would
  std::vector<std::shared_ptr<const KernelBinary>> binaries(kCompilers);
  std::vector<std::string> errors(kCompilers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCompilers; ++i) {
    threads.emplace_back([&, i] {
      try {
        KernelCompiler compiler(config());
        binaries[i] = compiler.compile(unit, "affine");
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int i = 0; i < kCompilers; ++i) {
    ASSERT_TRUE(errors[i].empty()) << errors[i];
    expect_affine_works(*binaries[i], 0.5f);
  }
  // Exactly one entry, and no temporary files left behind.
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(cache_dir_ / "kernels")) {
    names.push_back(entry.path().filename().string());
  }
  ASSERT_EQ(names.size(), 3u) << ::testing::PrintToString(names);
  EXPECT_EQ(cache_files(".so").size(), 1u);
  EXPECT_EQ(cache_files(".so.sha256").size(), 1u);
  EXPECT_EQ(cache_files(".cpp").size(), 1u);
}

TEST_F(KernelCompilerTest, HitsRenewEntriesAndBuildsEvictTheLeastRecentlyUsedPastTheLimit) {
  // Constants of one text length: entries of (nearly) one size.
  auto unit = [](double bias) { return translate(kAffine, "affine", {{0, bias}}); };
  {
    KernelCompiler filling(config());
    for (double bias : {1.5, 2.5, 3.5}) filling.compile(unit(bias), "affine");
    EXPECT_EQ(filling.stats().evicted, 0u);  // 2 GiB by default
  }
  const fs::path kernels = cache_dir_ / "kernels";
  const mfa::cpu::CacheUsage three = mfa::cpu::cache_usage(kernels.string());
  ASSERT_EQ(three.entries, 3u);
  // Each source's library (the .cpp next to it holds the source), last used
  // 30, 20 and 10 minutes ago in that order.
  std::map<std::string, fs::path> library_of;
  for (const fs::path& library : cache_files(".so")) {
    library_of[read_text(fs::path(library).replace_extension(".cpp"))] = library;
  }
  int minutes = 30;
  for (double bias : {1.5, 2.5, 3.5}) {
    const std::string stem = fs::path(library_of.at(unit(bias))).replace_extension().string();
    for (const char* suffix : {".so", ".so.sha256", ".cpp"}) {
      fs::last_write_time(stem + suffix, fs::file_time_type::clock::now() - std::chrono::minutes(minutes));
    }
    minutes -= 10;
  }
  // Room for three and a half entries.
  KernelCompiler::Config limited = config();
  limited.max_bytes = three.bytes + three.bytes / 6;
  KernelCompiler compiler(limited);
  compiler.compile(unit(1.5), "affine");  // a hit: the oldest becomes the newest
  EXPECT_EQ(compiler.stats().disk_hits, 1u);
  expect_affine_works(*compiler.compile(unit(4.5), "affine"), 4.5f);  // a build: one entry must go
  EXPECT_EQ(compiler.stats().compiles, 1u);
  EXPECT_EQ(compiler.stats().evicted, 1u);
  EXPECT_FALSE(fs::exists(library_of.at(unit(2.5))));  // the least recently used, whole
  EXPECT_FALSE(fs::exists(fs::path(library_of.at(unit(2.5))).replace_extension(".cpp")));
  EXPECT_TRUE(fs::exists(library_of.at(unit(1.5))) && fs::exists(library_of.at(unit(3.5))));
  const mfa::cpu::CacheUsage after = mfa::cpu::cache_usage(kernels.string());
  EXPECT_EQ(after.entries, 3u);
  EXPECT_LE(after.bytes, limited.max_bytes);
}

TEST_F(KernelCompilerTest, CompilersEvictingEachOthersEntriesAllSucceed) {
  // A one-byte limit: every build removes every entry nobody is loading, while
  // other compilers (as other processes would) load and rebuild those entries.
  constexpr int kCompilers = 3;
  const double biases[] = {0.25, 0.5, 0.75};
  std::vector<std::string> units;
  for (double bias : biases) units.push_back(translate(kAffine, "affine", {{0, bias}}));
  std::vector<std::string> errors(kCompilers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCompilers; ++i) {
    threads.emplace_back([&, i] {
      try {
        KernelCompiler::Config tiny = config();
        tiny.max_bytes = 1;
        KernelCompiler compiler(tiny);
        for (int k = 0; k < kCompilers; ++k) {
          const int which = (i + k) % kCompilers;  // each starts with its own, then loads the others'
          expect_affine_works(*compiler.compile(units[which], "affine"), float(biases[which]));
        }
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::string& error : errors) EXPECT_TRUE(error.empty()) << error;
  for (const auto& entry : fs::directory_iterator(cache_dir_ / "kernels")) {
    EXPECT_EQ(entry.path().string().find(".tmp-"), std::string::npos) << entry.path();
  }
}

TEST_F(KernelCompilerTest, MfaNativeCxxOverridesTheCompiler) {
  // A wrapper that logs its arguments, then runs the real compiler.
  const fs::path wrapper = cache_dir_ / "my-cxx";
  const fs::path log = cache_dir_ / "my-cxx.log";
  std::ofstream(wrapper) << "#!/bin/sh\necho \"$@\" >> " << log.string() << "\nexec " << host_compiler()->path
                         << " \"$@\"\n";
  fs::permissions(wrapper, fs::perms::owner_all);
  {
    ScopedEnvironment cxx("MFA_NATIVE_CXX", wrapper.c_str());
    HostCompiler found = HostCompiler::find();
    EXPECT_EQ(found.path, wrapper.string());
    EXPECT_EQ(found.major_version, host_compiler()->major_version);
    KernelCompiler compiler({found, cache_dir_.string(), stub_shim()});
    expect_affine_works(*compiler.compile(translate(kAffine, "affine", {{0, 3.0}}), "affine"), 3.0f);
    EXPECT_NE(compiler.compiler().find(wrapper.string()), std::string::npos);
  }
  EXPECT_NE(read_text(log).find("-std=c++17"), std::string::npos) << read_text(log);

  const fs::path missing = cache_dir_ / "no-such-compiler";
  const fs::path impostor = cache_dir_ / "impostor";
  std::ofstream(impostor) << "#!/bin/sh\necho 'not a compiler 1.0'\n";
  fs::permissions(impostor, fs::perms::owner_all);
  for (const fs::path& bad : {missing, impostor}) {
    ScopedEnvironment cxx("MFA_NATIVE_CXX", bad.c_str());
    try {
      HostCompiler::find();
      FAIL() << "accepted " << bad;
    } catch (const mfa::UnavailableError& e) {
      EXPECT_NE(std::string(e.what()).find("MFA_NATIVE_CXX=" + bad.string()), std::string::npos) << e.what();
    }
  }
}

TEST_F(KernelCompilerTest, FindsVersionedCompilersOnPathAndExplainsWhenThereIsNone) {
  ScopedEnvironment no_override("MFA_NATIVE_CXX", nullptr);
  const fs::path bin = cache_dir_ / "bin";
  fs::create_directories(bin);
  {
    ScopedEnvironment path("PATH", bin.c_str());
    try {
      HostCompiler::find();
      FAIL() << "found a compiler on an empty PATH";
    } catch (const mfa::UnavailableError& e) {
      EXPECT_NE(std::string(e.what()).find("no C++ compiler for the cpu backend"), std::string::npos) << e.what();
    }
  }
  // Only a versioned name on PATH, e.g. g++-12 or clang++-19.
  const std::string versioned = std::string(host_compiler()->is_clang ? "clang++-" : "g++-") +
                                std::to_string(host_compiler()->major_version);
  fs::create_symlink(fs::canonical(host_compiler()->path), bin / versioned);
  ScopedEnvironment path("PATH", bin.c_str());
  HostCompiler found = HostCompiler::find();
  EXPECT_EQ(found.path, (bin / versioned).string());
  EXPECT_EQ(found.is_clang, host_compiler()->is_clang);
  EXPECT_EQ(found.major_version, host_compiler()->major_version);
}

TEST_F(KernelCompilerTest, RunsWithTheRealShim) {
  std::vector<ShimFile> shim = mfa::cpu::embedded_shim_files();
  bool has_stdlib = false;
  for (const ShimFile& file : shim) has_stdlib |= file.name == "metal_stdlib";
  if (!has_stdlib) GTEST_SKIP() << "the shim's metal_stdlib is not built in yet";
  KernelCompiler compiler(config(shim));
  expect_affine_works(*compiler.compile(translate(kAffine, "affine", {{0, 0.75}}), "affine"), 0.75f);
}

}  // namespace

// ---- precompiled headers ------------------------------------------------------------------

TEST(UnitPreamble, IsTheLeadingDefinesAndIncludes) {
  EXPECT_EQ(mfa::cpu::unit_preamble("#define A 1\n#include <x>\n#include \"y.h\"\n\nint z;\n#include <w>\n"),
            "#define A 1\n#include <x>\n#include \"y.h\"\n");
  EXPECT_EQ(mfa::cpu::unit_preamble("int z;\n#include <x>\n"), "");
  EXPECT_EQ(mfa::cpu::unit_preamble("#include <x>"), "");  // no line end: not a whole directive line
}

TEST_F(KernelCompilerTest, KernelsShareOnePrecompiledHeaderPerPreambleAndProcessesFindIt) {
  {
    KernelCompiler compiler(config());
    expect_affine_works(*compiler.compile(translate(kAffine, "affine", {{0, 0.5}}), "affine"), 0.5f);
    expect_affine_works(*compiler.compile(translate(kAffine, "affine", {{0, 0.75}}), "affine"), 0.75f);
    EXPECT_EQ(compiler.stats().compiles, 2u);
    EXPECT_EQ(compiler.stats().headers_built, 1u);
  }
  int headers = 0;
  for (const auto& entry : fs::recursive_directory_iterator(cache_dir_ / "pch")) {
    const std::string name = entry.path().filename().string();
    headers += name == "prelude.h.gch" || name == "prelude.h.pch";
  }
  EXPECT_EQ(headers, 1);
  KernelCompiler second(config());  // another process finds the header on disk
  expect_affine_works(*second.compile(translate(kAffine, "affine", {{0, 1.75}}), "affine"), 1.75f);
  EXPECT_EQ(second.stats().headers_built, 0u);
  // Another #define in the preamble (as the checks' are) is another header.
  second.compile("#define MFA_TEST_VARIANT 1\n" + translate(kAffine, "affine", {{0, 2.0}}), "affine");
  EXPECT_EQ(second.stats().headers_built, 1u);
}

TEST_F(KernelCompilerTest, ADamagedPrecompiledHeaderCostsACompileNotAKernel) {
  KernelCompiler(config()).compile(translate(kAffine, "affine", {{0, 0.5}}), "affine");
  for (const auto& entry : fs::recursive_directory_iterator(cache_dir_ / "pch")) {
    const std::string name = entry.path().filename().string();
    if (name == "prelude.h.gch" || name == "prelude.h.pch") std::ofstream(entry.path()) << "not a header";
  }
  KernelCompiler compiler(config());
  expect_affine_works(*compiler.compile(translate(kAffine, "affine", {{0, 3.0}}), "affine"), 3.0f);
  EXPECT_EQ(compiler.stats().compiles, 1u);
}
