// SHA-256 (FIPS 180-4), for content-addressed cache keys.
#pragma once

#include <string>
#include <string_view>

namespace mfa {

// The digest of `data` as 64 lowercase hex digits.
std::string sha256_hex(std::string_view data);

}  // namespace mfa
