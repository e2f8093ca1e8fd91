// The MSL lexer and signature reflection: what Metal's reflection would
// report for each kernel, and errors that name the offending line.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/msl_lexer.hpp"
#include "mfa/errors.hpp"
#include "mfa/reflection.hpp"

namespace {

using mfa::AddressSpace;
using mfa::ArgumentInfo;
using mfa::ArgumentKind;
using mfa::FunctionInfo;

std::vector<std::string> token_texts(const std::string& source) {
  std::vector<std::string> texts;
  for (const mfa::msl::Token& token : mfa::msl::lex(source, "kernel.metal")) texts.emplace_back(token.text);
  return texts;
}

const ArgumentInfo& argument(const FunctionInfo& function, const std::string& name) {
  for (const ArgumentInfo& info : function.arguments) {
    if (info.name == name) return info;
  }
  throw std::runtime_error("no argument " + name);
}

FunctionInfo only_kernel(const std::string& source) {
  std::vector<FunctionInfo> functions = mfa::reflect_msl(source);
  if (functions.size() != 1) throw std::runtime_error("expected one kernel");
  return functions[0];
}

// The CompileError message for `source`, which must fail.
std::string reflection_error(const std::string& source) {
  try {
    mfa::reflect_msl(source);
  } catch (const mfa::CompileError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no CompileError for:\n" << source;
  return "";
}

TEST(MslLexer, AttributesBracketsAndMultiCharacterPunctuation) {
  EXPECT_EQ(token_texts("a[b[i]] = x[[y]];"),  // `]]` is one token only where it closes `[[`
            (std::vector<std::string>{"a", "[", "b", "[", "i", "]", "]", "=", "x", "[[", "y", "]]", ";"}));
  EXPECT_EQ(token_texts("device float* p [[buffer(0)]]"),
            (std::vector<std::string>{"device", "float", "*", "p", "[[", "buffer", "(", "0", ")", "]]"}));
  EXPECT_EQ(token_texts("metal::vec<vec<float, 2>> a; p->x <<= 1;"),
            (std::vector<std::string>{"metal", "::", "vec", "<", "vec", "<", "float", ",", "2", ">", ">",
                                      "a", ";", "p", "->", "x", "<<=", "1", ";"}));
}

TEST(MslLexer, NumbersWithSuffixesAndExponents) {
  EXPECT_EQ(token_texts("1.5h 2h 1e-3h 0x1p-3f .5f 10u 1.0e+10"),
            (std::vector<std::string>{"1.5h", "2h", "1e-3h", "0x1p-3f", ".5f", "10u", "1.0e+10"}));
  EXPECT_EQ(token_texts("a-1"), (std::vector<std::string>{"a", "-", "1"}));
}

TEST(MslLexer, CommentsSkippedDirectivesKeptWholeLinesCounted) {
  const std::string source =
      "#define TWO(x) \\\n"
      "  (2 * (x))\n"
      "/* a comment\n"
      "   over lines */ int a; // kernel void nothing()\n"
      "char c = '\\''; const char* s = \"/* not a comment */\";\n"
      "  #pragma once\n";
  std::vector<mfa::msl::Token> tokens = mfa::msl::lex(source, "kernel.metal");
  ASSERT_EQ(tokens.size(), 17u);
  EXPECT_EQ(tokens[0].kind, mfa::msl::TokenKind::preprocessor);
  EXPECT_EQ(tokens[0].text, "#define TWO(x) \\\n  (2 * (x))");
  EXPECT_EQ(tokens[1].text, "int");
  EXPECT_EQ(tokens[1].line, 4);
  EXPECT_EQ(tokens[4].text, "char");
  EXPECT_EQ(tokens[4].line, 5);
  EXPECT_EQ(tokens[7].text, "'\\''");
  EXPECT_EQ(tokens[7].kind, mfa::msl::TokenKind::character);
  EXPECT_EQ(tokens[14].text, "\"/* not a comment */\"");
  EXPECT_EQ(tokens[14].kind, mfa::msl::TokenKind::string);
  EXPECT_EQ(tokens[16].kind, mfa::msl::TokenKind::preprocessor);
  EXPECT_EQ(tokens[16].text, "#pragma once");
  EXPECT_EQ(tokens[16].line, 6);
  EXPECT_EQ(source.substr(tokens[1].offset, 3), "int");
}

TEST(MslLexer, ErrorsNameTheLine) {
  EXPECT_THROW(mfa::msl::lex("a\n/* never closed", "kernel.metal"), mfa::CompileError);
  try {
    mfa::msl::lex("int a;\n\nconst char* s = \"open\n", "k.metal");
    FAIL();
  } catch (const mfa::CompileError& e) {
    EXPECT_NE(std::string(e.what()).find("k.metal:3: unterminated string"), std::string::npos) << e.what();
  }
  try {
    mfa::msl::lex("int a;\nint @b;", "kernel.metal");
    FAIL();
  } catch (const mfa::CompileError& e) {
    EXPECT_NE(std::string(e.what()).find("kernel.metal:2: unexpected character '@'"), std::string::npos);
  }
}

TEST(Reflection, EveryBuiltinWithItsDeclaredType) {
  FunctionInfo function = only_kernel(R"(
#include <metal_stdlib>
using namespace metal;
kernel void all_builtins(uint3 a [[thread_position_in_grid]],
                         ushort2 b [[thread_position_in_threadgroup]],
                         uint c [[threadgroup_position_in_grid]],
                         ushort3 d [[threads_per_threadgroup]],
                         uint2 e [[threadgroups_per_grid]],
                         metal::uint3 f [[threads_per_grid]],
                         ushort g [[thread_index_in_threadgroup]],
                         uint h [[thread_index_in_simdgroup]],
                         const uint i [[simdgroup_index_in_threadgroup]],
                         ushort j [[threads_per_simdgroup]],
                         uint k [[simdgroups_per_threadgroup]],
                         uint l [[thread_execution_width]]) {}
)");
  EXPECT_EQ(function.name, "all_builtins");
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"thread_position_in_grid", "uint3"},        {"thread_position_in_threadgroup", "ushort2"},
      {"threadgroup_position_in_grid", "uint"},    {"threads_per_threadgroup", "ushort3"},
      {"threadgroups_per_grid", "uint2"},          {"threads_per_grid", "metal::uint3"},
      {"thread_index_in_threadgroup", "ushort"},   {"thread_index_in_simdgroup", "uint"},
      {"simdgroup_index_in_threadgroup", "uint"},  {"threads_per_simdgroup", "ushort"},
      {"simdgroups_per_threadgroup", "uint"},      {"thread_execution_width", "uint"},
  };
  ASSERT_EQ(function.arguments.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const ArgumentInfo& info = function.arguments[i];
    EXPECT_EQ(info.name, std::string(1, char('a' + i)));
    EXPECT_EQ(info.kind, ArgumentKind::builtin);
    EXPECT_EQ(info.index, -1);
    EXPECT_EQ(info.space, AddressSpace::none);
    EXPECT_EQ(info.builtin, expected[i].first);
    EXPECT_EQ(info.builtin_type, expected[i].second);
  }
  EXPECT_TRUE(argument(function, "i").is_const);
  EXPECT_EQ(function.buffer(0), nullptr);
}

