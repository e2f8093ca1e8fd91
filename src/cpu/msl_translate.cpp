// MSL -> C++ for the cpu backend. The MSL text is kept line for line (every
// rewrite keeps the newlines it replaces), behind `#line 1 "<metal_path>"`,
// so compiler errors and diagnostics point at the .metal source.
#include "msl_translate.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <optional>
#include <string_view>
#include <variant>

#include "core/msl_syntax.hpp"
#include "mfa/errors.hpp"

namespace mfa::cpu {
namespace {

using msl::KernelSyntax;
using msl::ProgramSyntax;
using msl::Token;
using msl::TokenKind;
using msl::TokenSpan;

// Helpers the generated code uses, ahead of the MSL text.
constexpr const char* kPrelude = R"(#include <metal_stdlib>
#include "mfa_kernel_abi.h"
#include <cstdint>
#include <cstdio>
#include <exception>

namespace mfa_glue {
using mfa_abi::ThreadState;

// Builtin arguments, per axis (axis is ignored by the one-number builtins).
inline std::uint32_t thread_position_in_threadgroup(const ThreadState* t, int axis) {
  return t->thread_position_in_threadgroup[axis];
}
inline std::uint32_t threadgroup_position_in_grid(const ThreadState* t, int axis) {
  return t->group->threadgroup_position_in_grid[axis];
}
inline std::uint32_t threads_per_threadgroup(const ThreadState* t, int axis) {
  return t->dispatch->threads_per_threadgroup[axis];
}
inline std::uint32_t threadgroups_per_grid(const ThreadState* t, int axis) {
  return t->dispatch->threadgroups_per_grid[axis];
}
inline std::uint32_t thread_position_in_grid(const ThreadState* t, int axis) {
  return threadgroup_position_in_grid(t, axis) * threads_per_threadgroup(t, axis) +
         thread_position_in_threadgroup(t, axis);
}
inline std::uint32_t threads_per_grid(const ThreadState* t, int axis) {
  return threadgroups_per_grid(t, axis) * threads_per_threadgroup(t, axis);
}
inline std::uint32_t thread_index_in_threadgroup(const ThreadState* t, int) {
  return t->thread_index_in_threadgroup;
}
inline std::uint32_t thread_index_in_simdgroup(const ThreadState* t, int) {
  return t->thread_index_in_simdgroup;
}
inline std::uint32_t simdgroup_index_in_threadgroup(const ThreadState* t, int) {
  return t->simdgroup_index_in_threadgroup;
}
inline std::uint32_t simdgroups_per_threadgroup(const ThreadState* t, int) {
  return t->dispatch->simdgroups_per_threadgroup;
}
inline std::uint32_t threads_per_simdgroup(const ThreadState*, int) { return mfa_abi::kSimdWidth; }
inline std::uint32_t thread_execution_width(const ThreadState*, int) { return mfa_abi::kSimdWidth; }

// A reference argument whose buffer is smaller than its type (bounds checks).
inline void check_buffer_holds(ThreadState* t, unsigned index, const char* name, std::size_t bytes) {
  std::size_t size = t->dispatch->buffers[index] ? t->dispatch->buffer_sizes[index] : 0;
  if (size >= bytes) return;
  char message[256];
  std::snprintf(message, sizeof message, "buffer(%u) '%s' holds %zu bytes; its type needs %zu",
                index, name, size, bytes);
  t->dispatch->runtime->fail(t, message);
}

// Adds the traffic of one thread's pointers to its group's counters. Each
// thread counts on its own stack first: the threads of a group take turns on
// one OS thread, and counting straight into the group's counters would chain
// every access of every thread through one memory location.
inline void add_traffic(const ThreadState* t, const mfa_abi::BufferTraffic* traffic, unsigned count) {
  mfa_abi::BufferTraffic* const group = t->group->counters->buffers;
  for (unsigned i = 0; i < count; ++i) {
    group[i].bytes_read += traffic[i].bytes_read;
    group[i].bytes_written += traffic[i].bytes_written;
  }
}

// The watchdog's cooperative check, first in every loop's condition (see
// rewrite_loop_conditions): a countdown shared by the fibers of this OS
// thread and, every kLoopIterationsPerCheck iterations, a call into the
// runtime, which ends the dispatch if the threadgroup has run too long.
// constexpr, so that loops in constexpr functions still evaluate at compile time.
inline thread_local unsigned loop_countdown = mfa_abi::kLoopIterationsPerCheck;

[[gnu::noinline, gnu::cold]] inline void check_loop(const char* file, int line) {
  loop_countdown = mfa_abi::kLoopIterationsPerCheck;
  ThreadState* const t = mfa_abi::current_thread;
  const mfa_abi::Site site{"loop", file, line, 0};
  t->dispatch->runtime->loop_check(t, &site);
}

constexpr bool loop_continues(const char* file, int line) {
  if (__builtin_is_constant_evaluated()) return true;
  if (__builtin_expect(--loop_countdown == 0, 0)) check_loop(file, line);
  return true;
}

// Runs one GPU thread; an exception escaping the kernel fails the dispatch.
// The message is copied out of the handler first: fail() never returns, and
// a fiber must not be abandoned inside a catch block.
inline void run_thread(ThreadState* t, void (*body)(ThreadState*)) {
  mfa_abi::current_thread = t;
  char message[512];
  try {
    body(t);
    return;
  } catch (const std::exception& e) {
    std::snprintf(message, sizeof message, "%s", e.what());
  } catch (...) {
    std::snprintf(message, sizeof message, "unknown exception");
  }
  t->dispatch->runtime->fail(t, message);
}
}  // namespace mfa_glue
)";

// Identifiers of MSL features no header can provide on the CPU.
struct Unsupported {
  std::string_view word;
  const char* why;
};
constexpr const char* kNoTextures = "textures, samplers, imageblocks and ray tracing are not supported";
constexpr Unsupported kUnsupportedWords[] = {
    {"__asm", "inline assembly (AIR intrinsics) cannot run on the cpu backend"},
    {"__asm__", "inline assembly (AIR intrinsics) cannot run on the cpu backend"},
    {"asm", "inline assembly (AIR intrinsics) cannot run on the cpu backend"},
    {"vertex", "vertex functions are not supported; only kernels run on the cpu backend"},
    {"fragment", "fragment functions are not supported; only kernels run on the cpu backend"},
    {"texture1d", kNoTextures}, {"texture1d_array", kNoTextures}, {"texture2d", kNoTextures},
    {"texture2d_array", kNoTextures}, {"texture2d_ms", kNoTextures}, {"texture2d_ms_array", kNoTextures},
    {"texture3d", kNoTextures}, {"texturecube", kNoTextures}, {"texturecube_array", kNoTextures},
    {"texture_buffer", kNoTextures}, {"depth2d", kNoTextures}, {"depth2d_array", kNoTextures},
    {"depth2d_ms", kNoTextures}, {"depth2d_ms_array", kNoTextures}, {"depthcube", kNoTextures},
    {"depthcube_array", kNoTextures}, {"sampler", kNoTextures}, {"imageblock", kNoTextures},
    {"acceleration_structure", kNoTextures}, {"intersector", kNoTextures},
    {"visible_function_table", kNoTextures}, {"intersection_function_table", kNoTextures},
};

// Edits of source byte ranges. Each replacement is one line of text followed
// by the newlines of the range it replaces, so every later line keeps its number.
class Rewriter {
 public:
  explicit Rewriter(std::string_view source) : source_(source) {}

