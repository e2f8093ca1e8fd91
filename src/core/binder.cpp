#include "binder.hpp"

#include <algorithm>
#include <cctype>
#include <utility>

namespace mfa {

namespace {

// Logical-order `values` in memory order: memory axis i holds logical axis order[i].
template <typename T>
std::vector<T> in_memory_order(const std::vector<T>& values, const AxisOrder& order) {
  if (!order) return values;
  std::vector<T> out;
  for (std::size_t axis : *order) out.push_back(values[axis]);
  return out;
}

std::vector<std::int64_t> in_logical_order(const std::vector<std::int64_t>& memory, const AxisOrder& order) {
  if (!order) return memory;
  std::vector<std::int64_t> out(memory.size());
  for (std::size_t i = 0; i < memory.size(); ++i) out[(*order)[i]] = memory[i];
  return out;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// Whether `text` is a size name (an identifier), not an expression or a number.
bool is_size_name(const std::string& text) {
  if (text.empty() || std::isdigit(static_cast<unsigned char>(text[0]))) return false;
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

using Fields = std::map<std::string, std::int64_t>;

// The first of the largest of `values` (numpy's argmax), or none when it is not above `bound`.
Fields longest_above(const std::vector<std::int64_t>& values, std::int64_t bound) {
  const auto longest = std::max_element(values.begin(), values.end());
  if (longest == values.end() || *longest <= bound) return {};
  return {{"index", longest - values.begin()}, {"value", *longest}};
}

// rules.content_failure: the fields of the first entry of `values` breaking a content check of
// `kind` (empty: it holds): index and value; "nonnegative" adds min (the smallest entry, at
// index), "nondecreasing" the entry before, prior_index and prior; "fits" gives the longest of
// `lengths` where it is above `bound`; "within" adds limit, the length entry index passes;
// "pages" gives the row, column and value of a table's first entry outside 0 .. last (bound - 1)
// among those row b reads (its rows: those of its last axis, `width` wide, in C order), the
// first cdiv(lengths[b], page).
Fields content_failure(const std::string& kind, const std::vector<std::int64_t>& values, std::int64_t bound,
                       const std::vector<std::int64_t>& lengths, std::int64_t page, std::int64_t width) {
  if (kind == "fits") return longest_above(lengths, bound);
  if (kind == "within") {
    for (std::size_t i = 0; i < values.size() && i < lengths.size(); ++i)
      if (values[i] > lengths[i]) return {{"index", std::int64_t(i)}, {"value", values[i]}, {"limit", lengths[i]}};
    return {};
  }
  if (kind == "pages") {
    if (page < 1) throw ArgumentError("a page must hold at least one row, got " + std::to_string(page));
    for (std::size_t row = 0; row < lengths.size() && std::int64_t(row + 1) * width <= std::int64_t(values.size());
         ++row) {
      const std::int64_t read = std::min(width, (std::max<std::int64_t>(lengths[row], 0) + page - 1) / page);
      for (std::int64_t column = 0; column < read; ++column)
        if (const std::int64_t entry = values[row * std::size_t(width) + std::size_t(column)]; entry < 0 || entry >= bound)
          return {{"row", std::int64_t(row)}, {"column", column}, {"value", entry}, {"last", bound - 1}};
    }
    return {};
  }
  if (values.empty()) return {};
  if (kind == "nonnegative") {
    const auto lowest = std::min_element(values.begin(), values.end());  // numpy's argmin: the first
    if (*lowest >= 0) return {};
    return {{"index", lowest - values.begin()}, {"value", *lowest}, {"min", *lowest}};
  }
  if (kind == "first" || kind == "last") {
    const std::size_t at = kind == "first" ? 0 : values.size() - 1;
    if (values[at] == bound) return {};
    return {{"index", std::int64_t(at)}, {"value", values[at]}};
  }
  std::size_t at = 0;  // "nondecreasing": the first of the largest drops
  for (std::size_t i = 1; i + 1 < values.size(); ++i)
    if (values[i + 1] - values[i] < values[at + 1] - values[at]) at = i;
  if (values.size() < 2 || values[at + 1] >= values[at]) return {};
  return {{"index", std::int64_t(at + 1)}, {"value", values[at + 1]}, {"prior_index", std::int64_t(at)},
          {"prior", values[at]}};
}

// Whether a `rank`-d array may have `rule`'s shapes: their rank, or more with leading axes.
bool fits(const ArrayRule& rule, std::size_t rank) {
  return rule.leading ? rank >= rule.axes.size() : rank == rule.axes.size();
}

// The extents of `shape` that `rule`'s shapes name (its last ones, after any leading axes).
std::vector<std::int64_t> trailing(const ArrayRule& rule, const std::vector<std::int64_t>& shape) {
  return {shape.end() - static_cast<std::ptrdiff_t>(rule.axes.size()), shape.end()};
}

// The rule of element `i` of the list `rule` declares: the rule, named {name}[i].
ArrayRule element(const ArrayRule& rule, std::size_t i) {
  ArrayRule e = rule;
  e.name += "[" + std::to_string(i) + "]";
  return e;
}

// Whether numpy broadcasts `shape` to `target`.
bool broadcasts(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& target) {
  if (shape.size() > target.size()) return false;
  const std::size_t offset = target.size() - shape.size();
  for (std::size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != 1 && shape[i] != target[offset + i]) return false;
  return true;
}

}  // namespace

Binder::Binder(const Declaration& declaration, std::string layout, std::map<std::string, const TensorView*> given,
               SizeEnv preset, std::map<std::string, std::string> texts)
    : declaration_(declaration), layout_(std::move(layout)), given_(std::move(given)), sizes_(std::move(preset)),
      texts_(std::move(texts)) {
  if (!declaration_.layouts.count(layout_))
    throw BundleError("the bundle's declaration of " + declaration_.op + " has no layout " + layout_);
}

bool Binder::given(const std::string& name) const {
  auto it = given_.find(name);
  return it != given_.end() && it->second != nullptr;
}

void Binder::bind_sizes() {
  std::vector<ArrayRule> firsts;  // a binding list's first element's rule
  firsts.reserve(declaration_.arrays.size());
  std::vector<const ArrayRule*> binding;
  for (const ArrayRule& rule : declaration_.arrays)
    if (rule.binds) binding.push_back(rule.each ? &firsts.emplace_back(element(rule, 0)) : &rule);
  for (const ArrayRule* rule : binding) check_dtype(*rule);
  for (const ArrayRule* rule : binding) bind(*rule);
  require(declaration_.requires_);
  for (const auto& [name, expression] : declaration_.derived) sizes_.emplace(name, expression.evaluate(sizes_));
}

void Binder::check_others() {
  check_forms(false);
  check_contents(false);
}

void Binder::check_own() {
  check_forms(true);
  check_contents(true);
}

void Binder::check_forms(bool own) {
  for (const ArrayRule& rule : declaration_.arrays) {
    if (rule.own != own) continue;
    if (rule.each) {  // a binding list's first element is bound
      for (std::size_t i = rule.binds ? 1 : 0;; ++i) {
        const ArrayRule each = element(rule, i);
        if (!given(each.name)) break;
        check(each);
      }
    } else if (!rule.binds && given(rule.name))
      check(rule);
  }
}

void Binder::check_contents(bool own) {
  for (const ArrayRule& rule : declaration_.arrays)
    if (rule.own == own && !rule.each && !rule.binds && given(rule.name)) check_contents(rule);
}

void Binder::set_size(const std::string& name, std::int64_t value) { sizes_[name] = value; }

void Binder::check_like_first(const ArrayRule& rule) const {
  const TensorView& view = *given_.at(rule.name);
  const TensorView& first = *given_.at(rule.name.substr(0, rule.name.find('[')) + "[0]");
  if (view.dtype != first.dtype || view.shape != first.shape) throw ArgumentError(format(rule.unlike_error));
}

void Binder::note_element(const std::string& name) {
  const std::size_t open = name.find('[');
  if (open != std::string::npos) elements_[name.substr(0, open)] = name;
}

void Binder::require(const std::vector<SizeRequirement>& requirements) const {
  for (const SizeRequirement& requirement : requirements) {
    if (requirement.check.evaluate(sizes_)) continue;
    if (requirement.type_error) throw TypeError(format(requirement.message));
    throw ArgumentError(format(requirement.message));
  }
}

void Binder::check(const ArrayRule& rule) {
  note_element(rule.name);
  const bool first = rule.name.size() > 3 && rule.name.compare(rule.name.size() - 3, 3, "[0]") == 0;
  if (!rule.unlike_error.empty() && !first) return check_like_first(rule);
  for (const auto& [needed, message] : rule.needs)
    if (!given(needed)) throw ArgumentError(format(message));
  check_dtype(rule);
  if (!rule.rank_error.empty() && !fits(rule, given_.at(rule.name)->shape.size()))
    throw ArgumentError(format(rule.rank_error));
  check_shape(rule);
  require(rule.requires_);
}

void Binder::check_dtype(const ArrayRule& rule) const {
  if (!given(rule.name)) throw ArgumentError(rule.name + " is required");
  const std::string dtype = to_string(given_.at(rule.name)->dtype);
  const bool allowed = rule.dtypes.empty()
                           ? !given(rule.dtype_of) || dtype == to_string(given_.at(rule.dtype_of)->dtype)
                           : std::any_of(rule.dtypes.begin(), rule.dtypes.end(),  // templates: the call's texts fill
                                         [&](const std::string& d) { return dtype == format(d); });
  if (allowed) return;
  if (rule.dtype_value_error) throw ArgumentError(format(rule.dtype_error));
  throw TypeError(format(rule.dtype_error));
}

void Binder::bind(const ArrayRule& rule) {
  note_element(rule.name);
  const TensorView& view = *given_.at(rule.name);
  if (!fits(rule, view.shape.size())) throw ArgumentError(format(rule.rank_error));
  views_[rule.name] = checked(view, rule.name);
  if (rule.leading) leading_.assign(view.shape.begin(), view.shape.end() - std::ptrdiff_t(rule.axes.size()));
  const std::vector<std::int64_t> extents = logical(rule, trailing(rule, view.shape));
  for (std::size_t i = 0; i < extents.size(); ++i) {
    sizes_[rule.name + "_" + rule.axes[i]] = extents[i];
    sizes_.emplace(rule.axes[i], extents[i]);
  }
}

void Binder::check_shape(const ArrayRule& rule) {
  const TensorView& view = *given_.at(rule.name);
  for (std::size_t index = 0; index < rule.shapes.size(); ++index) {
    std::optional<SizeEnv> sizes = with_new_sizes(rule, index, view.shape);
    const std::vector<std::int64_t> target = shape_for(rule, index, sizes ? *sizes : sizes_);
    if (view.shape != target && !(rule.broadcast && broadcasts(view.shape, target))) continue;
    if (sizes) sizes_ = std::move(*sizes);
    const Checked& kept = views_[rule.name] = checked(view, rule.name);
    shape_index_[rule.name] = index;
    if (rule.written) require_contiguous(kept);
    return;
  }
  if (std::optional<SizeEnv> sizes = with_new_sizes(rule, 0, view.shape))  // {name.expected} with the sizes it gives
    sizes_ = std::move(*sizes);
  throw ArgumentError(format(rule.shape_error));
}

std::optional<SizeEnv> Binder::with_new_sizes(const ArrayRule& rule, std::size_t index,
                                              const std::vector<std::int64_t>& shape) const {
  const std::vector<SizeExpression>& dims = rule.shapes[index];
  if (rule.leading ? shape.size() < dims.size() : shape.size() != dims.size()) return std::nullopt;
  const std::vector<std::int64_t> extents = logical(rule, {shape.end() - std::ptrdiff_t(dims.size()), shape.end()});
  std::optional<SizeEnv> sizes;
  for (std::size_t i = 0; i < dims.size(); ++i)
    if (is_size_name(dims[i].text()) && !sizes_.count(dims[i].text())) {
      if (!sizes) sizes = sizes_;
      sizes->emplace(dims[i].text(), extents[i]);
    }
  return sizes;
}

const std::vector<std::int64_t>& Binder::entries(const std::string& name) const {
  if (auto read = entries_.find(name); read != entries_.end()) return read->second;
  const Checked& view = views_.at(name);
  if (view.view->dtype != DType::int32)
    throw BundleError("the bundle's declaration of " + declaration_.op + " reads the contents of " + name +
                      ", which is not int32");
  return entries_.emplace(name, int32_entries(view)).first->second;
}

std::optional<std::vector<std::int64_t>> Binder::lengths(const std::string& name, std::string& source_name) const {
  const LengthsRule& rule = declaration_.lengths.at(name);  // Declaration::from_json checked it is declared
  for (const auto& [source, steps] : rule.sources) {
    if (!given(source)) continue;
    source_name = source;
    std::vector<std::int64_t> values = entries(source);  // a copy: the lengths it becomes
    if (steps) {
      for (std::size_t i = 0; i + 1 < values.size(); ++i) values[i] = values[i + 1] - values[i];
      if (!values.empty()) values.pop_back();
    }
    const std::int64_t offset = rule.offset.evaluate(sizes_);
    std::vector<std::int64_t> plus(values.size(), 0);
    if (!rule.plus.empty()) {
      if (!given(rule.plus) || (plus = entries(rule.plus)).size() != values.size())
        throw ArgumentError("the declaration's lengths " + name + " add " + rule.plus +
                            ", which this call does not give as many entries");
    }
    for (std::size_t i = 0; i < values.size(); ++i) values[i] += offset + plus[i];
    return values;
  }
  if (!rule.fill) return std::nullopt;
  return std::vector<std::int64_t>(std::size_t(std::max<std::int64_t>(rule.rows->evaluate(sizes_), 0)),
                                   rule.fill->evaluate(sizes_));
}

void Binder::check_contents(const ArrayRule& rule) {
  static const std::vector<std::int64_t> kNone;
  for (const ContentCheck& content : rule.contents) {
    if (content.when && !content.when->evaluate(sizes_)) continue;
    std::vector<std::int64_t> lengths;
    std::string source;
    if (!content.lengths.empty()) {
      auto given_lengths = this->lengths(content.lengths, source);
      if (!given_lengths) continue;
      lengths = std::move(*given_lengths);
    }
    const std::vector<std::int64_t>& values = content.reads_entries() ? entries(rule.name) : kNone;
    const std::vector<std::int64_t>& shape = views_.at(rule.name).shape;
    const std::int64_t width = shape.empty() ? 0 : shape.back();
    if ((content.kind == "within" || content.kind == "pages") &&
        std::int64_t(lengths.size()) * (content.kind == "pages" ? width : 1) != std::int64_t(values.size()))
      throw ArgumentError("the declaration's " + content.kind + " check of " + rule.name + " reads " +
                          content.lengths + ", " + std::to_string(lengths.size()) + " rows, which " + rule.name +
                          " does not have");
    const auto failure = content_failure(content.kind, values, content.bound ? content.bound->evaluate(sizes_) : 0,
                                         lengths, content.page ? content.page->evaluate(sizes_) : 0, width);
    if (failure.empty()) continue;
    for (const auto& [field, value] : failure) content_fields_[rule.name + "." + field] = value;
    texts_[rule.name + ".source"] = source;
    throw ArgumentError(format(content.message));
  }
}

std::vector<std::int64_t> Binder::logical(const ArrayRule& rule, const std::vector<std::int64_t>& memory) const {
  return in_logical_order(memory, order(rule, memory.size()));
}

std::vector<std::int64_t> Binder::expected(const std::string& name, std::size_t index) const {
  return shape_for(declaration_.rule(name), index, sizes_);
}

std::vector<std::int64_t> Binder::shape_for(const ArrayRule& rule, std::size_t index, const SizeEnv& sizes) const {
  std::vector<std::int64_t> logical;
  for (const SizeExpression& dim : rule.shapes.at(index)) logical.push_back(dim.evaluate(sizes));
  std::vector<std::int64_t> shape = in_memory_order(logical, order(rule, logical.size()));
  if (rule.leading) shape.insert(shape.begin(), leading_.begin(), leading_.end());
  return shape;
}

AxisOrder Binder::order(const ArrayRule& rule, std::size_t rank) const {
  const std::vector<std::size_t>& axes = declaration_.layouts.at(layout_);
  if (!rule.layout || rank > axes.size()) return std::nullopt;
  std::vector<std::size_t> below;  // the layout's order of the axes below `rank`
  for (std::size_t axis : axes)
    if (axis < rank) below.push_back(axis);
  return below;
}

std::string Binder::format(const std::string& text) const {
  std::string out;
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t open = text.find('{', at), close = text.find('}', open);
    if (open == std::string::npos || close == std::string::npos) break;
    out += text.substr(at, open - at) + field(text.substr(open + 1, close - open - 1));
    at = close + 1;
  }
  return out + text.substr(std::min(at, text.size()));
}

std::string Binder::field(const std::string& key) const {
  if (key == "layout") return layout_;
  if (auto text = texts_.find(key); text != texts_.end()) return text->second;
  const std::size_t dot = key.find('.');
  if (dot == std::string::npos) {
    auto it = sizes_.find(key);
    return it == sizes_.end() ? "{" + key + "}" : std::to_string(it->second);
  }
  std::string name = key.substr(0, dot);
  const std::string what = key.substr(dot + 1);
  if (auto element = elements_.find(name); element != elements_.end()) {  // a list: its element being checked
    if (what == "element") return element->second;
    name = element->second;
  }
  if (!given(name)) return "{" + key + "}";
  const ArrayRule& rule = declaration_.rule(name);
  const TensorView& view = *given_.at(name);
  if (what == "shape") return shape_text(view.shape);
  if (what == "dtype") return to_string(view.dtype);
  if (what == "axes") {
    std::vector<std::string> axes = in_memory_order(rule.axes, order(rule, rule.axes.size()));
    if (rule.leading) axes.insert(axes.begin(), "...");
    return joined(axes);
  }
  if (what == "expected") return shape_text(expected(name));
  if (auto it = content_fields_.find(key); it != content_fields_.end()) return std::to_string(it->second);
  return "{" + key + "}";
}

}  // namespace mfa