TEST(Reflection, BuffersPointersReferencesConstness) {
  FunctionInfo function = only_kernel(R"(
struct Params { uint n; float scale; };
kernel void mixed(device const float* a [[buffer(0)]],
                  const device half4 *b [[buffer(1)]],
                  device float* restrict out [[ buffer(2) ]],
                  constant Params& p [[buffer(3)]],
                  device Params const& q [[buffer(4)]],
                  device atomic_uint& counter [[buffer(5)]],
                  constant metal::float4* table [[buffer(6)]],
                  device array<float, 4>* rows [[buffer(7)]],
                  device float* const fixed [[buffer(30)]],
                  threadgroup float* scratch [[threadgroup(0)]],
                  threadgroup Params& shared_params [[threadgroup(1)]]) {}
)");
  struct Expected {
    const char* name;
    ArgumentKind kind;
    int index;
    AddressSpace space;
    const char* type;
    bool is_pointer, is_const;
  };
  const Expected expected[] = {
      {"a", ArgumentKind::buffer, 0, AddressSpace::device, "float", true, true},
      {"b", ArgumentKind::buffer, 1, AddressSpace::device, "half4", true, true},
      {"out", ArgumentKind::buffer, 2, AddressSpace::device, "float", true, false},
      {"p", ArgumentKind::buffer, 3, AddressSpace::constant, "Params", false, true},
      {"q", ArgumentKind::buffer, 4, AddressSpace::device, "Params", false, true},
      {"counter", ArgumentKind::buffer, 5, AddressSpace::device, "atomic_uint", false, false},
      {"table", ArgumentKind::buffer, 6, AddressSpace::constant, "metal::float4", true, true},
      {"rows", ArgumentKind::buffer, 7, AddressSpace::device, "array<float, 4>", true, false},
      {"fixed", ArgumentKind::buffer, 30, AddressSpace::device, "float", true, false},  // const pointer, not pointee
      {"scratch", ArgumentKind::threadgroup_memory, 0, AddressSpace::threadgroup, "float", true, false},
      {"shared_params", ArgumentKind::threadgroup_memory, 1, AddressSpace::threadgroup, "Params", false, false},
  };
  ASSERT_EQ(function.arguments.size(), std::size(expected));
  for (std::size_t i = 0; i < std::size(expected); ++i) {
    const ArgumentInfo& info = function.arguments[i];
    SCOPED_TRACE(expected[i].name);
    EXPECT_EQ(info.name, expected[i].name);
    EXPECT_EQ(info.kind, expected[i].kind);
    EXPECT_EQ(info.index, expected[i].index);
    EXPECT_EQ(info.space, expected[i].space);
    EXPECT_EQ(info.type, expected[i].type);
    EXPECT_EQ(info.is_pointer, expected[i].is_pointer);
    EXPECT_EQ(info.is_const, expected[i].is_const);
    EXPECT_TRUE(info.builtin.empty());
  }
  ASSERT_NE(function.buffer(3), nullptr);
  EXPECT_EQ(function.buffer(3)->name, "p");
  EXPECT_EQ(function.buffer(8), nullptr);
  EXPECT_EQ(function.max_total_threads_per_threadgroup, 0u);
}

