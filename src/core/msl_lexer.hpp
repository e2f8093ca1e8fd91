// Tokens of Metal Shading Language source, for the signature reflection and
// the cpu backend's rewriting. Comments are skipped; a preprocessor directive
// (with its continuation lines) is one token. Tokens view the source text,
// which must outlive them.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace mfa::msl {

enum class TokenKind { identifier, number, string, character, punctuation, preprocessor };

struct Token {
  TokenKind kind;
  std::string_view text;  // the token's characters in the source
  int line;               // 1-based line of its first character
  std::size_t offset;     // byte offset of its first character

  std::size_t end() const { return offset + text.size(); }
  bool is(std::string_view s) const {
    return text == s && kind != TokenKind::string && kind != TokenKind::character;
  }
};

// Splits `source` into tokens. `[[` opens an attribute and `]]` is one token
// only where it closes one, so `a[b[i]]` stays two `]`. A `>` never merges
// with a following `>` (template argument lists close one at a time; a shift
// reads as two tokens, which nothing here needs to tell apart). Throws
// CompileError "<file_name>:LINE: ..." for unterminated comments, strings and
// characters that cannot start a token.
std::vector<Token> lex(std::string_view source, const std::string& file_name);

}  // namespace mfa::msl
