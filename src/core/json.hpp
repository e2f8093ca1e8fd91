// A minimal JSON reader for the bundle payload: the whole text into a tree of
// values. Strict (RFC 8259): no comments, no trailing commas, nesting at most
// kMaxDepth deep, \u escapes (with surrogate pairs) to UTF-8. Throws JsonError
// with the byte offset of the problem; never reads past the text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mfa/errors.hpp"

namespace mfa::json {

class JsonError : public Error {
 public:
  using Error::Error;
};

constexpr int kMaxDepth = 64;

class Value {
 public:
  enum class Kind { null, boolean, number, string, array, object };

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::null; }

  // Each accessor throws JsonError naming `what` when the value is of another kind.
  bool as_bool(const char* what) const;
  double as_double(const char* what) const;
  // An integral number within int64 (JSON numbers written without fraction or exponent).
  std::int64_t as_int(const char* what) const;
  const std::string& as_string(const char* what) const;
  const std::vector<Value>& as_array(const char* what) const;
  const std::vector<std::pair<std::string, Value>>& as_object(const char* what) const;

  // The member `key` of an object, or nullptr when absent (JsonError if not an object).
  const Value* find(const std::string& key) const;
  // The member `key`; JsonError when absent.
  const Value& at(const std::string& key) const;

 private:
  friend class Parser;
  Kind kind_ = Kind::null;
  bool boolean_ = false;
  bool integral_ = false;
  std::int64_t integer_ = 0;
  double number_ = 0;
  std::string string_;
  std::vector<Value> array_;
  std::vector<std::pair<std::string, Value>> object_;
};

Value parse(std::string_view text);

}  // namespace mfa::json
