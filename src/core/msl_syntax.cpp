#include "core/msl_syntax.hpp"

#include <cstdlib>
#include <map>
#include <utility>

#include "mfa/errors.hpp"

namespace mfa::msl {
namespace {

constexpr int kMaxBindingIndex = 30;  // [[buffer(0..30)]], [[threadgroup(0..30)]], as in Metal

// Builtins Metal passes to kernels. A `grid` builtin has one value per axis
// and may be declared as a scalar (x only) or a 2- or 3-vector; the others
// are one number.
struct BuiltinKind {
  std::string_view name;
  bool grid;
};
constexpr BuiltinKind kBuiltins[] = {
    {"thread_position_in_grid", true},         {"thread_position_in_threadgroup", true},
    {"threadgroup_position_in_grid", true},    {"threads_per_threadgroup", true},
    {"threadgroups_per_grid", true},           {"threads_per_grid", true},
    {"thread_index_in_threadgroup", false},    {"thread_index_in_simdgroup", false},
    {"simdgroup_index_in_threadgroup", false}, {"threads_per_simdgroup", false},
    {"simdgroups_per_threadgroup", false},     {"thread_execution_width", false},
};

const BuiltinKind* find_builtin(std::string_view name) {
  for (const BuiltinKind& builtin : kBuiltins) {
    if (builtin.name == name) return &builtin;
  }
  return nullptr;
}

bool builtin_type_allowed(std::string_view type, bool grid) {
  if (type.substr(0, 7) == "metal::") type.remove_prefix(7);
  if (type == "uint" || type == "ushort") return true;
  return grid && (type == "uint2" || type == "uint3" || type == "ushort2" || type == "ushort3");
}

// Parameter attributes of other shader stages and resource kinds.
constexpr std::string_view kUnsupportedParameterAttributes[] = {
    "texture", "sampler", "stage_in", "imageblock_data", "payload", "visible_function_table",
    "intersection_function_table", "instance_acceleration_structure", "primitive_acceleration_structure",
};
constexpr std::string_view kUnsupportedAddressSpaces[] = {"threadgroup_imageblock", "ray_data",
                                                          "object_data"};

template <size_t N>
bool contains(const std::string_view (&list)[N], std::string_view word) {
  for (std::string_view entry : list) {
    if (entry == word) return true;
  }
  return false;
}

AddressSpace address_space_of(std::string_view word) {
  if (word == "device") return AddressSpace::device;
  if (word == "constant") return AddressSpace::constant;
  if (word == "threadgroup") return AddressSpace::threadgroup;
  return AddressSpace::none;
}

// One item of an attribute list `[[ a, b(args) ]]`.
struct Attribute {
  std::string name;
  TokenSpan arguments;  // between the parentheses; empty without them
  int line = 0;
};

std::string join_indices(const std::vector<Token>& tokens, const std::vector<std::size_t>& indices) {
  std::string text;
  for (std::size_t k = 0; k < indices.size(); ++k) {
    if (k > 0 && tokens[indices[k]].offset != tokens[indices[k - 1]].end()) text += ' ';
    text += tokens[indices[k]].text;
  }
  return text;
}

class Parser {
 public:
  Parser(std::string_view source, const std::string& file_name)
      : file_name_(file_name), tokens_(program_.tokens) {
    tokens_ = lex(source, file_name);
  }

  ProgramSyntax run() {
    std::vector<std::string> namespaces;
    std::size_t i = 0;
    while (i < tokens_.size()) {
      const Token& token = tokens_[i];
      if (token.kind == TokenKind::preprocessor || token.is(";")) {
        ++i;
      } else if (token.is("}")) {
        if (namespaces.empty()) fail(token.line, "unbalanced '}'");
        namespaces.pop_back();
        ++i;
      } else if (std::size_t body = namespace_body(i)) {
        namespaces.push_back(join_tokens(tokens_, {i + 1, body - 1}));
        i = body;
      } else {
        std::size_t end = declaration_end(i);
        read_declaration({i, end}, namespaces);
        i = end;
      }
    }
    if (!namespaces.empty()) fail(tokens_.back().line, "a namespace is never closed");
    read_constant_queries();
    return std::move(program_);
  }

