#include "declaration.hpp"

#include <algorithm>

#include "mfa/attention.hpp"

namespace mfa {

namespace {

constexpr const char* kLeading = "...";  // a shape's first entry: the call's leading axes (rules.LEADING)

std::string optional_text(const json::Value& value, const char* key) {
  const json::Value& v = value.at(key);
  return v.is_null() ? std::string() : v.as_string(key);
}

view_packing::Reads reads_of(const std::string& text) {
  using view_packing::Reads;
  if (text == "strided") return Reads::strided;
  if (text == "strided_broadcast") return Reads::strided_broadcast;
  if (text == "contiguous") return Reads::contiguous;
  throw json::JsonError("a declaration's reads must be strided, strided_broadcast or contiguous, got '" + text + "'");
}

std::vector<SizeRequirement> requires_of(const json::Value& list) {
  std::vector<SizeRequirement> out;
  for (const json::Value& r : list.as_array("requires"))
    out.push_back({SizeExpression(r.at("check").as_string("check")), r.at("message").as_string("message"),
                   r.at("error").as_string("error") == "TypeError"});
  return out;
}

std::optional<SizeExpression> optional_expression(const json::Value& value, const char* key) {
  const std::string text = optional_text(value, key);
  return text.empty() ? std::nullopt : std::optional<SizeExpression>(SizeExpression(text));
}

ContentCheck content_of(const json::Value& c) {
  ContentCheck check{c.at("kind").as_string("content kind"), c.at("message").as_string("content message"),
                     optional_expression(c, "bound"), optional_expression(c, "when"), optional_text(c, "lengths"),
                     optional_expression(c, "page")};
  static const std::vector<std::string> kinds = {"nonnegative", "first", "last", "nondecreasing",
                                                 "fits", "within", "pages"};
  if (std::find(kinds.begin(), kinds.end(), check.kind) == kinds.end())
    throw json::JsonError("a declaration's content check must be nonnegative, first, last, nondecreasing, fits, "
                          "within or pages, got '" + check.kind + "'");
  const bool bounded = check.kind == "first" || check.kind == "last" || check.kind == "fits" || check.kind == "pages";
  const bool of_lengths = check.kind == "fits" || check.kind == "within" || check.kind == "pages";
  if (bounded != check.bound.has_value() || of_lengths == check.lengths.empty() ||
      (check.kind == "pages") != check.page.has_value())
    throw json::JsonError("a declaration's content check of kind " + check.kind + " takes a bound if and only if it "
                          "is first, last, fits or pages, lengths if and only if it is fits, within or pages, and a "
                          "page if and only if it is pages");
  return check;
}

LengthsRule lengths_of(const json::Value& l) {
  LengthsRule lengths{{}, SizeExpression(l.at("offset").as_string("lengths offset")), optional_text(l, "plus"),
                      optional_expression(l, "fill"), optional_expression(l, "rows")};
  if (lengths.fill.has_value() != lengths.rows.has_value())
    throw json::JsonError("a declaration's lengths take a fill and its rows together");
  for (const json::Value& source : l.at("sources").as_array("lengths sources")) {
    const std::vector<json::Value>& pair = source.as_array("lengths source");
    if (pair.size() != 2) throw json::JsonError("a lengths source is an (array, steps) pair");
    lengths.sources.emplace_back(pair[0].as_string("lengths source array"), pair[1].as_bool("lengths source steps"));
  }
  return lengths;
}

ArrayRule rule_of(const json::Value& a) {
  ArrayRule r;
  r.name = a.at("name").as_string("name");
  r.buffer = a.at("buffer").as_string("buffer");
  r.output = a.at("role").as_string("role") == "output";
  r.optional = a.at("optional").as_bool("optional");
  for (const json::Value& d : a.at("dtypes").as_array("dtypes")) r.dtypes.push_back(d.as_string("dtype"));
  r.dtype_of = optional_text(a, "dtype_of");
  for (const json::Value& shape : a.at("shapes").as_array("shapes")) {
    std::vector<SizeExpression> dims;
    const std::vector<json::Value>& texts = shape.as_array("shape");
    const bool leading = !texts.empty() && texts.front().as_string("shape size") == kLeading;
    if (!r.shapes.empty() && leading != r.leading)
      throw json::JsonError("the shapes of " + r.name + " differ in their leading axes");
    r.leading = leading;
    for (std::size_t i = leading ? 1 : 0; i < texts.size(); ++i) dims.emplace_back(texts[i].as_string("shape size"));
    r.shapes.push_back(std::move(dims));
  }
  if (r.shapes.empty()) throw json::JsonError("the declaration of " + r.name + " has no shape");
  for (const SizeExpression& dim : r.shapes.front()) r.axes.push_back(dim.text());
  r.layout = a.at("layout").as_bool("layout");
  r.binds = a.at("binds").as_bool("binds");
  r.broadcast = a.at("broadcast").as_bool("broadcast");
  r.written = a.at("written").as_bool("written");
  r.reads = reads_of(a.at("reads").as_string("reads"));
  for (const json::Value& axis : a.at("stride_axes").as_array("stride_axes"))
    r.stride_axes.push_back(axis.as_string("stride axis"));
  for (const json::Value& need : a.at("needs").as_array("needs")) {
    const std::vector<json::Value>& pair = need.as_array("need");
    if (pair.size() != 2) throw json::JsonError("a need is an (argument, message) pair");
    r.needs.emplace_back(pair[0].as_string("needed argument"), pair[1].as_string("need message"));
  }
  r.expands = a.at("expands").as_bool("expands");
  r.own = a.at("own").as_bool("own");
  r.each = a.at("each").as_bool("each");
  r.unlike_error = a.at("unlike_error").as_string("unlike_error");
  r.requires_ = requires_of(a.at("requires"));
  for (const json::Value& c : a.at("contents").as_array("contents")) r.contents.push_back(content_of(c));
  r.dtype_value_error = a.at("dtype_raises").as_string("dtype_raises") == "ValueError";
  r.dtype_error = a.at("dtype_error").as_string("dtype_error");
  r.rank_error = a.at("rank_error").as_string("rank_error");
  r.shape_error = a.at("shape_error").as_string("shape_error");
  return r;
}

}  // namespace

const ArrayRule& Declaration::rule(const std::string& name) const {
  const std::string array = name.substr(0, name.find('['));
  for (const ArrayRule& r : arrays)
    if (r.name == array) return r;
  throw BundleError("the bundle's declaration of " + op + " has no array '" + name + "'");
}

Declaration Declaration::from_json(const json::Value& value) {
  Declaration d;
  d.op = value.at("op").as_string("op");
  for (const json::Value& a : value.at("arrays").as_array("arrays")) d.arrays.push_back(rule_of(a));
  d.requires_ = requires_of(value.at("requires"));
  for (const json::Value& pair : value.at("derived").as_array("derived")) {
    const std::vector<json::Value>& items = pair.as_array("derived size");
    if (items.size() != 2) throw json::JsonError("a derived size is a (name, expression) pair");
    d.derived.emplace_back(items[0].as_string("derived name"), SizeExpression(items[1].as_string("derived size")));
  }
  for (const auto& [name, l] : value.at("lengths").as_object("lengths")) d.lengths.emplace(name, lengths_of(l));
  for (const auto& [name, order] : value.at("layouts").as_object("layouts")) {
    std::vector<std::size_t> axes;
    for (const json::Value& axis : order.as_array("layout")) axes.push_back(std::size_t(axis.as_int("layout axis")));
    std::vector<std::size_t> sorted = axes;
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t i = 0; i < sorted.size(); ++i)
      if (sorted[i] != i) throw json::JsonError("layout " + name + " is not an order of its axes");
    d.layouts[name] = std::move(axes);
  }
  for (const ArrayRule& rule : d.arrays)
    for (const ContentCheck& content : rule.contents)
      if (!content.lengths.empty() && !d.lengths.count(content.lengths))
        throw json::JsonError("a content check of " + rule.name + " reads lengths '" + content.lengths +
                              "', which the declaration does not declare");
  if (const json::Value* operations = value.find("score_operations"))
    for (const auto& [op, arity] : operations->as_object("score_operations"))
      d.score_operations[op] = arity.is_null() ? -1 : int(arity.as_int("score operation arity"));
  return d;
}

}  // namespace mfa
