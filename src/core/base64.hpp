// Base64 (RFC 4648, the standard alphabet with '=' padding), as Python's
// base64.b64encode writes it: the bundle's compiled libraries are stored so.
#pragma once

#include <optional>
#include <string_view>
#include <vector>

namespace mfa {

// The bytes `text` encodes, or nullopt when it is not canonical padded base64
// (a length that is not a multiple of 4, a character outside the alphabet,
// padding anywhere but at the end, or bits set below the padding).
std::optional<std::vector<unsigned char>> base64_decode(std::string_view text);

}  // namespace mfa