 private:
  [[noreturn]] void fail(int line, const std::string& what) const {
    throw CompileError(file_name_ + ":" + std::to_string(line) + ": " + what, "");
  }

  bool is(std::size_t i, std::string_view text) const {
    return i < tokens_.size() && tokens_[i].is(text);
  }
  bool is_identifier(std::size_t i) const {
    return i < tokens_.size() && tokens_[i].kind == TokenKind::identifier;
  }
  int line_at(std::size_t i) const {
    return tokens_.empty() ? 1 : tokens_[i < tokens_.size() ? i : tokens_.size() - 1].line;
  }

  std::size_t closing(std::size_t open) const {
    std::size_t close = find_closing(tokens_, open);
    if (close == tokens_.size()) {
      fail(tokens_[open].line, "'" + std::string(tokens_[open].text) + "' is never closed");
    }
    return close;
  }

  // For `namespace a::b {` at i: the index after `{`; 0 otherwise.
  std::size_t namespace_body(std::size_t i) const {
    if (!is(i, "namespace")) return 0;
    std::size_t j = i + 1;
    while (is_identifier(j) || is(j, "::")) ++j;
    return is(j, "{") ? j + 1 : 0;
  }

  // A program-scope declaration ends at `;`, or at the `}` of a function body.
  // Braces after `struct`/`enum`/... or `=` belong to a longer declaration.
  std::size_t declaration_end(std::size_t begin) const {
    bool braces_inside = false;
    for (std::size_t j = begin; j < tokens_.size(); ++j) {
      const Token& token = tokens_[j];
      if (token.is("(") || token.is("[") || token.is("[[")) {
        j = closing(j);
      } else if (token.is("struct") || token.is("class") || token.is("union") ||
                 token.is("enum") || token.is("=")) {
        braces_inside = true;
      } else if (token.is(";")) {
        return j + 1;
      } else if (token.is("{")) {
        std::size_t close = closing(j);
        if (!braces_inside) return close + 1;
        j = close;
      } else if (token.is("}")) {
        fail(token.line, "unbalanced '}'");
      }
    }
    fail(tokens_[begin].line, "declaration never ends (missing ';')");
  }

  std::vector<Attribute> attribute_items(std::size_t open) const {
    std::size_t close = closing(open);
    std::vector<Attribute> items;
    std::size_t j = open + 1;
    while (j < close) {
      Attribute item;
      item.line = tokens_[j].line;
      while (j < close && (is_identifier(j) || is(j, "::"))) item.name += tokens_[j++].text;
      if (item.name.empty()) fail(tokens_[j].line, "cannot read this attribute");
      if (is(j, "(")) {
        std::size_t paren = closing(j);
        item.arguments = {j + 1, paren};
        j = paren + 1;
      }
      if (j < close && !is(j, ",")) fail(tokens_[j].line, "cannot read attribute [[" + item.name + "]]");
      if (is(j, ",")) ++j;
      items.push_back(item);
    }
    return items;
  }

  int integer_argument(const Attribute& attribute) const {
    const TokenSpan& span = attribute.arguments;
    if (span.end == span.begin + 1 && tokens_[span.begin].kind == TokenKind::number) {
      std::string digits(tokens_[span.begin].text);
      while (!digits.empty() && std::string_view("uUlL").find(digits.back()) != std::string_view::npos) {
        digits.pop_back();
      }
      char* end = nullptr;
      long value = std::strtol(digits.c_str(), &end, 0);
      if (!digits.empty() && *end == '\0' && value >= 0 && value <= 0x7fffffff) return int(value);
    }
    fail(attribute.line, "[[" + attribute.name + "(...)]] needs a non-negative integer literal");
  }

  void read_declaration(TokenSpan span, const std::vector<std::string>& namespaces) {
    // What the head (before any parenthesis or brace) says this is.
    bool is_kernel = false, is_function_constant = false;
    for (std::size_t j = span.begin; j < span.end && !is(j, "(") && !is(j, "{"); ++j) {
      if (is(j, "kernel")) is_kernel = true;
      if (is(j, "[[")) {
        for (const Attribute& item : attribute_items(j)) {
          is_kernel |= item.name == "kernel";
          is_function_constant |= item.name == "function_constant";
        }
        j = closing(j);
      }
    }
    if (is_kernel) {
      read_kernel(span, namespaces);
    } else if (is_function_constant) {
      read_function_constant(span);
    }
  }

