#include "compiler_names.hpp"

namespace mfa::cpu {
namespace {

constexpr std::size_t kMaxVersionDigits = 6;  // longer numbers are not versions (and would overflow int)

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// The length of the run of digits at the start of `text`.
std::size_t digits_at(std::string_view text) {
  std::size_t n = 0;
  while (n < text.size() && is_digit(text[n])) ++n;
  return n;
}

int to_int(std::string_view digits) {
  int value = 0;
  for (char c : digits) value = value * 10 + (c - '0');
  return value;
}

bool starts_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

}  // namespace

std::optional<CompilerName> parse_compiler_name(std::string_view file_name) {
  CompilerName name{};
  std::string_view rest;
  if (starts_with(file_name, "g++")) {
    name.family = CompilerFamily::gcc;
    rest = file_name.substr(3);
  } else if (starts_with(file_name, "clang++")) {
    name.family = CompilerFamily::clang;
    rest = file_name.substr(7);
  } else {
    return std::nullopt;
  }
  if (rest.empty()) return name;
  if (rest[0] != '-') return std::nullopt;
  std::string_view digits = rest.substr(1);
  std::size_t n = digits_at(digits);
  if (n == 0 || n != digits.size() || n > kMaxVersionDigits) return std::nullopt;
  name.version = to_int(digits);
  return name;
}

int first_major_version(std::string_view text) {
  for (std::size_t at = 0; at < text.size();) {
    std::size_t n = digits_at(text.substr(at));
    if (n == 0) {
      ++at;
      continue;
    }
    std::size_t after = at + n;
    if (n <= kMaxVersionDigits && after + 1 < text.size() && text[after] == '.' && is_digit(text[after + 1])) {
      return to_int(text.substr(at, n));
    }
    at = after;
  }
  return 0;
}

}  // namespace mfa::cpu