  bool covers(std::size_t offset) const {
    for (const Edit& edit : edits_) {
      if (offset >= edit.begin && offset < edit.end) return true;
    }
    return false;
  }

  void replace(std::size_t begin, std::size_t end, std::string text) {
    for (char c : source_.substr(begin, end - begin)) {
      if (c == '\n') text += '\n';
    }
    edits_.push_back({begin, end, std::move(text)});
  }

  void replace(const std::vector<Token>& tokens, TokenSpan span, std::string text) {
    replace(tokens[span.begin].offset, tokens[span.end - 1].end(), std::move(text));
  }

  std::string apply() {
    // An insertion (an empty range) goes before a replacement starting there.
    std::sort(edits_.begin(), edits_.end(), [](const Edit& a, const Edit& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    std::string out;
    std::size_t pos = 0;
    for (const Edit& edit : edits_) {
      out.append(source_.substr(pos, edit.begin - pos));
      out += edit.text;
      pos = edit.end;
    }
    out.append(source_.substr(pos));
    return out;
  }

 private:
  struct Edit {
    std::size_t begin, end;
    std::string text;
  };
  std::string_view source_;
  std::vector<Edit> edits_;
};

// The `#include <...>` lines of the MSL text (<metal_tensor>, MetalPerformancePrimitives).
// The text goes inside namespace metal, so their shim headers are included ahead of it,
// at global scope; the text's own #include lines then do nothing (#pragma once).
std::string library_includes(std::string_view source) {
  std::string includes;
  for (std::size_t start = 0; start < source.size();) {
    std::size_t end = source.find('\n', start);
    if (end == std::string_view::npos) end = source.size();
    std::string_view line = source.substr(start, end - start);
    line.remove_prefix(std::min(line.find_first_not_of(" \t"), line.size()));
    constexpr std::string_view kInclude = "#include";
    if (line.substr(0, kInclude.size()) == kInclude) {
      std::string_view name = line.substr(kInclude.size());
      name.remove_prefix(std::min(name.find_first_not_of(" \t"), name.size()));
      const std::size_t close = name.find('>');
      if (!name.empty() && name[0] == '<' && close != std::string_view::npos) {
        includes += "#include " + std::string(name.substr(0, close + 1)) + "\n";
      }
    }
    start = end + 1;
  }
  return includes;
}

class Translator {
 public:
  Translator(const std::string& source, const FunctionInfo& function,
             const std::map<int, ConstantValue>& constants, const TranslateOptions& options)
      : options_(options),
        constants_(constants),
        program_(msl::parse_program(source, options.metal_path)),
        tokens_(program_.tokens),
        kernel_(find_kernel(function.name)),
        rewriter_(source) {}

  // `includes`: the library_includes of the source.
  std::string run(const std::string& includes) {
    for (const KernelSyntax& other : program_.kernels) {
      if (&other != &kernel_) rewriter_.replace(tokens_, other.declaration, "");
    }
    reject_unsupported();
    bake_function_constants();
    rewrite_signature();
    rewrite_buffer_pointer_types();
    rewrite_threadgroup_variables();
    if (options_.bounds_check) rewrite_thread_arrays();
    rewrite_half_literals();
    rewrite_loop_conditions();

    std::string text = rewriter_.apply();
    if (!text.empty() && text.back() != '\n') text += '\n';
    // Inside namespace metal, unqualified calls find Metal's functions before
    // the C library's: libc++ declares float overloads of exp2, abs, ... in
    // the global namespace, which `using namespace metal;` alone leaves ambiguous.
    // Bounds checks: buffer_ptr checks every access (mfa_buffer_ptr.h), and
    // threadgroup pointers and thread arrays their array's extent (mfa_arrays.h).
    // The race detector: threadgroup pointers record their accesses (mfa_threadgroup_ptr.h).
    const std::string checks = std::string(options_.bounds_check ? "#define MFA_SHIM_BOUNDS_CHECK 1\n" : "") +
                               (options_.race_check ? "#define MFA_SHIM_RACE_CHECK 1\n" : "");
    return checks + includes + kPrelude + "namespace metal {\n" + ("#line 1 \"" + options_.metal_path + "\"\n") + text + glue() +
           "}  // namespace metal\n";
  }

 private:
  [[noreturn]] void fail(int line, const std::string& what) const {
    throw CompileError(options_.metal_path + ":" + std::to_string(line) + ": " + what, "");
  }

  const KernelSyntax& find_kernel(const std::string& name) const {
    const KernelSyntax* found = nullptr;
    std::string names;
    for (const KernelSyntax& kernel : program_.kernels) {
      names += (names.empty() ? "'" : ", '") + kernel.info.name + "'";
      if (kernel.info.name != name) continue;
      if (found) fail(tokens_[kernel.declaration.begin].line, "more than one kernel is named '" + name + "'");
      found = &kernel;
    }
    if (!found) {
      throw CompileError("no kernel named '" + name + "' in " + options_.metal_path +
                             (names.empty() ? " (it has no kernels)" : " (it has " + names + ")"),
                         "");
    }
    return *found;
  }

  // Whether a token is still as in the source: not replaced so far (the
  // other kernels are replaced, by nothing, before anything else).
  bool translated(std::size_t index) const { return !rewriter_.covers(tokens_[index].offset); }

  void reject_unsupported() const {
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      const Token& token = tokens_[i];
      if (token.kind != TokenKind::identifier || !translated(i)) continue;
      if (token.text.substr(0, 8) == "__metal_") {
        fail(token.line, "'" + std::string(token.text) + "': Metal compiler internals cannot run on the cpu backend");
      }
      for (const Unsupported& entry : kUnsupportedWords) {
        if (token.text == entry.word) fail(token.line, "'" + std::string(entry.word) + "': " + entry.why);
      }
    }
  }

  // `constant T name [[function_constant(i)]];` -> `constexpr T name = T(value);`
  // and `is_function_constant_defined(name)` -> true / false.
  void bake_function_constants() {
    for (const msl::FunctionConstantSyntax& constant : program_.constants) {
      const FunctionConstantInfo& info = constant.info;
      auto value = constants_.find(info.index);
      int line = tokens_[constant.declaration.begin].line;
      if (value == constants_.end() && info.required) {
        // As in Metal, an unset constant is an error only where a kernel uses
        // it: the compiler then names this type at the line of the use.
        const std::string marker = "function_constant_" + info.name + "_index_" + std::to_string(info.index) +
                                   "_has_no_value";
        rewriter_.replace(tokens_, constant.declaration,
                          "struct " + marker + " {}; constexpr " + marker + " " + info.name + "{};");
        continue;
      }
      std::string initial = value == constants_.end() ? "" : literal(info, value->second, line);
      rewriter_.replace(tokens_, constant.declaration,
                        "constexpr " + info.type + " " + info.name + " = " + info.type + "(" + initial + ");");
    }
    for (const msl::ConstantQuerySyntax& query : program_.constant_queries) {
      if (!translated(query.tokens.begin)) continue;
      bool defined = false;
      for (const msl::FunctionConstantSyntax& constant : program_.constants) {
        defined |= constant.info.name == query.name && constants_.count(constant.info.index);
      }
      rewriter_.replace(tokens_, query.tokens, defined ? "true" : "false");
    }
  }

  // The value in C++ with full precision, for the constant's declared type.
  std::string literal(const FunctionConstantInfo& info, const ConstantValue& value, int line) const {
    std::string_view type = info.type;
    if (type.substr(0, 7) == "metal::") type.remove_prefix(7);
    double number = std::visit([](auto v) { return static_cast<double>(v); }, value);
    if (type == "bool") return number != 0 ? "true" : "false";
    for (std::string_view integer : {"char", "uchar", "short", "ushort", "int", "uint", "long",
                                     "ulong", "int8_t", "uint8_t", "int16_t", "uint16_t",
                                     "int32_t", "uint32_t", "int64_t", "uint64_t", "size_t"}) {
      if (type != integer) continue;
      std::int64_t whole = std::visit([](auto v) { return static_cast<std::int64_t>(v); }, value);
      if (whole == INT64_MIN) return "(-9223372036854775807LL - 1)";
      return std::to_string(whole) + "LL";
    }
    if (type == "float" || type == "half" || type == "bfloat") {
      float single = static_cast<float>(number);
      if (std::isnan(single)) return "__builtin_nanf(\"\")";
      if (std::isinf(single)) return single > 0 ? "__builtin_inff()" : "-__builtin_inff()";
      char text[64];
      std::snprintf(text, sizeof text, "%af", static_cast<double>(single));  // exact: hex float
      return text;
    }
    fail(line, "function constant '" + info.name + "' has type '" + info.type +
                   "', which the cpu backend cannot specialize (use bool, an integer type, float, half or bfloat)");
  }

  // The kernel becomes a static function without attributes.
  void rewrite_signature() {
    rewriter_.replace(tokens_, kernel_.keyword, "static");
    for (const TokenSpan& attribute : kernel_.attributes) rewriter_.replace(tokens_, attribute, " ");
    for (const msl::ParameterSyntax& parameter : kernel_.parameters) {
      for (const TokenSpan& attribute : parameter.attributes) rewriter_.replace(tokens_, attribute, " ");
    }
  }

  // Every pointer type spelled `device T*` or `constant T*` (parameters,
  // locals, casts, helper functions) -> `mfa_shim::buffer_ptr<T>`, which
  // counts traffic (and checks bounds, if enabled) through copies and
  // arithmetic; with the race detector or bounds checks, `threadgroup T*`
  // likewise -> `mfa_shim::threadgroup_ptr<T>`. A `const` just before the address space
  // belongs to T; `constant` memory is read-only, so its T is const.
  void rewrite_buffer_pointer_types() {
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      const bool is_constant = tokens_[i].is("constant");
      const bool is_threadgroup = checks_threadgroup_memory() && tokens_[i].is("threadgroup");
      if (!(is_constant || is_threadgroup || tokens_[i].is("device")) || !translated(i)) continue;
      const std::size_t star = pointer_star(i + 1);
      if (star == 0) continue;
      const bool const_before = i > 0 && tokens_[i - 1].is("const") && translated(i - 1);
      std::string element = msl::join_tokens(tokens_, {i + 1, star});
      if ((const_before || is_constant) && element.compare(0, 6, "const ") != 0) element = "const " + element;
      const char* pointer = is_threadgroup ? "mfa_shim::threadgroup_ptr<" : "mfa_shim::buffer_ptr<";
      rewriter_.replace(tokens_, {const_before ? i - 1 : i, star + 1}, pointer + element + ">");
      i = star;
    }
  }

