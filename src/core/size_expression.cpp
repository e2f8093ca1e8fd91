#include "size_expression.hpp"

#include <cctype>
#include <limits>

namespace mfa {

struct SizeExpression::Node {
  enum class Op { literal, name, neg, logical_not, binary, call };
  Op op = Op::literal;
  std::int64_t value = 0;
  std::string name;                        // the name, operator or function
  std::vector<std::shared_ptr<const Node>> args;
};

namespace {

using Node = SizeExpression::Node;
using NodePtr = std::shared_ptr<const Node>;

// Binary operators by precedence, loosest first (as in expressions.py).
const std::vector<std::vector<std::string>> kBinary = {
    {"||"}, {"&&"}, {"==", "!="}, {"<", "<=", ">", ">="}, {"+", "-"}, {"*", "/", "%"}};

bool name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

class Parser {
 public:
  explicit Parser(const std::string& text) : text_(text) { tokenize(); }

  NodePtr parse() {
    NodePtr node = binary(0);
    if (at_ < tokens_.size()) fail("unexpected '" + tokens_[at_] + "'");
    return node;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw ArgumentError("size expression '" + text_ + "': " + what);
  }

  void tokenize() {
    std::size_t i = 0;
    while (i < text_.size()) {
      const char c = text_[i];
      if (std::isspace(static_cast<unsigned char>(c))) {
        ++i;
      } else if (name_char(c)) {
        std::size_t j = i;
        while (j < text_.size() && name_char(text_[j])) ++j;
        tokens_.push_back(text_.substr(i, j - i));
        i = j;
      } else if (i + 1 < text_.size() && (text_.compare(i, 2, "||") == 0 || text_.compare(i, 2, "&&") == 0 ||
                                          text_.compare(i, 2, "==") == 0 || text_.compare(i, 2, "!=") == 0 ||
                                          text_.compare(i, 2, "<=") == 0 || text_.compare(i, 2, ">=") == 0)) {
        tokens_.push_back(text_.substr(i, 2));
        i += 2;
      } else if (std::string("+-*/%<>!(),").find(c) != std::string::npos) {
        tokens_.push_back(std::string(1, c));
        ++i;
      } else {
        fail(std::string("unexpected '") + c + "'");
      }
    }
  }

  const std::string* peek() const { return at_ < tokens_.size() ? &tokens_[at_] : nullptr; }
  std::string take(const char* expected = nullptr) {
    const std::string* token = peek();
    if (!token || (expected && *token != expected))
      fail(std::string("expected ") + (expected ? expected : "more") + ", got " + (token ? "'" + *token + "'" : "the end"));
    ++at_;
    return *token;
  }

  static bool in(const std::string* token, const std::vector<std::string>& options) {
    if (!token) return false;
    for (const std::string& option : options)
      if (*token == option) return true;
    return false;
  }

  NodePtr binary(std::size_t level) {
    if (level == kBinary.size()) return unary();
    NodePtr node = binary(level + 1);
    while (in(peek(), kBinary[level])) {
      auto parent = std::make_shared<Node>();
      parent->op = Node::Op::binary;
      parent->name = take();
      parent->args = {node, binary(level + 1)};
      node = parent;
    }
    return node;
  }

  NodePtr unary() {
    if (in(peek(), {"!", "-"})) {
      auto node = std::make_shared<Node>();
      node->op = take() == "-" ? Node::Op::neg : Node::Op::logical_not;
      node->args = {unary()};
      return node;
    }
    return primary();
  }

