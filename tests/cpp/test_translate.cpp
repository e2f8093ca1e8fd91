// The cpu backend's MSL front end: the rewrites a header cannot express,
// line for line, and the glue that binds a thread's arguments.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "mfa/errors.hpp"
#include "mfa/reflection.hpp"
#include "msl_translate.hpp"

namespace {

using mfa::ConstantValue;
using mfa::cpu::TranslateOptions;

std::string translate(const std::string& source, const std::string& kernel,
                      const std::map<int, ConstantValue>& constants = {}, TranslateOptions options = {}) {
  for (const mfa::FunctionInfo& function : mfa::reflect_msl(source)) {
    if (function.name == kernel) return mfa::cpu::translate_msl(source, function, constants, options);
  }
  mfa::FunctionInfo unknown;
  unknown.name = kernel;
  return mfa::cpu::translate_msl(source, unknown, constants, options);
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The lines of the translated MSL (between its #line and the glue's), so
// that lines[n - 1] is .metal line n.
std::vector<std::string> metal_lines(const std::string& unit, const std::string& path = "kernel.metal") {
  const std::string start = "#line 1 \"" + path + "\"\n";
  std::size_t begin = unit.find(start);
  std::size_t end = unit.find("#line 1 \"mfa_glue_");
  EXPECT_NE(begin, std::string::npos);
  EXPECT_NE(end, std::string::npos);
  begin += start.size();
  return split_lines(unit.substr(begin, end - begin));
}

std::string glue_of(const std::string& unit) { return unit.substr(unit.find("#line 1 \"mfa_glue_")); }

std::string translation_error(const std::string& source, const std::string& kernel,
                              const std::map<int, ConstantValue>& constants = {}) {
  try {
    translate(source, kernel, constants);
  } catch (const mfa::CompileError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no CompileError";
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

const char* kKernel = R"(#include <metal_stdlib>
using namespace metal;
struct Params { uint n; float scale; };
[[max_total_threads_per_threadgroup(128)]]
kernel void scale(device const float* x [[buffer(0)]],
                  device float* y [[buffer(1)]],
                  constant Params& p [[buffer(2)]],
                  threadgroup float* scratch [[threadgroup(0)]],
                  uint3 gid [[thread_position_in_grid]],
                  ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[32][33], total;
  threadgroup float* row = &tile[lane][0];
  y[gid.x] = x[gid.x] * p.scale + 1.5h + row[0] + total;
}
)";

TEST(Translate, StartsWithTheShimThenKeepsEveryLineInPlace) {
  std::string unit = translate(kKernel, "scale");
  EXPECT_EQ(unit.rfind("#include <metal_stdlib>\n", 0), 0u);
  std::vector<std::string> source = split_lines(kKernel);
  std::vector<std::string> lines = metal_lines(unit);
  ASSERT_EQ(lines.size(), source.size());
  EXPECT_EQ(lines[0], source[0]);
  EXPECT_EQ(lines[2], source[2]);
  EXPECT_EQ(lines[3], " ");  // the attribute is gone
  EXPECT_EQ(lines[4], "static void scale(mfa_shim::buffer_ptr<const float> x  ,");
  EXPECT_EQ(lines[5], "                  mfa_shim::buffer_ptr<float> y  ,");
  EXPECT_EQ(lines[6], "                  constant Params& p  ,");  // a reference stays
  EXPECT_EQ(lines[7], "                  threadgroup float* scratch  ,");
  EXPECT_EQ(lines[9], "                  ushort lane  ) {");
  EXPECT_EQ(lines[10],
            "  auto&& tile = mfa_shim::threadgroup_variable<float[32][33]>(\"threadgroup float tile[32][33]\"); "
            "auto&& total = mfa_shim::threadgroup_variable<float>(\"threadgroup float total\");");
  EXPECT_EQ(lines[11], source[11]);  // a threadgroup pointer stays
  EXPECT_EQ(lines[12], "  y[gid.x] = x[gid.x] * p.scale + half(1.5f) + row[0] + total;");
}

// The text goes inside namespace metal: the Metal library headers it
// includes are included ahead of it too, at global scope.
TEST(Translate, LibraryIncludesComeAheadOfTheText) {
  const std::string source =
      "#include <metal_stdlib>\n"
      "  #include  <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\n"
      "#include \"local.h\"\n"
      "kernel void k(device float* x [[buffer(0)]]) { x[0] = 1; }\n";
  const std::string unit = translate(source, "k");
  EXPECT_EQ(unit.rfind("#include <metal_stdlib>\n#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\n"
                       "#include <metal_stdlib>\n",
                       0),
            0u)
      << unit;
  EXPECT_FALSE(contains(unit.substr(0, unit.find("namespace metal {")), "local.h"));
  EXPECT_EQ(metal_lines(unit)[1], split_lines(source)[1]);  // the text keeps its line
}

TEST(Translate, GlueBindsEveryArgumentFromTheThreadState) {
  std::string unit = translate(kKernel, "scale");
  std::string glue = glue_of(unit);
  EXPECT_TRUE(contains(glue, "mfa_glue_info = {\"scale\", {sizeof(float), sizeof(float), sizeof(Params)}};"));
  // Each thread counts its pointers' traffic on its stack, and adds it to its group's as it returns.
  EXPECT_TRUE(contains(glue, "mfa_abi::BufferTraffic traffic[2] = {};"));
  EXPECT_TRUE(contains(glue, "mfa_shim::buffer_ptr<const float>(static_cast<float*>(t->dispatch->buffers[0]), "
                             "t->dispatch->buffer_sizes[0], 0, traffic[0])"));
  EXPECT_TRUE(contains(glue, "mfa_shim::buffer_ptr<float>(static_cast<float*>(t->dispatch->buffers[1]), "
                             "t->dispatch->buffer_sizes[1], 1, traffic[1])"));
  EXPECT_TRUE(contains(glue, "mfa_glue::add_traffic(t, traffic, 2);"));
  EXPECT_TRUE(contains(glue, "*static_cast<Params*>(t->dispatch->buffers[2])"));
  EXPECT_TRUE(contains(glue, "static_cast<float*>(t->group->threadgroup_args[0])"));
  EXPECT_TRUE(contains(glue, "uint3(uint(mfa_glue::thread_position_in_grid(t, 0)), "
                             "uint(mfa_glue::thread_position_in_grid(t, 1)), "
                             "uint(mfa_glue::thread_position_in_grid(t, 2)))"));
  EXPECT_TRUE(contains(glue, "ushort(mfa_glue::thread_index_in_simdgroup(t, 0))"));
  EXPECT_TRUE(contains(glue, "int mfa_kernel_abi_version()"));
  EXPECT_TRUE(contains(glue, "mfa_kernel_info()"));
  EXPECT_TRUE(contains(glue, "void mfa_kernel_main(mfa_abi::ThreadState* t)"));
  EXPECT_FALSE(contains(unit, "MFA_SHIM_BOUNDS_CHECK"));
  EXPECT_FALSE(contains(glue, "check_buffer_holds"));
}

TEST(Translate, BoundsChecksAreSwitchedOnAndReferencesChecked) {
  TranslateOptions options;
  options.bounds_check = true;
  std::string unit = translate(kKernel, "scale", {}, options);
  EXPECT_EQ(unit.rfind("#define MFA_SHIM_BOUNDS_CHECK 1\n#include <metal_stdlib>\n", 0), 0u);
  std::vector<std::string> lines = metal_lines(unit);
  EXPECT_EQ(lines[4], "static void scale(mfa_shim::buffer_ptr<const float> x  ,");
  EXPECT_TRUE(contains(glue_of(unit), "mfa_glue::check_buffer_holds(t, 2, \"p\", sizeof(Params));"));
}

// Exact array bounds: under bounds checks every thread-local array of a
// function body becomes a checked thread_array naming its declaration (only
// its type, dimensions and initializer braces change, line for line), and
// threadgroup pointers and [[threadgroup(i)]] blocks become checked
// threadgroup_ptrs that know their extent.
TEST(Translate, BoundsChecksWrapEveryThreadAndThreadgroupArray) {
  const std::string source = R"(#include <metal_stdlib>
using namespace metal;
struct Pair { float v[2]; };
float pick(thread const float* p, uint i) { float w[3] = {1.0h, 2.0f, 3.0f}; return p[i] * w[i]; }
kernel void k(device float* out [[buffer(0)]], threadgroup float* tile [[threadgroup(0)]],
              uint i [[thread_index_in_threadgroup]]) {
  threadgroup float shared[8][9];
  float a[4], b = 1.0f, c[2][3] = {{1.0f, 2.0f, 3.0f}, {4.0f, 5.0f, 6.0f}};
  const thread simdgroup_float8x8 tiles[2] = {};
  float unknown[] = {1.0f};
  static constexpr float table[2] = {1.0f, 2.0f};
  a[i] = c[1][i] + pick(a, i);
  threadgroup float* row = tile + 8;
  out[i] = a[i] + row[i] + shared[i][0] + unknown[0] + table[0];
}
)";
  TranslateOptions options;
  options.bounds_check = true;
  const std::string unit = translate(source, "k", {}, options);
  const std::vector<std::string> lines = metal_lines(unit);
  ASSERT_EQ(lines.size(), 15u);
  EXPECT_EQ(lines[2], source.substr(source.find("struct Pair"), 28));  // members stay
  EXPECT_EQ(lines[3],
            "float pick(thread const float* p, uint i) { struct mfa_array_w { static const char* declaration() { "
            "return \"thread float w[3]\"; } }; mfa_shim::thread_array<float, (3), mfa_array_w> w = "
            "{{half(1.0f), 2.0f, 3.0f}}; return p[i] * w[i]; }");
  EXPECT_EQ(lines[4], "static void k(mfa_shim::buffer_ptr<float> out  , mfa_shim::threadgroup_ptr<float> tile  ,");
  EXPECT_EQ(lines[6],
            "  auto&& shared = mfa_shim::threadgroup_variable<float[8][9]>(\"threadgroup float shared[8][9]\");");
  EXPECT_EQ(lines[7],
            "  struct mfa_array_a { static const char* declaration() { return \"thread float a[4]\"; } }; "
            "mfa_shim::thread_array<float, (4), mfa_array_a> a; float b = 1.0f; "
            "struct mfa_array_c { static const char* declaration() { return \"thread float c[2][3]\"; } }; "
            "mfa_shim::thread_array<mfa_shim::thread_array<float, (3), mfa_array_c>, (2), mfa_array_c> c = "
            "{{{1.0f, 2.0f, 3.0f}, {4.0f, 5.0f, 6.0f}}};");
  EXPECT_EQ(lines[8],
            "  struct mfa_array_tiles { static const char* declaration() { return \"thread const simdgroup_float8x8 "
            "tiles[2]\"; } }; const mfa_shim::thread_array<simdgroup_float8x8, (2), mfa_array_tiles> tiles = {{}};");
  // An unknown bound and static arrays stay as they are.
  EXPECT_EQ(lines[9], "  float unknown[] = {1.0f};");
  EXPECT_EQ(lines[10], "  static constexpr float table[2] = {1.0f, 2.0f};");
  EXPECT_EQ(lines[11], "  a[i] = c[1][i] + pick(a, i);");
  EXPECT_EQ(lines[12], "  mfa_shim::threadgroup_ptr<float> row = tile + 8;");
  EXPECT_TRUE(contains(glue_of(unit),
                       "mfa_shim::threadgroup_argument<float>(static_cast<float*>(t->group->threadgroup_args[0]), "
                       "t->dispatch->threadgroup_arg_sizes[0], \"[[threadgroup(0)]] threadgroup float* tile\")"));

  // Without bounds checks, nothing of it.
  const std::string plain = translate(source, "k");
  EXPECT_FALSE(contains(plain, "thread_array<"));
  EXPECT_FALSE(contains(plain, "threadgroup_argument<"));
  EXPECT_EQ(metal_lines(plain)[7], "  float a[4], b = 1.0f, c[2][3] = {{1.0f, 2.0f, 3.0f}, {4.0f, 5.0f, 6.0f}};");
}

TEST(Translate, EveryBufferPointerTypeCountsAndNothingElseChanges) {
  const std::string source = R"(#include <metal_stdlib>
using namespace metal;
constant float kTable[2] = {1.0f, 2.0f};
float first(const device float* p, constant float* table, device metal::vec<float, 4>* v) {
  return p[0] * table[0] * kTable[1];
}
kernel void run(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]]) {
  device float* const row = out + n * 2;
  device const half* halves = (device const half*)(row);
  device float4& whole = *(device float4*)out;
  const float product = kTable[0] * n;
  out[0] = first(row, out, static_cast<device float4*>(out)) + product + halves[0] + whole.x;
}
)";
  std::vector<std::string> lines = metal_lines(translate(source, "run"));
  EXPECT_EQ(lines[2], "constant float kTable[2] = {1.0f, 2.0f};");
  EXPECT_EQ(lines[3], "float first(mfa_shim::buffer_ptr<const float> p, mfa_shim::buffer_ptr<const float> table, "
                      "mfa_shim::buffer_ptr<metal::vec<float, 4>> v) {");
  EXPECT_EQ(lines[6], "static void run(mfa_shim::buffer_ptr<float> out  , constant uint& n  ) {");
  EXPECT_EQ(lines[7], "  mfa_shim::buffer_ptr<float> const row = out + n * 2;");
  EXPECT_EQ(lines[8], "  mfa_shim::buffer_ptr<const half> halves = (mfa_shim::buffer_ptr<const half>)(row);");
  EXPECT_EQ(lines[9], "  device float4& whole = *(mfa_shim::buffer_ptr<float4>)out;");
  EXPECT_EQ(lines[10], "  const float product = kTable[0] * n;");
  EXPECT_EQ(lines[11], "  out[0] = first(row, out, static_cast<mfa_shim::buffer_ptr<float4>>(out)) + product + "
                       "halves[0] + whole.x;");
}

