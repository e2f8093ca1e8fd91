// The declarations of an MSL source that matter to mfa, located by token:
// kernels (signature, attributes, body) and program-scope function constants.
// Reflection reads the facts; the cpu backend's translator rewrites the text
// at these places.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "core/msl_lexer.hpp"
#include "mfa/reflection.hpp"

namespace mfa::msl {

// Half-open range of token indices.
struct TokenSpan {
  std::size_t begin = 0, end = 0;
};

struct ParameterSyntax {
  ArgumentInfo info;
  TokenSpan declaration;              // the parameter's tokens, attributes included
  std::size_t name = 0;               // index of the name token
  std::vector<TokenSpan> attributes;  // each `[[ ... ]]`
};

struct KernelSyntax {
  FunctionInfo info;                  // name, arguments, max threads (constants: see ProgramSyntax)
  TokenSpan declaration;              // leading attributes through the closing `}`
  TokenSpan keyword;                  // `kernel`, or `[[ kernel ]]`
  std::vector<TokenSpan> attributes;  // the other attributes of the head
  std::vector<ParameterSyntax> parameters;
  TokenSpan body;                     // `{` through `}`
  std::vector<std::string> namespaces;  // enclosing namespaces, outermost first ("" = unnamed)
};

struct FunctionConstantSyntax {
  FunctionConstantInfo info;
  TokenSpan declaration;  // `constant` through `;`
};

// `is_function_constant_defined ( name )`
struct ConstantQuerySyntax {
  std::string name;
  TokenSpan tokens;
};

struct ProgramSyntax {
  std::vector<Token> tokens;
  std::vector<KernelSyntax> kernels;  // definitions only, in source order
  std::vector<FunctionConstantSyntax> constants;
  std::vector<ConstantQuerySyntax> constant_queries;
};

// Throws CompileError "<file_name>:LINE: ..." for what it cannot read.
// The tokens view `source`, which must outlive the result.
ProgramSyntax parse_program(std::string_view source, const std::string& file_name);

// Index of the token closing the `(`, `[`, `{` or `[[` at `open`.
std::size_t find_closing(const std::vector<Token>& tokens, std::size_t open);

// The tokens' text on one line: one space wherever the source had anything
// (whitespace, a comment) between two tokens.
std::string join_tokens(const std::vector<Token>& tokens, TokenSpan span);

}  // namespace mfa::msl