  NodePtr primary() {
    const std::string token = take();
    if (token == "(") {
      NodePtr node = binary(0);
      take(")");
      return node;
    }
    auto node = std::make_shared<Node>();
    bool digits = true;
    for (char c : token) digits = digits && std::isdigit(static_cast<unsigned char>(c));
    if (digits) {
      std::int64_t value = 0;
      for (char c : token) {
        const int d = c - '0';
        if (value > (std::numeric_limits<std::int64_t>::max() - d) / 10) fail("literal " + token + " is too large");
        value = value * 10 + d;
      }
      node->value = value;
      return node;
    }
    if (!(std::isalpha(static_cast<unsigned char>(token[0])) || token[0] == '_')) fail("unexpected '" + token + "'");
    node->name = token;
    if (!peek() || *peek() != "(") {
      node->op = Node::Op::name;
      return node;
    }
    take("(");
    node->op = Node::Op::call;
    node->args.push_back(binary(0));
    while (peek() && *peek() == ",") {
      take(",");
      node->args.push_back(binary(0));
    }
    take(")");
    const std::size_t n = node->args.size();
    const bool known = ((token == "min" || token == "max") && n >= 1) || (token == "cdiv" && n == 2);
    if (!known) fail("unknown function or arity " + token + "/" + std::to_string(n));
    return node;
  }

  std::string text_;
  std::vector<std::string> tokens_;
  std::size_t at_ = 0;
};

[[noreturn]] void overflow(const std::string& text) {
  throw ArgumentError("size expression '" + text + "' overflows 64-bit integers");
}

std::int64_t floor_div(std::int64_t a, std::int64_t b) {  // b > 0
  std::int64_t q = a / b;
  if (a % b != 0 && a < 0) --q;
  return q;
}

std::int64_t value_of(const Node& node, const SizeEnv& env, const std::string& text) {
  switch (node.op) {
    case Node::Op::literal: return node.value;
    case Node::Op::name: {
      auto it = env.find(node.name);
      if (it == env.end()) throw ArgumentError("size '" + node.name + "' is not given");
      return it->second;
    }
    case Node::Op::neg: {
      const std::int64_t v = value_of(*node.args[0], env, text);
      if (v == std::numeric_limits<std::int64_t>::min()) overflow(text);
      return -v;
    }
    case Node::Op::logical_not: return value_of(*node.args[0], env, text) == 0 ? 1 : 0;
    case Node::Op::binary: {
      const std::string& op = node.name;
      const std::int64_t a = value_of(*node.args[0], env, text);
      if (op == "&&") return a != 0 && value_of(*node.args[1], env, text) != 0 ? 1 : 0;
      if (op == "||") return a != 0 || value_of(*node.args[1], env, text) != 0 ? 1 : 0;
      const std::int64_t b = value_of(*node.args[1], env, text);
      std::int64_t r = 0;
      if (op == "+") { if (__builtin_add_overflow(a, b, &r)) overflow(text); return r; }
      if (op == "-") { if (__builtin_sub_overflow(a, b, &r)) overflow(text); return r; }
      if (op == "*") { if (__builtin_mul_overflow(a, b, &r)) overflow(text); return r; }
      if (op == "/" || op == "%") {
        if (b <= 0) throw ArgumentError("size expression divides by " + std::to_string(b));
        const std::int64_t q = floor_div(a, b);
        return op == "/" ? q : a - q * b;
      }
      if (op == "==") return a == b;
      if (op == "!=") return a != b;
      if (op == "<") return a < b;
      if (op == "<=") return a <= b;
      if (op == ">") return a > b;
      if (op == ">=") return a >= b;
      break;
    }
    case Node::Op::call: {
      std::vector<std::int64_t> values;
      for (const NodePtr& arg : node.args) values.push_back(value_of(*arg, env, text));
      if (node.name == "cdiv") {
        if (values[1] <= 0) throw ArgumentError("size expression divides by " + std::to_string(values[1]));
        if (values[0] == std::numeric_limits<std::int64_t>::min()) overflow(text);
        return -floor_div(-values[0], values[1]);
      }
      std::int64_t best = values[0];
      for (std::int64_t v : values) best = node.name == "min" ? std::min(best, v) : std::max(best, v);
      return best;
    }
  }
  throw ArgumentError("size expression '" + text + "': bad node");
}

}  // namespace

SizeExpression::SizeExpression(const std::string& text) : text_(text), root_(Parser(text).parse()) {}

std::int64_t SizeExpression::evaluate(const SizeEnv& env) const { return value_of(*root_, env, text_); }

std::int64_t evaluate_size(const std::string& text, const SizeEnv& env) { return SizeExpression(text).evaluate(env); }

}  // namespace mfa