TEST(Translate, EveryLoopConditionChecksInWithTheWatchdog) {
  const std::string source = R"(kernel void spin(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]],
                 constant int& n [[buffer(1)]]) {
  for (uint k = 0; k < 4 && out[(k)]; ++k) out[k] = 0;
  for (;;) { break; }
  while (out[i] > 1.0h) out[i] -= 1;
  do { out[i] += 1; } while (out[i] < 0);
  float local[2] = {0, 1};
  for (float v : local) out[i] += v;
#define LOOP for (;;) {}
  for (ushort t = 0; t < 8; ++t) { out[t] += t; }
  for (int t = 0; t <= 8; t += 2) { out[t] = 0; t = 1; }
  for (int t = 0; t < 40000; t++) { out[0] += 1; }
  for (int t = i; t < n; t += 64) { out[t] = 0; }
  for (int t = i; t < n; t += 64) { n = 3; }
  for (ushort t = 0; t < n; ++t) { out[t] = 0; }
  for (uint t = 0; t <= n; ++t) { out[t] = 0; }
}
)";
  std::vector<std::string> lines = metal_lines(translate(source, "spin"));
  const std::string check = "mfa_glue::loop_continues(__FILE__, ";
  EXPECT_EQ(lines[2], "  for (uint k = 0; " + check + "3) && (k < 4 && out[(k)]); ++k) out[k] = 0;");
  EXPECT_EQ(lines[3], "  for (;" + check + "4);) { break; }");
  EXPECT_EQ(lines[4], "  while (" + check + "5) && (out[i] > half(1.0f))) out[i] -= 1;");
  EXPECT_EQ(lines[5], "  do { out[i] += 1; } while (" + check + "6) && (out[i] < 0));");
  EXPECT_EQ(lines[7], "  for (float v : local) out[i] += v;");  // range-based: ends by itself
  EXPECT_EQ(lines[8], "#define LOOP for (;;) {}");
  // Counted loops end by themselves, unless the body writes the counter or
  // the bound, or the counter is too narrow for its bound.
  EXPECT_EQ(lines[9], "  for (ushort t = 0; t < 8; ++t) { out[t] += t; }");
  EXPECT_EQ(lines[10], "  for (int t = 0; " + check + "11) && (t <= 8); t += 2) { out[t] = 0; t = 1; }");
  EXPECT_EQ(lines[11], "  for (int t = 0; " + check + "12) && (t < 40000); t++) { out[0] += 1; }");
  EXPECT_EQ(lines[12], "  for (int t = i; t < n; t += 64) { out[t] = 0; }");
  EXPECT_EQ(lines[13], "  for (int t = i; " + check + "14) && (t < n); t += 64) { n = 3; }");
  EXPECT_EQ(lines[14], "  for (ushort t = 0; " + check + "15) && (t < n); ++t) { out[t] = 0; }");
  EXPECT_EQ(lines[15], "  for (uint t = 0; " + check + "16) && (t <= n); ++t) { out[t] = 0; }");
}

