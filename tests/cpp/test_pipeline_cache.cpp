#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "fake_backend.hpp"
#include "mfa/errors.hpp"
#include "mfa/pipeline.hpp"

namespace {

const char* kSource = R"(
#include <metal_stdlib>
using namespace metal;
constant int WIDTH [[function_constant(0)]];
constant bool FLAG [[function_constant(1)]];
constant float SCALE [[function_constant(2)]];
kernel void first(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] = WIDTH * SCALE; }
kernel void second(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) { if (FLAG) x[i] = 1.0f; }
)";

using mfa::FunctionConstants;
using mfa::PipelineCache;
using mfa::testing::FakeBackend;

TEST(PipelineCache, LibraryKeyIsSourcePlusOptions) {
  FakeBackend backend;
  PipelineCache cache(backend);
  auto a = cache.library(kSource, {});
  auto b = cache.library(kSource, {});
  EXPECT_EQ(a, b);
  mfa::CompileOptions fast;
  fast.fast_math = true;
  auto c = cache.library(kSource, fast);
  EXPECT_NE(a, c);
  auto d = cache.library(std::string(kSource) + "\n", {});
  EXPECT_NE(a->key(), d->key());
  EXPECT_EQ(backend.libraries_compiled, 3);
  const mfa::PipelineCacheStats stats = cache.stats();
  EXPECT_EQ(stats.library_hits, 1u);
  EXPECT_EQ(stats.library_misses, 3u);
  EXPECT_EQ(stats.libraries, 3u);
}

TEST(PipelineCache, ALibraryFromABinaryIsTheOneCompiledFromItsSource) {
  const std::vector<unsigned char> binary = {1, 2, 3};
  FakeBackend backend;
  PipelineCache cache(backend);
  auto loaded = cache.library(kSource, {}, &binary);
  EXPECT_EQ(backend.libraries_loaded, 1);
  EXPECT_EQ(backend.libraries_compiled, 0);
  EXPECT_EQ(cache.library(kSource, {}), loaded);  // the source's key: a hit, nothing compiled
  EXPECT_EQ(backend.libraries_compiled, 0);
  EXPECT_EQ(loaded->functions().size(), 2u);      // reflected from the source all the same
  const std::string other = std::string(kSource) + "\n";
  auto compiled = cache.library(other, {});
  EXPECT_EQ(cache.library(other, {}, &binary), compiled);  // compiled first: the binary is not loaded
  EXPECT_EQ(backend.libraries_loaded, 1);
  EXPECT_EQ(cache.stats().libraries, 2u);
  EXPECT_EQ(cache.pipeline(loaded, "first", FunctionConstants().set("WIDTH", std::int64_t(1)).set(2, 1.0))->key(),
            cache.pipeline(cache.library(kSource, {}), "first",
                           FunctionConstants().set("WIDTH", std::int64_t(1)).set(2, 1.0))->key());
}

TEST(PipelineCache, PipelineKeyIsLibraryEntryAndConstantValues) {
  FakeBackend backend;
  PipelineCache cache(backend);
  auto library = cache.library(kSource, {});
  auto p1 = cache.pipeline(library, "first", FunctionConstants().set("WIDTH", std::int64_t(4)).set(2, 0.5));
  auto p2 = cache.pipeline(library, "first", FunctionConstants().set(0, std::int64_t(4)).set("SCALE", 0.5));
  EXPECT_EQ(p1, p2);  // by name or by index: the same constants
  auto p3 = cache.pipeline(library, "first", FunctionConstants().set("WIDTH", std::int64_t(5)).set(2, 0.5));
  EXPECT_NE(p1, p3);
  auto p4 = cache.pipeline(library, "second", FunctionConstants().set("FLAG", true));
  EXPECT_NE(p1->key(), p4->key());
  EXPECT_EQ(p4->name(), "second");
  EXPECT_EQ(backend.pipelines_made, 3);
  EXPECT_EQ(cache.stats().pipeline_hits, 1u);
}

TEST(PipelineCache, ConcurrentRequestsForOneKeyCompileOnce) {
  FakeBackend backend;
  backend.compile_delay = std::chrono::milliseconds(50);
  PipelineCache cache(backend);
  std::vector<std::shared_ptr<const mfa::Pipeline>> results(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      auto library = cache.library(kSource, {});
      results[t] = cache.pipeline(library, "second", FunctionConstants().set("FLAG", t % 2 == 0));
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(backend.libraries_compiled, 1);
  EXPECT_EQ(backend.pipelines_made, 2);
  for (int t = 2; t < 8; ++t) EXPECT_EQ(results[t], results[t % 2]);
  const mfa::PipelineCacheStats stats = cache.stats();
  EXPECT_EQ(stats.library_hits + stats.library_misses, 8u);
  EXPECT_EQ(stats.pipeline_hits, 6u);
}

TEST(PipelineCache, AFailedCompileIsReportedAndNotCached) {
  FakeBackend backend;
  PipelineCache cache(backend);
  const std::string broken = std::string(kSource) + "\n#error broken\n";
  EXPECT_THROW(cache.library(broken, {}), mfa::CompileError);
  EXPECT_THROW(cache.library(broken, {}), mfa::CompileError);
  EXPECT_EQ(backend.libraries_compiled, 2);
  EXPECT_EQ(cache.stats().libraries, 0u);
}

TEST(PipelineCache, UnknownKernelsAndConstantsAreNamed) {
  FakeBackend backend;
  PipelineCache cache(backend);
  auto library = cache.library(kSource, {});
  try {
    cache.pipeline(library, "third", {});
    FAIL() << "expected ArgumentError";
  } catch (const mfa::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("third"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("first, second"), std::string::npos);
  }
  try {
    cache.pipeline(library, "first", FunctionConstants().set("HEIGHT", std::int64_t(1)));
    FAIL() << "expected ArgumentError";
  } catch (const mfa::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("HEIGHT"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("WIDTH"), std::string::npos);
  }
  EXPECT_THROW(cache.pipeline(library, "first", FunctionConstants().set(7, std::int64_t(1))), mfa::ArgumentError);
  EXPECT_THROW(cache.pipeline(library, "second", FunctionConstants().set("FLAG", std::int64_t(1))), mfa::TypeError);
  EXPECT_THROW(cache.pipeline(library, "first", FunctionConstants().set("WIDTH", 1.5)), mfa::TypeError);
  EXPECT_THROW(cache.pipeline(library, "first", FunctionConstants().set("WIDTH", std::int64_t(1) << 40)),
               mfa::ArgumentError);
}

TEST(PipelineCache, ClearDropsEverything) {
  FakeBackend backend;
  PipelineCache cache(backend);
  cache.library(kSource, {});
  cache.clear();
  cache.library(kSource, {});
  EXPECT_EQ(backend.libraries_compiled, 2);
}

}  // namespace
