#include "core/msl_lexer.hpp"

#include <array>
#include <cctype>

#include "mfa/errors.hpp"

namespace mfa::msl {
namespace {

// Multi-character punctuators, longest first so the first match is the longest.
constexpr std::array<std::string_view, 21> kPunctuators = {
    "<<=", "...", "::", "->", "++", "--", "<<", "<=", ">=", "==", "!=",
    "&&",  "||",  "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^="};

bool is_identifier_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool is_identifier_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
bool is_digit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& file_name)
      : source_(source), file_name_(file_name) {}

  std::vector<Token> run() {
    while (skip_space_and_comments()) {
      std::size_t start = pos_;
      int line = line_;
      TokenKind kind = read_token();
      tokens_.push_back({kind, source_.substr(start, pos_ - start), line, start});
    }
    return std::move(tokens_);
  }

 private:
  char peek(std::size_t ahead = 0) const {
    return pos_ + ahead < source_.size() ? source_[pos_ + ahead] : '\0';
  }

  [[noreturn]] void fail(int line, const std::string& what) const {
    throw CompileError(file_name_ + ":" + std::to_string(line) + ": " + what, "");
  }

  // Advances one character, counting lines.
  void advance() {
    if (source_[pos_] == '\n') {
      ++line_;
      at_line_start_ = true;
    }
    ++pos_;
  }

  // Skips a /* */ comment starting at pos_.
  void skip_block_comment() {
    int line = line_;
    std::size_t close = source_.find("*/", pos_ + 2);
    if (close == std::string_view::npos) fail(line, "unterminated /* comment");
    while (pos_ < close + 2) advance();
  }

  // Returns false at the end of the source.
  bool skip_space_and_comments() {
    while (pos_ < source_.size()) {
      char c = peek();
      if (c == '/' && peek(1) == '/') {
        while (pos_ < source_.size() && peek() != '\n') ++pos_;
      } else if (c == '/' && peek(1) == '*') {
        bool line_start = at_line_start_;
        skip_block_comment();
        at_line_start_ = at_line_start_ || line_start;
      } else if (std::isspace(static_cast<unsigned char>(c))) {
        advance();
      } else {
        return true;
      }
    }
    return false;
  }

  TokenKind read_token() {
    bool line_start = at_line_start_;
    at_line_start_ = false;
    char c = peek();
    if (c == '#' && line_start) return read_directive();
    if (is_identifier_start(c)) {
      while (is_identifier_char(peek())) ++pos_;
      return TokenKind::identifier;
    }
    if (is_digit(c) || (c == '.' && is_digit(peek(1)))) return read_number();
    if (c == '"' || c == '\'') return read_quoted(c);
    return read_punctuation();
  }

  // A directive runs to the first newline not escaped by a backslash; block
  // comments inside it may span lines.
  TokenKind read_directive() {
    while (pos_ < source_.size() && peek() != '\n') {
      if (peek() == '\\' && peek(1) == '\n') {
        advance();
        advance();
      } else if (peek() == '/' && peek(1) == '*') {
        skip_block_comment();
      } else {
        ++pos_;
      }
    }
    return TokenKind::preprocessor;
  }

  // A pp-number: digits, letters, '.', and a sign right after an exponent mark.
  TokenKind read_number() {
    while (true) {
      char c = peek();
      if ((c == '+' || c == '-') && pos_ > 0 && std::string_view("eEpP").find(source_[pos_ - 1]) != std::string_view::npos) {
        ++pos_;
      } else if (is_identifier_char(c) || c == '.') {
        ++pos_;
      } else {
        return TokenKind::number;
      }
    }
  }

  TokenKind read_quoted(char quote) {
    int line = line_;
    ++pos_;
    while (true) {
      char c = peek();
      if (pos_ >= source_.size() || c == '\n') {
        fail(line, quote == '"' ? "unterminated string literal" : "unterminated character literal");
      }
      ++pos_;
      if (c == '\\' && pos_ < source_.size()) advance();
      if (c == quote) return quote == '"' ? TokenKind::string : TokenKind::character;
    }
  }

  TokenKind read_punctuation() {
    std::string_view rest = source_.substr(pos_);
    if (rest.substr(0, 2) == "[[") {
      attribute_nesting_.push_back(0);
      pos_ += 2;
      return TokenKind::punctuation;
    }
    if (rest.substr(0, 2) == "]]" && !attribute_nesting_.empty() && attribute_nesting_.back() == 0) {
      attribute_nesting_.pop_back();
      pos_ += 2;
      return TokenKind::punctuation;
    }
    for (std::string_view p : kPunctuators) {
      if (rest.substr(0, p.size()) == p) {
        pos_ += p.size();
        return TokenKind::punctuation;
      }
    }
    char c = peek();
    if (std::string_view("{}()[];,.<>+-*/%&|^!~=?:#").find(c) == std::string_view::npos) {
      fail(line_, std::string("unexpected character '") + c + "'");
    }
    if (!attribute_nesting_.empty()) {
      if (c == '[') ++attribute_nesting_.back();
      if (c == ']' && attribute_nesting_.back() > 0) --attribute_nesting_.back();
    }
    ++pos_;
    return TokenKind::punctuation;
  }

  std::string_view source_;
  const std::string& file_name_;
  std::size_t pos_ = 0;
  int line_ = 1;
  bool at_line_start_ = true;
  std::vector<int> attribute_nesting_;  // per open [[: single '[' opened inside it
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(std::string_view source, const std::string& file_name) {
  return Lexer(source, file_name).run();
}

}  // namespace mfa::msl
