#include "json.hpp"

#include <cmath>
#include <limits>
#include <locale>
#include <sstream>

namespace mfa::json {

namespace {

const char* kind_name(Value::Kind kind) {
  switch (kind) {
    case Value::Kind::null: return "null";
    case Value::Kind::boolean: return "a boolean";
    case Value::Kind::number: return "a number";
    case Value::Kind::string: return "a string";
    case Value::Kind::array: return "an array";
    case Value::Kind::object: return "an object";
  }
  return "?";
}

[[noreturn]] void wrong_kind(const char* what, Value::Kind want, Value::Kind got) {
  throw JsonError(std::string(what) + " must be " + kind_name(want) + ", got " + kind_name(got));
}

}  // namespace

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Value document() {
    Value value = parse_value(0);
    skip_space();
    if (at_ != text_.size()) fail("text after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw JsonError("JSON: " + what + " at byte " + std::to_string(at_));
  }
  void skip_space() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\t' || text_[at_] == '\n' || text_[at_] == '\r'))
      ++at_;
  }
  char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  void expect(char c) {
    if (peek() != c || at_ >= text_.size()) fail(std::string("expected '") + c + "'");
    ++at_;
  }
  void literal(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) fail("unexpected token");
    at_ += word.size();
  }

  Value parse_value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    skip_space();
    Value value;
    if (at_ >= text_.size()) fail("unexpected end");
    const char c = text_[at_];
    if (c == '{') {
      value.kind_ = Value::Kind::object;
      ++at_;
      skip_space();
      if (peek() == '}') { ++at_; return value; }
      for (;;) {
        skip_space();
        std::string key = parse_string();
        skip_space();
        expect(':');
        value.object_.emplace_back(std::move(key), parse_value(depth + 1));
        skip_space();
        if (peek() == ',') { ++at_; continue; }
        expect('}');
        return value;
      }
    }
    if (c == '[') {
      value.kind_ = Value::Kind::array;
      ++at_;
      skip_space();
      if (peek() == ']') { ++at_; return value; }
      for (;;) {
        value.array_.push_back(parse_value(depth + 1));
        skip_space();
        if (peek() == ',') { ++at_; continue; }
        expect(']');
        return value;
      }
    }
    if (c == '"') {
      value.kind_ = Value::Kind::string;
      value.string_ = parse_string();
      return value;
    }
    if (c == 't') { literal("true"); value.kind_ = Value::Kind::boolean; value.boolean_ = true; return value; }
    if (c == 'f') { literal("false"); value.kind_ = Value::Kind::boolean; return value; }
    if (c == 'n') { literal("null"); return value; }
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
    fail("unexpected character");
  }

  static bool digit(char c) { return c >= '0' && c <= '9'; }

  Value parse_number() {
    const std::size_t begin = at_;
    if (peek() == '-') ++at_;
    if (peek() == '0') ++at_;
    else if (digit(peek())) while (digit(peek())) ++at_;
    else fail("bad number");
    bool integral = true;
    if (peek() == '.') {
      integral = false;
      ++at_;
      if (!digit(peek())) fail("bad number");
      while (digit(peek())) ++at_;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      ++at_;
      if (peek() == '+' || peek() == '-') ++at_;
      if (!digit(peek())) fail("bad number");
      while (digit(peek())) ++at_;
    }
    const std::string token(text_.substr(begin, at_ - begin));
    Value value;
    value.kind_ = Value::Kind::number;
    if (integral) {
      // Exact int64, or (too long) a double only.
      std::int64_t n = 0;
      bool fits = true;
      const bool negative = token[0] == '-';
      for (std::size_t i = negative ? 1 : 0; i < token.size(); ++i) {
        const int d = token[i] - '0';
        if (n > (std::numeric_limits<std::int64_t>::max() - d) / 10) { fits = false; break; }
        n = n * 10 + d;
      }
      if (fits) {
        value.integral_ = true;
        value.integer_ = negative ? -n : n;
        value.number_ = double(value.integer_);
        return value;
      }
    }
    std::istringstream in(token);
    in.imbue(std::locale::classic());  // the embedder's locale never changes what "0.5" means
    in >> value.number_;
    if (in.fail()) fail("number out of range");
    return value;
  }

  void append_utf8(std::string& out, std::uint32_t code) {
    if (code < 0x80) out += char(code);
    else if (code < 0x800) { out += char(0xC0 | (code >> 6)); out += char(0x80 | (code & 0x3F)); }
    else if (code < 0x10000) {
      out += char(0xE0 | (code >> 12)); out += char(0x80 | ((code >> 6) & 0x3F)); out += char(0x80 | (code & 0x3F));
    } else {
      out += char(0xF0 | (code >> 18)); out += char(0x80 | ((code >> 12) & 0x3F));
      out += char(0x80 | ((code >> 6) & 0x3F)); out += char(0x80 | (code & 0x3F));
    }
  }

  std::uint32_t hex4() {
    if (at_ + 4 > text_.size()) fail("short \\u escape");
    std::uint32_t code = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[at_++];
      code <<= 4;
      if (digit(c)) code |= std::uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f') code |= std::uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') code |= std::uint32_t(c - 'A' + 10);
      else fail("bad \\u escape");
    }
    return code;
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    for (;;) {
      if (at_ >= text_.size()) fail("unterminated string");
      const char c = text_[at_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') { out += c; continue; }
      if (at_ >= text_.size()) fail("unterminated string");
      const char e = text_[at_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t code = hex4();
          if (code >= 0xD800 && code < 0xDC00) {
            if (text_.substr(at_, 2) != "\\u") fail("lone surrogate");
            at_ += 2;
            const std::uint32_t low = hex4();
            if (low < 0xDC00 || low >= 0xE000) fail("bad surrogate pair");
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          } else if (code >= 0xDC00 && code < 0xE000) {
            fail("lone surrogate");
          }
          append_utf8(out, code);
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  std::string_view text_;
  std::size_t at_ = 0;
};

bool Value::as_bool(const char* what) const {
  if (kind_ != Kind::boolean) wrong_kind(what, Kind::boolean, kind_);
  return boolean_;
}
double Value::as_double(const char* what) const {
  if (kind_ != Kind::number) wrong_kind(what, Kind::number, kind_);
  return number_;
}
std::int64_t Value::as_int(const char* what) const {
  if (kind_ != Kind::number) wrong_kind(what, Kind::number, kind_);
  if (!integral_) throw JsonError(std::string(what) + " must be an integer");
  return integer_;
}
const std::string& Value::as_string(const char* what) const {
  if (kind_ != Kind::string) wrong_kind(what, Kind::string, kind_);
  return string_;
}
const std::vector<Value>& Value::as_array(const char* what) const {
  if (kind_ != Kind::array) wrong_kind(what, Kind::array, kind_);
  return array_;
}
const std::vector<std::pair<std::string, Value>>& Value::as_object(const char* what) const {
  if (kind_ != Kind::object) wrong_kind(what, Kind::object, kind_);
  return object_;
}
const Value* Value::find(const std::string& key) const {
  for (const auto& [name, value] : as_object("a JSON value with members"))
    if (name == key) return &value;
  return nullptr;
}
const Value& Value::at(const std::string& key) const {
  const Value* value = find(key);
  if (!value) throw JsonError("missing member '" + key + "'");
  return *value;
}

Value parse(std::string_view text) { return Parser(text).document(); }

}  // namespace mfa::json