TEST(Translate, FunctionConstantsBecomeConstexprWithFullPrecision) {
  const std::string source = R"(constant bool flag [[function_constant(0)]];
constant int count [[function_constant(1)]];
constant float alpha [[function_constant(2)]];
constant half beta [[function_constant(3)]];
constant bfloat gamma
    [[function_constant(4)]];
constant uint optional_size [[function_constant(5)]];
constant float limit [[function_constant(6)]];
kernel void k(device float* x [[buffer(0)]]) {
  x[0] = is_function_constant_defined(optional_size) ? float(optional_size) : alpha;
  x[1] = is_function_constant_defined( limit ) ? limit : 0.0f;
}
)";
  std::mt19937 random(std::random_device{}());
  const double alpha = std::uniform_real_distribution<double>(-10, 10)(random);
  const std::int64_t count = std::uniform_int_distribution<std::int64_t>(-100000, 100000)(random);
  std::map<int, ConstantValue> values = {{0, true}, {1, count}, {2, alpha}, {3, 0.1}, {4, std::int64_t(3)},
                                         {6, std::numeric_limits<double>::infinity()}};
  std::vector<std::string> lines = metal_lines(translate(source, "k", values));
  ASSERT_EQ(lines.size(), 12u);
  EXPECT_EQ(lines[0], "constexpr bool flag = bool(true);");
  EXPECT_EQ(lines[1], "constexpr int count = int(" + std::to_string(count) + "LL);");
  // The float is printed exactly: reading the literal back gives the same float.
  const std::string prefix = "constexpr float alpha = float(";
  ASSERT_EQ(lines[2].rfind(prefix, 0), 0u) << lines[2];
  std::string literal = lines[2].substr(prefix.size(), lines[2].size() - prefix.size() - 2);
  EXPECT_EQ(std::strtof(literal.c_str(), nullptr), static_cast<float>(alpha)) << literal;
  EXPECT_EQ(lines[3], "constexpr half beta = half(0x1.99999ap-4f);");
  EXPECT_EQ(lines[4], "constexpr bfloat gamma = bfloat(0x1.8p+1f);");  // two lines, kept as two
  EXPECT_EQ(lines[5], "");
  EXPECT_EQ(lines[6], "constexpr uint optional_size = uint();");
  EXPECT_EQ(lines[7], "constexpr float limit = float(__builtin_inff());");
  EXPECT_EQ(lines[9], "  x[0] = false ? float(optional_size) : alpha;");
  EXPECT_EQ(lines[10], "  x[1] = true ? limit : 0.0f;");
}