  // The `*` that ends the pointee type starting at `begin` (identifiers, `::`
  // and template arguments), or 0 when the type is not a pointer's.
  std::size_t pointer_star(std::size_t begin) const {
    int angle_depth = 0;
    for (std::size_t j = begin; j < tokens_.size(); ++j) {
      const Token& token = tokens_[j];
      if (token.is("<")) {
        ++angle_depth;
      } else if (token.is(">") && angle_depth > 0) {
        --angle_depth;
      } else if (angle_depth > 0) {
        if (token.is(";") || token.is("{") || token.is("}")) return 0;
      } else if (token.is("*")) {
        return j > begin ? j : 0;
      } else if (token.kind != TokenKind::identifier && !token.is("::")) {
        return 0;
      }
    }
    return 0;
  }

  // `threadgroup T a[N], b;` at statement level in the kernel body ->
  // `auto&& a = mfa_shim::threadgroup_variable<T[N]>(); auto&& b = ...;`
  // (references to the variables; with the race detector, checked proxies).
  // Threadgroup pointer declarations stay as they are.
  void rewrite_threadgroup_variables() {
    for (std::size_t i = kernel_.body.begin + 1; i + 1 < kernel_.body.end; ++i) {
      const Token& previous = tokens_[i - 1];
      bool statement_start = previous.is("{") || previous.is("}") || previous.is(";") ||
                             previous.kind == TokenKind::preprocessor;
      if (!tokens_[i].is("threadgroup") || !statement_start) continue;
      std::size_t end = statement_end(i);
      std::vector<TokenSpan> declarators = split_declarators({i + 1, end});
      std::string replacement;
      std::string type;
      for (std::size_t d = 0; d < declarators.size(); ++d) {
        std::string declared = threadgroup_declarator(declarators[d], d == 0, type);
        if (declared.empty()) break;  // a pointer: left alone
        replacement += (d ? " " : "") + declared;
      }
      if (!replacement.empty()) rewriter_.replace(tokens_, {i, end + 1}, replacement);
      i = end;
    }
  }