  void read_kernel(TokenSpan span, const std::vector<std::string>& namespaces) {
    KernelSyntax kernel;
    kernel.declaration = span;
    kernel.namespaces = namespaces;
    std::size_t j = span.begin;
    bool have_keyword = false;
    auto skip_attributes = [&] {
      while (is(j, "[[")) {
        TokenSpan attribute{j, closing(j) + 1};
        std::vector<Attribute> items = attribute_items(j);
        if (items.size() == 1 && items[0].name == "kernel") {
          kernel.keyword = attribute;
          have_keyword = true;
        } else {
          for (const Attribute& item : items) {
            if (item.name == "max_total_threads_per_threadgroup") {
              kernel.info.max_total_threads_per_threadgroup = std::uint32_t(integer_argument(item));
            }
          }
          kernel.attributes.push_back(attribute);
        }
        j = attribute.end;
      }
    };
    skip_attributes();
    if (is(j, "template")) fail(line_at(j), "template kernels are not supported");
    if (is(j, "kernel")) {
      kernel.keyword = {j, j + 1};
      have_keyword = true;
      ++j;
      skip_attributes();
    }
    if (!have_keyword) fail(line_at(j), "cannot read this kernel declaration: expected 'kernel void name(...)'");
    if (!is(j, "void")) fail(line_at(j), "a kernel must return void");
    ++j;
    skip_attributes();
    if (!is_identifier(j)) fail(line_at(j), "expected the kernel's name after 'kernel void'");
    kernel.info.name = std::string(tokens_[j].text);
    ++j;
    skip_attributes();
    if (!is(j, "(")) fail(line_at(j), "expected '(' after kernel '" + kernel.info.name + "'");
    std::size_t close = closing(j);
    read_parameters(kernel, j, close);
    j = close + 1;
    skip_attributes();
    if (is(j, ";") && j + 1 == span.end) return;  // a declaration; the definition comes elsewhere
    if (!is(j, "{") || closing(j) + 1 != span.end) {
      fail(line_at(j), "expected the body of kernel '" + kernel.info.name + "'");
    }
    kernel.body = {j, span.end};
    for (const KernelSyntax& other : program_.kernels) {
      if (other.info.name == kernel.info.name && other.namespaces == kernel.namespaces) {
        fail(line_at(span.begin), "kernel '" + kernel.info.name + "' is defined twice (also at line " +
                                      std::to_string(line_at(other.declaration.begin)) + ")");
      }
    }
    program_.kernels.push_back(std::move(kernel));
  }

  void read_parameters(KernelSyntax& kernel, std::size_t open, std::size_t close) {
    if (close == open + 1 || (close == open + 2 && is(open + 1, "void"))) return;
    std::size_t begin = open + 1;
    int angle_depth = 0;  // template argument lists may hold commas
    for (std::size_t j = begin; j <= close; ++j) {
      if (j == close || (is(j, ",") && angle_depth == 0)) {
        read_parameter(kernel, {begin, j});
        begin = j + 1;
      } else if (is(j, "(") || is(j, "[") || is(j, "[[")) {
        j = closing(j);
      } else if (is(j, "<")) {
        ++angle_depth;
      } else if (is(j, ">") && angle_depth > 0) {
        --angle_depth;
      }
    }
    // Each buffer / threadgroup index binds one parameter.
    std::map<std::pair<ArgumentKind, int>, std::string> bound;
    for (const ParameterSyntax& parameter : kernel.parameters) {
      const ArgumentInfo& info = parameter.info;
      if (info.kind == ArgumentKind::builtin) continue;
      auto [it, inserted] = bound.emplace(std::make_pair(info.kind, info.index), info.name);
      if (!inserted) {
        const char* attribute = info.kind == ArgumentKind::buffer ? "buffer" : "threadgroup";
        fail(line_at(parameter.name), "kernel '" + kernel.info.name + "': [[" + attribute + "(" +
                                          std::to_string(info.index) + ")]] is bound to both '" +
                                          it->second + "' and '" + info.name + "'");
      }
    }
  }