TEST(Translate, RequiredConstantWithoutValueFailsOnlyWhereUsed) {
  // As in Metal: the declaration stays harmless; a use fails to compile with
  // an error naming the constant (see KernelCompiler tests for the compile).
  const std::string source = "\nconstant int width [[function_constant(4)]];\nkernel void k() { int a = width; }\n";
  std::vector<std::string> lines = metal_lines(translate(source, "k", {}));
  ASSERT_GE(lines.size(), 2u);
  EXPECT_EQ(lines[1],
            "struct function_constant_width_index_4_has_no_value {}; "
            "constexpr function_constant_width_index_4_has_no_value width{};");
  EXPECT_TRUE(contains(translate(source, "k", {{4, std::int64_t(-7)}}), "constexpr int width = int(-7LL);"));
  EXPECT_TRUE(contains(translation_error("constant float2 v [[function_constant(0)]];\nkernel void k() {}\n", "k",
                                         {{0, 1.0}}),
                       "kernel.metal:1: function constant 'v' has type 'float2'"));
}

TEST(Translate, HalfLiteralsOutsideStringsCommentsAndHexNumbers) {
  const std::string source = R"(#define ONE_AND_HALF 1.5h
kernel void k(device half* x [[buffer(0)]]) {
  x[0] = 2h + 1e-3h + .5H + ONE_AND_HALF; // 3h in a comment
  x[1] = half(0x10) + half(3.0f); const char* s = "4h";
}
)";
  std::vector<std::string> lines = metal_lines(translate(source, "k"));
  EXPECT_EQ(lines[0], "#define ONE_AND_HALF half(1.5f)");
  EXPECT_EQ(lines[2], "  x[0] = half(2.0f) + half(1e-3f) + half(.5f) + ONE_AND_HALF; // 3h in a comment");
  EXPECT_EQ(lines[3], "  x[1] = half(0x10) + half(3.0f); const char* s = \"4h\";");
}