  std::size_t statement_end(std::size_t begin) const {
    for (std::size_t j = begin; j < kernel_.body.end; ++j) {
      if (tokens_[j].is("(") || tokens_[j].is("[") || tokens_[j].is("{")) j = msl::find_closing(tokens_, j);
      if (j < kernel_.body.end && tokens_[j].is(";")) return j;
    }
    fail(tokens_[begin].line, "threadgroup declaration without ';'");
  }

  std::vector<TokenSpan> split_declarators(TokenSpan span) const {
    std::vector<TokenSpan> parts;
    std::size_t begin = span.begin;
    int angle_depth = 0;
    for (std::size_t j = span.begin; j < span.end; ++j) {
      if (tokens_[j].is("(") || tokens_[j].is("[")) j = msl::find_closing(tokens_, j);
      else if (tokens_[j].is("<")) ++angle_depth;
      else if (tokens_[j].is(">") && angle_depth > 0) --angle_depth;
      else if (tokens_[j].is(",") && angle_depth == 0) {
        parts.push_back({begin, j});
        begin = j + 1;
      }
    }
    parts.push_back({begin, span.end});
    return parts;
  }

  // One declarator of a threadgroup declaration as a C++ declaration, or ""
  // for a pointer or reference. The first declarator holds the type and sets
  // `type`; the ones after use it.
  std::string threadgroup_declarator(TokenSpan span, bool first, std::string& type) const {
    const int line = tokens_[span.begin].line;
    std::size_t name = span.end;  // the last identifier outside brackets and template arguments
    int angle_depth = 0;
    bool indirect = false;
    for (std::size_t j = span.begin; j < span.end; ++j) {
      const Token& token = tokens_[j];
      if (token.is("[")) {
        j = msl::find_closing(tokens_, j);
      } else if (token.is("<")) {
        ++angle_depth;
      } else if (token.is(">")) {
        --angle_depth;
      } else if (token.is("*") || token.is("&") || token.is("(")) {
        indirect = true;
      } else if (token.is("=")) {
        if (!indirect) fail(line, "a threadgroup variable cannot have an initializer");
      } else if (token.kind == TokenKind::identifier && angle_depth == 0) {
        name = j;
      }
    }
    if (indirect) {
      if (first) return "";
      fail(line, "declare threadgroup pointers apart from threadgroup variables");
    }
    if (name == span.end || (first ? name == span.begin : name != span.begin)) {
      fail(line, "cannot read this threadgroup declaration");
    }
    if (first) type = msl::join_tokens(tokens_, {span.begin, name});
    for (std::size_t j = name + 1; j < span.end; j = msl::find_closing(tokens_, j) + 1) {
      if (!tokens_[j].is("[")) fail(line, "cannot read this threadgroup declaration");
    }
    std::string dimensions = name + 1 < span.end ? msl::join_tokens(tokens_, {name + 1, span.end}) : "";
    const std::string declaration = "threadgroup " + type + " " + std::string(tokens_[name].text) + dimensions;
    return "auto&& " + std::string(tokens_[name].text) + " = mfa_shim::threadgroup_variable<" +
           type + dimensions + ">(" + string_literal(declaration) + ");";
  }

