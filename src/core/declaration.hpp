// An op's declaration as the C++ core reads it from a bundle: the plain-data
// rules of its array arguments and outputs and its size checks, written by
// python/mfa_native/ops/rules.py (Op.declaration_data). The binder
// (binder.hpp) checks a call against it; messages are the declaration's
// templates ({q.shape}, {q.dtype}, {q.axes}, {q.expected}, a content check's
// {q.index}, {q.value}, ..., {layout}, {Hq}, and the texts a call gives, as
// {format}).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "json.hpp"
#include "size_expression.hpp"
#include "view_packing.hpp"

namespace mfa {

struct SizeRequirement {
  SizeExpression check;
  std::string message;
  bool type_error = false;  // TypeError rather than ArgumentError (Python's ValueError)
};

// A check of an int32 array's values, read on every call (rules.Content): its kind (rules.CONTENTS:
// "nonnegative", "first", "last", "nondecreasing", "fits", "within", "pages"), the bound a
// bounded kind compares with, the condition under which it applies (none: always), the
// Lengths a kind reading lengths reads (by name), and the rows a "pages" table's entry holds.
struct ContentCheck {
  std::string kind;
  std::string message;
  std::optional<SizeExpression> bound, when;
  std::string lengths;
  std::optional<SizeExpression> page;
  // Whether it reads the array's entries ("fits" reads only the lengths).
  bool reads_entries() const { return kind != "fits"; }
};

// Per-row counts content checks read (rules.Lengths): the entries of the first of `sources` the
// call gives (an array, or its steps: entry i + 1 less entry i), plus array `plus`'s entries
// where it names one, plus `offset`; else `fill` for each of `rows` rows (no fill: the checks
// reading them are skipped).
struct LengthsRule {
  std::vector<std::pair<std::string, bool>> sources;  // (array, steps)
  SizeExpression offset;
  std::string plus;
  std::optional<SizeExpression> fill, rows;
};

struct ArrayRule {
  std::string name;     // as the C++ API and the C ABI call it
  std::string buffer;   // the pass buffer it binds
  bool output = false;  // an output the caller gives (role "output")
  bool optional = false;
  std::vector<std::string> dtypes;  // allowed dtype names; empty: dtype_of's
  std::string dtype_of;             // "" or the array whose dtype it must have
  std::vector<std::vector<SizeExpression>> shapes;  // alternatives, logical order
  std::vector<std::string> axes;    // the first shape's texts (size names), logical order
  bool leading = false;             // its shapes start with the call's leading axes ("...": any number)
  bool layout = false;              // the layout option orders its axes
  bool binds = false;               // its extents bind the size names
  bool broadcast = false;
  bool written = false;             // written in place: it must be contiguous
  view_packing::Reads reads = view_packing::Reads::strided;  // how the kernels address it
  std::vector<std::string> stride_axes;  // its runtime strides' names by logical axis; empty: batch, head, row, key
  std::vector<std::pair<std::string, std::string>> needs;  // the arguments it may be given only with, and messages
  bool expands = false;             // bound as its first shape (an axis of extent 1 read with stride 0)
  bool own = false;                 // the op's own: checked after the arrays it shares with attention
  bool each = false;                // the rule of each element of a list argument, given as {name}[i]
  std::string unlike_error;         // a list's: an element after the first unlike the first (ArgumentError)
  std::vector<SizeRequirement> requires_;  // once it is checked (the sizes it binds included)
  std::vector<ContentCheck> contents;
  bool dtype_value_error = false;   // a dtype outside its set raises ArgumentError (Python's ValueError), not TypeError
  std::string dtype_error, rank_error, shape_error;
};

struct Declaration {
  std::string op;
  std::vector<ArrayRule> arrays;                    // declaration order
  std::vector<SizeRequirement> requires_;           // in order
  std::vector<std::pair<std::string, SizeExpression>> derived;
  std::map<std::string, LengthsRule> lengths;       // by name
  std::map<std::string, std::vector<std::size_t>> layouts;  // layout -> the logical axis of each memory axis
  // A score_mod's operations and their operand counts (-1: any); none: the op takes no score_mod.
  std::map<std::string, int> score_operations;

  // The rule of array `name`, or of the list whose element it is (outputs[1]: outputs').
  const ArrayRule& rule(const std::string& name) const;
  static Declaration from_json(const json::Value& value);
};

}  // namespace mfa