  void read_parameter(KernelSyntax& kernel, TokenSpan span) {
    const std::string where = "kernel '" + kernel.info.name + "': ";
    if (span.begin == span.end) fail(line_at(span.begin), where + "empty parameter");
    ParameterSyntax parameter;
    parameter.declaration = span;
    std::vector<std::size_t> declarator;
    std::vector<Attribute> attributes;
    for (std::size_t j = span.begin; j < span.end; ++j) {
      if (is(j, "[[")) {
        std::vector<Attribute> items = attribute_items(j);
        attributes.insert(attributes.end(), items.begin(), items.end());
        parameter.attributes.push_back({j, closing(j) + 1});
        j = closing(j);
      } else {
        declarator.push_back(j);
      }
    }
    if (declarator.empty() || !is_identifier(declarator.back())) {
      fail(line_at(span.begin), where + "parameter without a name");
    }
    ArgumentInfo& info = parameter.info;
    parameter.name = declarator.back();
    info.name = std::string(tokens_[parameter.name].text);
    const int line = line_at(parameter.name);
    const std::string what = where + "parameter '" + info.name + "'";

    // Qualifiers, address space and indirection around the type's tokens.
    std::vector<std::size_t> type_tokens;
    bool indirection = false;
    for (std::size_t k = 0; k + 1 < declarator.size(); ++k) {
      const Token& token = tokens_[declarator[k]];
      AddressSpace space = address_space_of(token.text);
      if (space != AddressSpace::none || token.is("thread")) {
        if (info.space != AddressSpace::none) fail(line, what + " has two address spaces");
        info.space = space;
      } else if (contains(kUnsupportedAddressSpaces, token.text)) {
        fail(line, what + ": the " + std::string(token.text) + " address space is not supported");
      } else if (token.is("const")) {
        info.is_const |= !indirection;
      } else if (token.is("volatile") || token.is("restrict") || token.is("__restrict")) {
        continue;
      } else if (token.is("*") || token.is("&")) {
        if (indirection) fail(line, what + ": only one level of pointer or reference is supported");
        indirection = true;
        info.is_pointer = token.is("*");
      } else if (indirection || (token.kind == TokenKind::punctuation && !token.is("::") &&
                                     !token.is("<") && !token.is(">") && !token.is(","))) {
        fail(line, what + ": cannot read its type at '" + std::string(token.text) + "'");
      } else {
        type_tokens.push_back(declarator[k]);
      }
    }
    if (type_tokens.empty()) fail(line, what + " has no type");
    info.type = join_indices(tokens_, type_tokens);
    info.is_const |= info.space == AddressSpace::constant;

    bool bound = false;
    for (const Attribute& attribute : attributes) {
      bool binding = true;
      if (attribute.name == "buffer") {
        info.kind = ArgumentKind::buffer;
        info.index = integer_argument(attribute);
      } else if (attribute.name == "threadgroup") {
        info.kind = ArgumentKind::threadgroup_memory;
        info.index = integer_argument(attribute);
      } else if (find_builtin(attribute.name)) {
        info.kind = ArgumentKind::builtin;
        info.builtin = attribute.name;
      } else if (attribute.name == "function_constant") {
        binding = false;  // a conditional argument: bound like any other here
      } else if (contains(kUnsupportedParameterAttributes, attribute.name)) {
        fail(attribute.line, what + ": [[" + attribute.name + "]] arguments are not supported");
      } else {
        fail(attribute.line, what + ": unknown attribute [[" + attribute.name + "]]");
      }
      if (binding && bound) fail(line, what + " has more than one binding attribute");
      bound |= binding;
    }
    if (!bound) {
      fail(line, what + " has no [[buffer(i)]], [[threadgroup(i)]] or builtin attribute");
    }
    check_parameter(info, indirection, what, line);
    kernel.info.arguments.push_back(info);
    kernel.parameters.push_back(std::move(parameter));
  }