  // Bounds checks: each thread-local array declared at statement level in a
  // function body, `[const] [thread] T a[N][M] [= {...}];`, becomes
  // `struct Tag {...}; [const] mfa_shim::thread_array<mfa_shim::thread_array<T, (M), Tag>, (N), Tag> a
  // [= {{...}}];` (mfa_arrays.h), where Tag names the declaration. A statement
  // with several declarators becomes one declaration per declarator. Only
  // the type, the dimensions and the initializer's braces are edited, so the
  // initializer's own tokens still get the other rewrites.
  void rewrite_thread_arrays() {
    const std::vector<bool> starts = statement_starts_in_functions();
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      if (starts[i] && translated(i)) i = rewrite_thread_array_declaration(i);
    }
  }

  // Tokens that begin a statement in a function body: after `{`, `}`, `;` or
  // a preprocessor line, in a brace block that is code (a function body, or
  // a block at statement level in one), outside parentheses and brackets.
  std::vector<bool> statement_starts_in_functions() const {
    std::vector<bool> starts(tokens_.size(), false);
    std::vector<bool> code_blocks;  // one per open `{`: whether it holds statements
    int brackets = 0;
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      const Token& token = tokens_[i];
      const bool in_code = !code_blocks.empty() && code_blocks.back() && brackets == 0;
      const bool after_statement = i > 0 && (tokens_[i - 1].is("{") || tokens_[i - 1].is("}") ||
                                             tokens_[i - 1].is(";") || tokens_[i - 1].kind == TokenKind::preprocessor);
      if (in_code && after_statement && token.kind == TokenKind::identifier) starts[i] = true;
      if (token.is("(") || token.is("[") || token.is("[[")) {
        ++brackets;
      } else if (token.is(")") || token.is("]") || token.is("]]")) {
        --brackets;
      } else if (token.is("{")) {
        const bool body = i > 0 && (tokens_[i - 1].is(")") || (tokens_[i - 1].is("const") && i > 1 && tokens_[i - 2].is(")")));
        const bool block = in_code && (after_statement || tokens_[i - 1].is("else") || tokens_[i - 1].is("do"));
        code_blocks.push_back(brackets == 0 && (body || block));
      } else if (token.is("}") && !code_blocks.empty()) {
        code_blocks.pop_back();
      }
    }
    return starts;
  }

  // Rewrites the declaration starting at `begin` if it declares a
  // thread-local array; returns the index of the last token it looked at.
  std::size_t rewrite_thread_array_declaration(std::size_t begin) {
    static constexpr std::string_view kNotTypes[] = {
        "return", "else", "do", "case", "default", "goto", "throw", "delete", "new", "sizeof", "typedef",
        "using", "static", "constexpr", "extern", "register", "struct", "class", "union", "enum",
        "namespace", "template", "typename", "friend", "threadgroup", "device", "constant", "if", "for",
        "while", "switch", "break", "continue", "static_assert", "operator", "alignas", "auto", "volatile"};
    std::size_t j = begin;
    bool is_const = false;
    for (; j < tokens_.size() && (tokens_[j].is("const") || tokens_[j].is("thread")); ++j) {
      is_const |= tokens_[j].is("const");
    }
    const std::size_t type_begin = j;
    if (std::find(std::begin(kNotTypes), std::end(kNotTypes), tokens_[type_begin].text) != std::end(kNotTypes)) {
      return begin;
    }
    // The statement's end, and every token of it untouched so far.
    std::size_t end = begin;
    for (; end < tokens_.size() && !tokens_[end].is(";"); ++end) {
      if (tokens_[end].is("}") || !translated(end)) return begin;
      if (tokens_[end].is("(") || tokens_[end].is("[") || tokens_[end].is("{")) end = msl::find_closing(tokens_, end);
    }
    if (end >= tokens_.size()) return begin;
    // The type: identifiers, `::` and template arguments, up to the first declarator's name.
    std::size_t k = type_begin;
    for (int angle = 0; k < end; ++k) {
      const Token& token = tokens_[k];
      if (angle > 0) {
        angle += token.is("<") ? 1 : token.is(">") ? -1 : 0;
      } else if (token.is("<")) {
        ++angle;
      } else if (token.kind != TokenKind::identifier && !token.is("::")) {
        break;
      }
    }
    if (k <= type_begin + 1 || tokens_[k - 1].kind != TokenKind::identifier ||
        !(tokens_[k].is("[") || tokens_[k].is(",") || tokens_[k].is("=") || tokens_[k].is(";"))) {
      return end;
    }
    const std::string type = msl::join_tokens(tokens_, {type_begin, k - 1});
    const std::string qualifiers = is_const ? "const " : "";

    // The declarators, at the commas outside brackets, braces and template arguments.
    std::vector<TokenSpan> declarators;
    std::size_t from = k - 1;
    for (std::size_t d = from; d <= end; ++d) {
      if (d < end && (tokens_[d].is("(") || tokens_[d].is("[") || tokens_[d].is("{"))) {
        d = msl::find_closing(tokens_, d);
      } else if (d == end || tokens_[d].is(",")) {
        declarators.push_back({from, d});
        from = d + 1;
      }
    }
    std::vector<std::optional<ArrayDeclarator>> arrays;
    for (const TokenSpan& span : declarators) arrays.push_back(array_declarator(span));
    if (std::none_of(arrays.begin(), arrays.end(), [](const auto& a) { return a.has_value(); })) return end;

    for (std::size_t d = 0; d < declarators.size(); ++d) {
      const TokenSpan& span = declarators[d];
      const std::size_t name = span.begin;
      std::string declared_type = qualifiers + type;
      if (arrays[d]) {
        const ArrayDeclarator& array = *arrays[d];
        const std::string tag = "mfa_array_" + std::string(tokens_[name].text);
        const std::string dimensions = msl::join_tokens(tokens_, {name + 1, array.dimensions.back().end + 1});
        const std::string declaration = "thread " + qualifiers + type + " " + std::string(tokens_[name].text) +
                                        dimensions;
        std::string nested = type;
        for (std::size_t n = array.dimensions.size(); n-- > 0;) {
          nested = "mfa_shim::thread_array<" + nested + ", (" + msl::join_tokens(tokens_, array.dimensions[n]) +
                   "), " + tag + ">";
        }
        declared_type = "struct " + tag + " { static const char* declaration() { return " +
                        string_literal(declaration) + "; } }; " + qualifiers + nested;
        rewriter_.replace(tokens_, {name + 1, array.dimensions.back().end + 1}, "");
        if (array.initializer) {
          const std::size_t open = array.initializer, close = msl::find_closing(tokens_, open);
          rewriter_.replace(tokens_[open].offset, tokens_[open].offset, "{");
          rewriter_.replace(tokens_[close].end(), tokens_[close].end(), "}");
        }
      }
      if (d == 0) {
        if (arrays[d]) rewriter_.replace(tokens_, {begin, name}, declared_type);
      } else {
        rewriter_.replace(tokens_, {name - 1, name}, "; " + declared_type);
      }
    }
    return end;
  }

  struct ArrayDeclarator {
    std::vector<TokenSpan> dimensions;  // the tokens inside each [ ]
    std::size_t initializer = 0;        // index of the initializer's `{`, or 0
  };

  // `name [d1] [d2] ... [= {...}]`: its dimensions and initializer; nothing
  // for another declarator (a scalar, a pointer, an unknown bound, ...).
  std::optional<ArrayDeclarator> array_declarator(TokenSpan span) const {
    if (span.end <= span.begin + 1 || tokens_[span.begin].kind != TokenKind::identifier) return std::nullopt;
    ArrayDeclarator array;
    std::size_t j = span.begin + 1;
    for (; j < span.end && tokens_[j].is("["); j = msl::find_closing(tokens_, j) + 1) {
      const std::size_t close = msl::find_closing(tokens_, j);
      if (close == j + 1 || close >= span.end) return std::nullopt;  // `a[]`: unknown bound
      array.dimensions.push_back({j + 1, close});
    }
    if (array.dimensions.empty()) return std::nullopt;
    if (j == span.end) return array;
    if (!tokens_[j].is("=") || j + 1 >= span.end || !tokens_[j + 1].is("{") ||
        msl::find_closing(tokens_, j + 1) != span.end - 1) {
      return std::nullopt;
    }
    array.initializer = j + 1;
    return array;
  }

  // The watchdog: every loop checks in at each iteration, first thing in its
  // condition. `while (c)` (also ending a do loop) ->
  // `while (mfa_glue::loop_continues(__FILE__, LINE) && (c))`; `for (i; c; s)`
  // likewise, and `for (i;; s)` gets the check alone. Loops that end by
  // themselves go without: range-based ones and counted ones (every loop of
  // the generated kernels: the check would keep the tile loops from being
  // unrolled and vectorized, and cost registers in the key loop). Loops
  // inside #define bodies are not seen.
  void rewrite_loop_conditions() {
    for (std::size_t i = 0; i + 1 < tokens_.size(); ++i) {
      const bool is_for = tokens_[i].is("for");
      if (!(is_for || tokens_[i].is("while")) || !translated(i) || !tokens_[i + 1].is("(")) continue;
      const std::size_t open = i + 1;
      const std::size_t close = msl::find_closing(tokens_, open);
      std::size_t begin = open + 1, end = close;
      if (is_for) {
        std::vector<std::size_t> semicolons;
        for (std::size_t j = open + 1; j < close; ++j) {
          if (tokens_[j].is("(") || tokens_[j].is("[") || tokens_[j].is("{")) j = msl::find_closing(tokens_, j);
          else if (tokens_[j].is(";")) semicolons.push_back(j);
        }
        if (semicolons.size() != 2) continue;  // range-based
        if (counts_to_a_fixed_bound(open, semicolons[0], semicolons[1], close)) continue;
        begin = semicolons[0] + 1;
        end = semicolons[1];
      }
      const std::string check = "mfa_glue::loop_continues(__FILE__, " + std::to_string(tokens_[i].line) + ")";
      const std::size_t at = tokens_[begin].offset;
      if (begin == end) {
        rewriter_.replace(at, at, check);
      } else {
        rewriter_.replace(at, at, check + " && (");
        rewriter_.replace(tokens_[end].offset, tokens_[end].offset, ")");
      }
    }
  }

  // `for (T v = ...; v < N; ++v) { ... }` (or v++, v += M for a literal M):
  // a counted loop, which ends by itself when its braced body writes neither
  // v nor N (no assignment, increment, decrement or address). N is an
  // integer literal below 2^15 (v of an integer type of 16 bits or more;
  // v <= N too) or a name (v of 32 bits or more, and only `<`: v <= UINT_MAX
  // never ends). A name bound within M of its type's maximum would wrap v
  // around: the one way such a loop escapes the watchdog.
  bool counts_to_a_fixed_bound(std::size_t open, std::size_t first, std::size_t second,
                               std::size_t close) const {
    auto is_literal = [&](std::size_t j, long below) {
      if (tokens_[j].kind != TokenKind::number) return false;
      const std::string text(tokens_[j].text);
      char* rest = nullptr;
      const long value = std::strtol(text.c_str(), &rest, 10);
      const std::string_view suffix(rest);
      return value > 0 && value < below && (suffix.empty() || suffix == "u" || suffix == "U");
    };
    static constexpr std::string_view kShortTypes[] = {"short", "ushort", "int16_t", "uint16_t"};
    static constexpr std::string_view kWideTypes[] = {"int", "uint", "long", "ulong", "size_t",
                                                      "int32_t", "uint32_t", "int64_t", "uint64_t"};
    auto one_of = [](std::string_view word, const auto& words) {
      return std::find(std::begin(words), std::end(words), word) != std::end(words);
    };
    if (first != open + 5 || !tokens_[open + 3].is("=")) return false;
    const std::string_view type = tokens_[open + 1].text;
    const bool wide = one_of(type, kWideTypes);
    if (!wide && !one_of(type, kShortTypes)) return false;
    const std::string_view name = tokens_[open + 2].text;
    const std::size_t bound = first + 3;
    const bool bound_is_name = tokens_[bound].kind == TokenKind::identifier;
    const bool below = tokens_[first + 2].is("<");
    const bool condition = second == first + 4 && tokens_[first + 1].is(name) &&
                           (below || tokens_[first + 2].is("<=")) &&
                           ((bound_is_name && wide && below && !tokens_[bound].is(name)) || is_literal(bound, 32768));
    const std::size_t step = second + 1;
    const bool steps = (close == step + 2 && ((tokens_[step].is("++") && tokens_[step + 1].is(name)) ||
                                              (tokens_[step].is(name) && tokens_[step + 1].is("++")))) ||
                       (close == step + 3 && tokens_[step].is(name) && tokens_[step + 1].is("+=") &&
                        is_literal(step + 2, 32768));
    if (!condition || !steps || close + 1 >= tokens_.size() || !tokens_[close + 1].is("{")) return false;
    const std::size_t body_end = msl::find_closing(tokens_, close + 1);
    for (std::size_t j = close + 2; j < body_end; ++j) {
      if (!tokens_[j].is(name) && !(bound_is_name && tokens_[j].is(tokens_[bound].text))) continue;
      const Token& before = tokens_[j - 1];
      const Token& after = tokens_[j + 1];
      const bool assigned = after.text.back() == '=' && !after.is("==") && !after.is("!=") && !after.is("<=") &&
                            !after.is(">=");
      if (assigned || after.is("++") || after.is("--") || after.is(">") || before.is("++") || before.is("--") ||
          before.is("&") || before.is(".") || before.is("->") || before.is("::")) {
        return false;
      }
    }
    return true;
  }

  // `1.5h` -> `half(1.5f)`, also inside #define directives.
  void rewrite_half_literals() {
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      const Token& token = tokens_[i];
      if (!translated(i)) continue;
      if (token.kind == TokenKind::number) {
        rewrite_half_literal(token.text, token.offset);
      } else if (token.kind == TokenKind::preprocessor && token.text.find("define") != std::string_view::npos) {
        std::string_view body = token.text.substr(1);
        std::vector<Token> inner;
        try {
          inner = msl::lex(body, options_.metal_path);
        } catch (const CompileError&) {
          continue;  // not tokenizable as MSL: left for the compiler to judge
        }
        for (const Token& t : inner) {
          if (t.kind == TokenKind::number) rewrite_half_literal(t.text, token.offset + 1 + t.offset);
        }
      }
    }
  }

  void rewrite_half_literal(std::string_view number, std::size_t offset) {
    if (number.size() < 2 || (number.back() != 'h' && number.back() != 'H')) return;
    if (number[1] == 'x' || number[1] == 'X') return;
    std::string value(number.substr(0, number.size() - 1));
    if (value.find_first_of(".eE") == std::string::npos) value += ".0";
    rewriter_.replace(offset, offset + number.size(), "half(" + value + "f)");
  }

  // The exported functions: kernel info, and a main that binds one thread's
  // arguments from its ThreadState and calls the kernel. The binding code
  // sits in the kernel's namespace, where its types are found.
  std::string glue() const {
    const std::string& name = kernel_.info.name;
    std::string open, close, qualified;
    for (const std::string& space : kernel_.namespaces) {
      open += "namespace " + space + " {\n";
      close += "}\n";
      if (!space.empty()) qualified += space + "::";
    }
    std::string checks, arguments;
    for (const msl::ParameterSyntax& parameter : kernel_.parameters) {
      arguments += (arguments.empty() ? "\n      " : ",\n      ") + argument_value(parameter.info);
      checks += size_check(parameter.info);
    }
    const std::string counted = std::to_string(counted_buffers());
    const std::string traffic = counted == "0" ? "" : "  mfa_abi::BufferTraffic traffic[" + counted + "] = {};\n";
    const std::string add_traffic = counted == "0" ? "" : "  mfa_glue::add_traffic(t, traffic, " + counted + ");\n";
    return "#line 1 \"mfa_glue_" + name + ".cpp\"\n" + open +
           "static const mfa_abi::KernelInfo mfa_glue_info = {\"" + name + "\", {" + argument_sizes() + "}};\n"
           "static void mfa_glue_run(mfa_abi::ThreadState* t) {\n" + checks + traffic + "  " + name + "(" +
           arguments + ");\n" + add_traffic + "}\n" + close +
           "#define MFA_EXPORT extern \"C\" __attribute__((visibility(\"default\")))\n"
           "MFA_EXPORT int mfa_kernel_abi_version() { return mfa_abi::kVersion; }\n"
           "MFA_EXPORT const mfa_abi::KernelInfo* mfa_kernel_info() { return &" + qualified + "mfa_glue_info; }\n"
           "MFA_EXPORT void mfa_kernel_main(mfa_abi::ThreadState* t) {\n"
           "  mfa_glue::run_thread(t, " + qualified + "mfa_glue_run);\n}\n";
  }

  // Buffer indices up to the highest pointer argument's: the thread's traffic array.
  int counted_buffers() const {
    int count = 0;
    for (const ArgumentInfo& info : kernel_.info.arguments) {
      if (info.kind == ArgumentKind::buffer && info.is_pointer) count = std::max(count, info.index + 1);
    }
    return count;
  }

  // KernelInfo::argument_bytes: `sizeof(T), 0, ...` up to the highest buffer index.
  std::string argument_sizes() const {
    int last_buffer = -1;
    for (const ArgumentInfo& info : kernel_.info.arguments) {
      if (info.kind == ArgumentKind::buffer) last_buffer = std::max(last_buffer, info.index);
    }
    std::string sizes;
    for (int i = 0; i <= last_buffer; ++i) {
      const ArgumentInfo* info = kernel_.info.buffer(i);
      sizes += std::string(i ? ", " : "") + (info ? "sizeof(" + info->type + ")" : "0");
    }
    return sizes;
  }

  std::string argument_value(const ArgumentInfo& info) const {
    if (info.kind == ArgumentKind::builtin) return builtin_value(info);
    const std::string index = std::to_string(info.index);
    const std::string address = info.kind == ArgumentKind::buffer ? "t->dispatch->buffers[" + index + "]"
                                                                  : "t->group->threadgroup_args[" + index + "]";
    // Non-const: converts to whatever the kernel declares, however the shim
    // spells the address spaces.
    const std::string pointer = "static_cast<" + info.type + "*>(" + address + ")";
    if (!info.is_pointer) return "*" + pointer;
    if (info.kind != ArgumentKind::buffer) {
      if (!checks_threadgroup_memory()) return pointer;
      const std::string declaration = "[[threadgroup(" + index + ")]] threadgroup " + element_type(info) + "* " +
                                      info.name;
      return "mfa_shim::threadgroup_argument<" + element_type(info) + ">(" + pointer +
             ", t->dispatch->threadgroup_arg_sizes[" + index + "], " + string_literal(declaration) + ")";
    }
    return "mfa_shim::buffer_ptr<" + element_type(info) + ">(" + pointer + ", t->dispatch->buffer_sizes[" + index +
           "], " + index + ", traffic[" + index + "])";
  }

  // Threadgroup memory goes through mfa_shim::threadgroup_ptr in both checking modes.
  bool checks_threadgroup_memory() const { return options_.race_check || options_.bounds_check; }

  // `text` as a C++ string literal.
  static std::string string_literal(const std::string& text) {
    std::string literal = "\"";
    for (char c : text) {
      if (c == '"' || c == '\\') literal += '\\';
      literal += c;
    }
    return literal + "\"";
  }

  static std::string element_type(const ArgumentInfo& info) {
    return (info.is_const ? "const " : "") + info.type;
  }

  // With bounds checks, a reference's buffer must hold its type.
  std::string size_check(const ArgumentInfo& info) const {
    if (!options_.bounds_check || info.kind != ArgumentKind::buffer || info.is_pointer) return "";
    return "  mfa_glue::check_buffer_holds(t, " + std::to_string(info.index) + ", \"" + info.name + "\", sizeof(" +
           info.type + "));\n";
  }

  // e.g. `uint3(uint(mfa_glue::thread_position_in_grid(t, 0)), ...)`
  static std::string builtin_value(const ArgumentInfo& info) {
    const std::string& type = info.builtin_type;
    int components = std::isdigit(static_cast<unsigned char>(type.back())) ? type.back() - '0' : 1;
    std::string scalar = components > 1 ? type.substr(0, type.size() - 1) : type;
    std::string value;
    for (int axis = 0; axis < components; ++axis) {
      value += std::string(axis ? ", " : "") + scalar + "(mfa_glue::" + info.builtin + "(t, " +
               std::to_string(axis) + "))";
    }
    return components > 1 ? type + "(" + value + ")" : value;
  }

  const TranslateOptions& options_;
  const std::map<int, ConstantValue>& constants_;
  ProgramSyntax program_;
  const std::vector<Token>& tokens_;
  const KernelSyntax& kernel_;
  Rewriter rewriter_;
};

}  // namespace

std::string translate_msl(const std::string& source, const FunctionInfo& function,
                          const std::map<int, ConstantValue>& constants,
                          const TranslateOptions& options) {
  return Translator(source, function, constants, options).run(library_includes(source));
}

}  // namespace mfa::cpu