TEST(Translate, ThreadgroupVariablesAnywhereInTheBody) {
  const std::string source = R"(kernel void k(uint i [[thread_index_in_threadgroup]]) {
  threadgroup simdgroup_matrix<float, 8, 8> tiles[2];
  if (i == 0) {
    threadgroup atomic_uint counter;
  }
  threadgroup float
      spread[4];
  threadgroup float (*rows)[4] = nullptr;
  threadgroup float* a = nullptr, *b = nullptr;
  x = (threadgroup float*)a;
}
)";
  std::vector<std::string> lines = metal_lines(translate(source, "k"));
  ASSERT_EQ(lines.size(), 11u);
  // Each names its declaration, for the bounds checks' messages.
  EXPECT_EQ(lines[1],
            "  auto&& tiles = mfa_shim::threadgroup_variable<simdgroup_matrix<float, 8, 8>[2]>("
            "\"threadgroup simdgroup_matrix<float, 8, 8> tiles[2]\");");
  EXPECT_EQ(lines[3],
            "    auto&& counter = mfa_shim::threadgroup_variable<atomic_uint>(\"threadgroup atomic_uint counter\");");
  EXPECT_EQ(lines[5], "  auto&& spread = mfa_shim::threadgroup_variable<float[4]>(\"threadgroup float spread[4]\");");
  EXPECT_EQ(lines[6], "");
  EXPECT_EQ(lines[7], "  threadgroup float (*rows)[4] = nullptr;");
  EXPECT_EQ(lines[8], "  threadgroup float* a = nullptr, *b = nullptr;");
  EXPECT_EQ(lines[9], "  x = (threadgroup float*)a;");
  EXPECT_TRUE(contains(translation_error("kernel void k() {\n  threadgroup float a = 1.0f;\n}\n", "k"),
                       "kernel.metal:2: a threadgroup variable cannot have an initializer"));
  EXPECT_TRUE(contains(translation_error("kernel void k() {\n\n  threadgroup float a[2], *p;\n}\n", "k"),
                       "kernel.metal:3: declare threadgroup pointers apart from threadgroup variables"));
}

