#include "base64.hpp"

#include <cstdint>

namespace mfa {

namespace {

// The 6-bit value of an alphabet character, or -1.
int sextet(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

}  // namespace

std::optional<std::vector<unsigned char>> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) return std::nullopt;
  std::size_t padding = 0;
  while (padding < 2 && padding < text.size() && text[text.size() - 1 - padding] == '=') ++padding;
  const std::string_view body = text.substr(0, text.size() - padding);
  std::vector<unsigned char> bytes;
  bytes.reserve(body.size() * 3 / 4);
  std::uint32_t bits = 0;
  int held = 0;
  for (char c : body) {
    const int value = sextet(c);
    if (value < 0) return std::nullopt;
    bits = (bits << 6) | std::uint32_t(value);
    held += 6;
    if (held >= 8) {
      held -= 8;
      bytes.push_back(static_cast<unsigned char>((bits >> held) & 0xFF));
    }
  }
  if ((bits & ((1u << held) - 1)) != 0) return std::nullopt;  // a second encoding of the same bytes
  return bytes;
}

}  // namespace mfa