  void check_parameter(ArgumentInfo& info, bool indirect_declarator, const std::string& what,
                       int line) const {
    bool indirect = indirect_declarator || info.space != AddressSpace::none;
    switch (info.kind) {
      case ArgumentKind::buffer:
        if (info.space != AddressSpace::device && info.space != AddressSpace::constant) {
          fail(line, what + ": a [[buffer]] argument must be in the device or constant address space");
        }
        break;
      case ArgumentKind::threadgroup_memory:
        if (info.space != AddressSpace::threadgroup) {
          fail(line, what + ": a [[threadgroup]] argument must be in the threadgroup address space");
        }
        break;
      case ArgumentKind::builtin: {
        const BuiltinKind* builtin = find_builtin(info.builtin);
        if (indirect || !builtin_type_allowed(info.type, builtin->grid)) {
          fail(line, what + ": [[" + info.builtin + "]] cannot be declared as '" + info.type +
                         (indirect ? "' with an address space or indirection" : "'") +
                         (builtin->grid ? "; use uint, ushort or their 2- and 3-vectors"
                                        : "; use uint or ushort"));
        }
        info.builtin_type = info.type;
        return;
      }
    }
    if (!indirect_declarator) fail(line, what + ": a bound argument must be a pointer or a reference");
    if (info.index > kMaxBindingIndex) {
      fail(line, what + ": index " + std::to_string(info.index) + " is above " +
                     std::to_string(kMaxBindingIndex));
    }
  }

  void read_function_constant(TokenSpan span) {
    std::size_t attribute = span.begin;
    while (!is(attribute, "[[")) ++attribute;
    std::size_t close = closing(attribute);
    const int line = line_at(attribute);
    std::vector<Attribute> items = attribute_items(attribute);
    if (items.size() != 1 || close + 2 != span.end || !is(close + 1, ";") ||
        !is(span.begin, "constant") || !is_identifier(attribute - 1)) {
      fail(line, "cannot read this function constant: expected 'constant T name [[function_constant(index)]];'");
    }
    FunctionConstantSyntax constant;
    constant.declaration = span;
    constant.info.name = std::string(tokens_[attribute - 1].text);
    constant.info.index = integer_argument(items[0]);
    std::vector<std::size_t> type_tokens;
    for (std::size_t j = span.begin + 1; j + 1 < attribute; ++j) {
      if (!is(j, "const")) type_tokens.push_back(j);
    }
    if (type_tokens.empty()) fail(line, "function constant '" + constant.info.name + "' has no type");
    constant.info.type = join_indices(tokens_, type_tokens);
    for (const FunctionConstantSyntax& other : program_.constants) {
      if (other.info.index == constant.info.index) {
        fail(line, "function constants '" + other.info.name + "' and '" + constant.info.name +
                       "' share index " + std::to_string(constant.info.index));
      }
    }
    program_.constants.push_back(std::move(constant));
  }

  // Finds `is_function_constant_defined(name)`; such constants are optional.
  void read_constant_queries() {
    for (std::size_t j = 0; j < tokens_.size(); ++j) {
      if (!is(j, "is_function_constant_defined")) continue;
      if (!is(j + 1, "(") || !is_identifier(j + 2) || !is(j + 3, ")")) {
        fail(line_at(j), "is_function_constant_defined needs the name of a function constant");
      }
      std::string name(tokens_[j + 2].text);
      bool known = false;
      for (FunctionConstantSyntax& constant : program_.constants) {
        if (constant.info.name != name) continue;
        constant.info.required = false;
        known = true;
      }
      if (!known) fail(line_at(j), "is_function_constant_defined(" + name + "): no such function constant");
      program_.constant_queries.push_back({name, {j, j + 4}});
    }
  }

  const std::string& file_name_;
  ProgramSyntax program_;
  std::vector<Token>& tokens_;
};

}  // namespace

ProgramSyntax parse_program(std::string_view source, const std::string& file_name) {
  return Parser(source, file_name).run();
}

std::size_t find_closing(const std::vector<Token>& tokens, std::size_t open) {
  std::string_view opener = tokens[open].text;
  std::string_view closer = opener == "(" ? ")" : opener == "[" ? "]" : opener == "{" ? "}" : "]]";
  int depth = 0;
  for (std::size_t i = open; i < tokens.size(); ++i) {
    if (tokens[i].is(opener)) ++depth;
    if (tokens[i].is(closer) && --depth == 0) return i;
  }
  return tokens.size();
}

std::string join_tokens(const std::vector<Token>& tokens, TokenSpan span) {
  std::vector<std::size_t> indices;
  for (std::size_t i = span.begin; i < span.end; ++i) indices.push_back(i);
  return join_indices(tokens, indices);
}

}  // namespace mfa::msl
