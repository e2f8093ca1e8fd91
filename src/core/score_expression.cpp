#include "score_expression.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "mfa/errors.hpp"

namespace mfa::score_expression {

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_word(char c) { return is_digit(c) || c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// A run of at least one digit at `at`: its end, or `at` when there is none.
std::size_t digits_end(const std::string& s, std::size_t at) {
  while (at < s.size() && is_digit(s[at])) ++at;
  return at;
}

// Whether `s` is whole digits: -?\d+.
bool is_integer(const std::string& s) {
  const std::size_t start = !s.empty() && s[0] == '-' ? 1 : 0;
  return s.size() > start && digits_end(s, start) == s.size();
}

// A float as Python's repr prints it: -?(\d+\.\d*(e[+-]\d+)?|\d+e[+-]\d+|inf), or nan.
bool is_float_repr(const std::string& s) {
  if (s == "nan") return true;
  std::size_t at = !s.empty() && s[0] == '-' ? 1 : 0;
  if (s.compare(at, std::string::npos, "inf") == 0) return true;
  const std::size_t whole = digits_end(s, at);
  if (whole == at) return false;
  at = whole;
  const bool point = at < s.size() && s[at] == '.';
  if (point) at = digits_end(s, at + 1);
  if (at == s.size()) return point;
  if (s[at] != 'e' || at + 1 == s.size() || (s[at + 1] != '+' && s[at + 1] != '-')) return false;
  const std::size_t exponent = digits_end(s, at + 2);
  return exponent > at + 2 && exponent == s.size();
}

// A term's value: True, False, an integer or a float's repr.
bool is_value(const std::string& s) { return s == "True" || s == "False" || is_integer(s) || is_float_repr(s); }

// Whole digits as Python's int() prints them (no leading zeros).
std::string int_text(const std::string& digits) {
  const std::size_t first = digits.find_first_not_of('0');
  return first == std::string::npos ? "0" : digits.substr(first);
}

// Whole digits' value, capped at INT64_MAX.
std::int64_t capped(const std::string& digits) {
  const std::string text = int_text(digits);
  return text.size() > 18 ? INT64_MAX : std::stoll(text);
}

struct Term {
  std::string op, value;
  bool has_value = false;
  std::vector<std::int64_t> args;  // capped
};

// `part` as a term of the grammar (parse's _TERM), or false.
bool parse_term(const std::string& part, Term& term) {
  std::size_t at = part.find(' ');
  if (at == std::string::npos) return false;
  const std::string dtype = part.substr(0, at);
  if (dtype != "float" && dtype != "int" && dtype != "bool") return false;
  const std::size_t op_start = ++at;
  while (at < part.size() && is_word(part[at])) ++at;
  if (at == op_start) return false;
  term.op = part.substr(op_start, at - op_start);
  if (at < part.size() && part[at] == '[') {
    const std::size_t close = part.find(']', at);
    if (close == std::string::npos) return false;
    term.value = part.substr(at + 1, close - at - 1);
    term.has_value = true;
    if (!is_value(term.value)) return false;
    at = close + 1;
  }
  if (at >= part.size() || part[at] != '(' || part.back() != ')') return false;
  const std::string args = part.substr(at + 1, part.size() - at - 2);
  for (std::size_t start = 0; !args.empty() && start <= args.size();) {
    const std::size_t end = digits_end(args, start);
    if (end == start || (end < args.size() && args[end] != ',')) return false;
    term.args.push_back(capped(args.substr(start, end - start)));
    start = end + 1;
  }
  return true;
}

// A str as Python's repr prints it (ASCII escapes; other bytes as they are).
std::string python_repr(const std::string& s) {
  const char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (const char c : s) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\\' || c == quote) out += std::string("\\") + c;
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (byte < 0x20 || byte == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + quote;
}

}  // namespace

std::vector<Read> reads(const std::string& text, const std::map<std::string, int>& operations) {
  std::vector<Read> out;
  std::size_t start = 0;
  for (std::int64_t index = 0; start <= text.size(); ++index) {
    std::size_t end = text.find("; ", start);
    if (end == std::string::npos) end = text.size();
    const std::string part = text.substr(start, end - start);
    Term term;
    const bool known = parse_term(part, term) && operations.count(term.op);
    const bool indexed = term.has_value && !term.value.empty() && digits_end(term.value, 0) == term.value.size();
    if (!known || (term.op == "read" && !indexed))
      throw ArgumentError("score_mod: term " + std::to_string(index) + " of the expression text is not a term: " +
                          python_repr(part));
    if (std::any_of(term.args.begin(), term.args.end(), [&](std::int64_t a) { return a >= index; }))
      throw ArgumentError("score_mod: term " + std::to_string(index) + " (" + python_repr(part) +
                          ") reads a term not before it");
    const int arity = operations.at(term.op);
    if (arity >= 0 && term.args.size() != std::size_t(arity))
      throw ArgumentError("score_mod: term " + std::to_string(index) + " (" + python_repr(part) + ") gives " +
                          term.op + " " + std::to_string(term.args.size()) + " operands; it takes " +
                          std::to_string(arity));
    if (term.op == "read") {
      const std::string number = int_text(term.value);
      auto seen = std::find_if(out.begin(), out.end(), [&](const Read& r) { return r.number == number; });
      if (seen == out.end()) out.push_back({number, capped(term.value), term.args.size()});
      else seen->axes = term.args.size();
    }
    start = end + 2;
  }
  return out;
}

}  // namespace mfa::score_expression
