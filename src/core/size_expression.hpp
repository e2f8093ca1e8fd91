// Size expressions: the small integer language of pass templates, the C++ twin
// of python/mfa_native/runtime/expressions.py (the same text gives the same
// value). Integer literals, names, + - * / % (division and remainder of a
// divisor > 0, rounding down), == != < <= > >= && || ! (1 or 0), unary minus,
// parentheses, min(a, ...), max(a, ...), cdiv(a, b). Values are int64; a step
// that overflows throws (Python's integers would not overflow, so no template
// relies on it).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mfa/errors.hpp"

namespace mfa {

using SizeEnv = std::map<std::string, std::int64_t>;

class SizeExpression {
 public:
  // Parses `text`; throws ArgumentError naming the expression and the problem.
  explicit SizeExpression(const std::string& text);

  // The value for `env`; ArgumentError for a name not given, a divisor <= 0 or an overflow.
  std::int64_t evaluate(const SizeEnv& env) const;
  const std::string& text() const { return text_; }

  struct Node;

 private:
  std::string text_;
  std::shared_ptr<const Node> root_;
};

// Parses and evaluates in one step.
std::int64_t evaluate_size(const std::string& text, const SizeEnv& env);

}  // namespace mfa
