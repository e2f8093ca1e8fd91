// A score_mod's canonical text as the C++ core reads it
// (python/mfa_native/codegen/attention/score_expression.py): terms
// `dtype op[value](args)` joined by "; ". The core only checks the text and
// finds the tensors it reads; a bundle entry bakes the text itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mfa::score_expression {

// A captured tensor an expression reads: its index (as Python prints the int: `number`; `tensor`
// its value, capped at INT64_MAX) and its axis count.
struct Read {
  std::string number;
  std::int64_t tensor = 0;
  std::size_t axes = 0;
};

// The captured tensors `text` reads, in the order of a Python dict (first read first, the last
// count kept). ArgumentError with parse's message for the
// first part that is off the grammar, names an operation not in `operations` (the
// declaration's score_operations: name -> operand count, -1 any), reads a tensor without an
// index, reads a term not before it, or gives its operation another count of operands.
std::vector<Read> reads(const std::string& text, const std::map<std::string, int>& operations);

}  // namespace mfa::score_expression