TEST(Translate, OnlyTheChosenKernelRemains) {
  const std::string source = R"(kernel void first(device float* x [[buffer(0)]]) {
  threadgroup float t[2];
  x[0] = 1.0f;
}
namespace ns {
[[kernel]] void second(device float* y [[buffer(3)]]) { y[0] = 2.0f; }
}
)";
  std::string unit = translate(source, "second");
  std::vector<std::string> lines = metal_lines(unit);
  ASSERT_EQ(lines.size(), 7u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(lines[i], "");
  EXPECT_EQ(lines[5], "static void second(mfa_shim::buffer_ptr<float> y  ) { y[0] = 2.0f; }");
  std::string glue = glue_of(unit);
  EXPECT_TRUE(contains(glue, "namespace ns {\nstatic const mfa_abi::KernelInfo mfa_glue_info = "
                             "{\"second\", {0, 0, 0, sizeof(float)}};"));
  EXPECT_TRUE(contains(glue, "return &ns::mfa_glue_info;"));
  EXPECT_TRUE(contains(glue, "mfa_glue::run_thread(t, ns::mfa_glue_run);"));

  TranslateOptions options;
  options.metal_path = "second.metal";
  EXPECT_TRUE(contains(translate(source, "second", {}, options), "#line 1 \"second.metal\"\n"));
  EXPECT_TRUE(contains(translation_error(source, "third"), "no kernel named 'third' in kernel.metal (it has 'first', 'second')"));
}

TEST(Translate, FeaturesNoHeaderCanProvideAreNamedWithTheirLine) {
  const std::string texture = "kernel void k(device float* x [[buffer(0)]]) {\n  texture2d<float> t;\n}\n";
  EXPECT_TRUE(contains(translation_error(texture, "k"), "kernel.metal:2: 'texture2d': textures"));
  const std::string assembly = "float f(float x) __asm(\"air.fast_exp\");\nkernel void k() {}\n";
  EXPECT_TRUE(contains(translation_error(assembly, "k"), "kernel.metal:1: '__asm': inline assembly"));
  const std::string internal = "kernel void k() {\n\n  __metal_simdgroup_barrier(0);\n}\n";
  EXPECT_TRUE(contains(translation_error(internal, "k"), "kernel.metal:3: '__metal_simdgroup_barrier'"));
  // ... but not inside another kernel, which is not translated.
  const std::string other = "kernel void a() { texture2d<float> t; }\nkernel void b() {}\n";
  EXPECT_NO_THROW(translate(other, "b"));
}

}  // namespace