TEST(Reflection, KernelForms) {
  std::vector<FunctionInfo> functions = mfa::reflect_msl(R"msl(
// kernel void in_a_comment(device float* x [[buffer(0)]]) {}
constant char* text = "kernel void in_a_string()";
kernel void declared_only(device float* x [[buffer(0)]]);
[[max_total_threads_per_threadgroup(256)]]
kernel void first(device float* x [[buffer(0)]]) { x[0] = 1.0f; }
inline float helper(float v) { return v * 2.0f; }
[[kernel]] void second(void) {}
namespace outer { namespace inner {
kernel void third(device uint* y [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  if (i == 0) { y[0] = 1; }
}
}}
kernel void declared_only(device float* x [[buffer(0)]]) {}
)msl");
  std::vector<std::string> names;
  for (const FunctionInfo& function : functions) names.push_back(function.name);
  EXPECT_EQ(names, (std::vector<std::string>{"first", "second", "third", "declared_only"}));
  EXPECT_EQ(functions[0].max_total_threads_per_threadgroup, 256u);
  EXPECT_TRUE(functions[1].arguments.empty());
  ASSERT_EQ(functions[2].arguments.size(), 2u);
  EXPECT_EQ(functions[2].buffer(1)->type, "uint");
}

TEST(Reflection, FunctionConstantsAndWhetherTheyAreRequired) {
  std::vector<FunctionInfo> functions = mfa::reflect_msl(R"(
constant bool has_bias [[function_constant(0)]];
constant uint block [[function_constant(1)]];
constant const half alpha [[function_constant(7)]];
constant metal::bfloat beta [[function_constant(3)]];
constant bool use_bias = is_function_constant_defined(has_bias);
kernel void a(device float* x [[buffer(0)]]) {
  if (is_function_constant_defined(beta)) x[0] = float(beta);
}
kernel void b(device float* x [[buffer(0)]]) { x[0] = float(block); }
)");
  ASSERT_EQ(functions.size(), 2u);
  for (const FunctionInfo& function : functions) {
    ASSERT_EQ(function.constants.size(), 4u);
    const mfa::FunctionConstantInfo* c = function.constants.data();
    EXPECT_EQ(c[0].name, "has_bias");
    EXPECT_EQ(c[0].index, 0);
    EXPECT_EQ(c[0].type, "bool");
    EXPECT_FALSE(c[0].required);
    EXPECT_EQ(c[1].name, "block");
    EXPECT_EQ(c[1].type, "uint");
    EXPECT_TRUE(c[1].required);
    EXPECT_EQ(c[2].name, "alpha");
    EXPECT_EQ(c[2].index, 7);
    EXPECT_EQ(c[2].type, "half");
    EXPECT_TRUE(c[2].required);
    EXPECT_EQ(c[3].type, "metal::bfloat");
    EXPECT_FALSE(c[3].required);
  }
}

TEST(Reflection, UnreadableSignaturesNameTheirLine) {
  struct Case {
    const char* source;
    const char* expected;  // part of the message, after the file and line
  };
  const Case cases[] = {
      {"kernel void k(device float* x [[buffer(0)]],\n"
       "              device float* y) {}",
       "kernel.metal:2: kernel 'k': parameter 'y' has no [[buffer(i)]], [[threadgroup(i)]] or builtin attribute"},
      {"kernel void k(device float* x [[buffer(1)]],\n\n"
       "              device float* y [[buffer(1)]]) {}",
       "kernel.metal:3: kernel 'k': [[buffer(1)]] is bound to both 'x' and 'y'"},
      {"\nkernel void k(float* x [[buffer(0)]]) {}", "kernel.metal:2: kernel 'k': parameter 'x': a [[buffer]] argument must be in the device or constant address space"},
      {"kernel void k(device float x [[buffer(0)]]) {}", "kernel.metal:1: kernel 'k': parameter 'x': a bound argument must be a pointer or a reference"},
      {"kernel void k(\nfloat3 p [[thread_position_in_grid]]) {}", "kernel.metal:2: kernel 'k': parameter 'p': [[thread_position_in_grid]] cannot be declared as 'float3'"},
      {"kernel void k(uint2 i [[thread_index_in_simdgroup]]) {}", "use uint or ushort"},
      {"kernel void k(device float* x [[buffer(31)]]) {}", "index 31 is above 30"},
      {"kernel void k(device float* x [[buffer(N)]]) {}", "[[buffer(...)]] needs a non-negative integer literal"},
      {"kernel void k(\n\n texture2d<float> t [[texture(0)]]) {}", "kernel.metal:3: kernel 'k': parameter 't': [[texture]] arguments are not supported"},
      {"kernel void k(device float* x [[buffer(0)]],\n uint i [[thread_index_in_quadgroup]]) {}", "kernel.metal:2: kernel 'k': parameter 'i': unknown attribute [[thread_index_in_quadgroup]]"},
      {"kernel void k(device float** x [[buffer(0)]]) {}", "only one level of pointer or reference"},
      {"\n\nkernel float k() {}", "kernel.metal:3: a kernel must return void"},
      {"template <typename T>\nkernel void k(device T* x [[buffer(0)]]) {}", "kernel.metal:1: template kernels are not supported"},
      {"kernel void k() {}\n\nkernel void k() {}", "kernel.metal:3: kernel 'k' is defined twice (also at line 1)"},
      {"constant int a [[function_constant(0)]];\nconstant int b [[function_constant(0)]];", "kernel.metal:2: function constants 'a' and 'b' share index 0"},
      {"\nconstant int a [[function_constant(0)]] = 3;", "kernel.metal:2: cannot read this function constant"},
      {"kernel void k() { if (is_function_constant_defined(nope)) {} }", "kernel.metal:1: is_function_constant_defined(nope): no such function constant"},
      {"kernel void k() {\n\n", "kernel.metal:1: '{' is never closed"},
      {"kernel void k() {}\n}", "kernel.metal:2: unbalanced '}'"},
  };
  for (const Case& c : cases) {
    std::string message = reflection_error(c.source);
    EXPECT_NE(message.find(c.expected), std::string::npos) << "message: " << message << "\nexpected: " << c.expected;
  }
}

}  // namespace
