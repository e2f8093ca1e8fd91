// The generic binder: checks one call's arrays against an op's declaration
// (declaration.hpp) as Python's rules.Binding does, with the declaration's
// messages, and gives the sizes they bind (the pass templates' B, Hq, ...) and
// each given array's checked view.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checked_view.hpp"
#include "declaration.hpp"

namespace mfa {

using AxisOrder = std::optional<std::vector<std::size_t>>;

class Binder {
 public:
  // `given`: the call's arrays by declaration name (null: not given); `layout`: a layout of the declaration's;
  // `preset`: sizes the call gives instead of their derivation (Python's Binding's `sizes`, as
  // varlen's slope_rows: the sequences); `texts`: the call's own message fields and dtype
  // templates (Binding's `texts`, as quantize's {format}).
  Binder(const Declaration& declaration, std::string layout, std::map<std::string, const TensorView*> given,
         SizeEnv preset = {}, std::map<std::string, std::string> texts = {});

  // The arrays that bind sizes (a list's first element), their dtypes, then their extents (each
  // checked, of the declared rank), then the declaration's requirements and derived sizes.
  void bind_sizes();
  // Every other array given that the op shares with attention, in declaration order: its form
  // (check_forms), then its contents (check_contents).
  void check_others();
  // The same for the op's own arrays (checked after those, as Python's ops check them).
  void check_own();
  // The forms of the given arrays that are (`own`) or are not the op's own, in declaration
  // order: one given without an argument it needs is refused; dtype, rank (when its rule says
  // how it is refused), shape (or broadcast; binding the size names only it has), its
  // requirements, and contiguity when written in place. A list's elements ({name}[i]) each by
  // its rule, or, with unlike_error, like its first.
  void check_forms(bool own);
  // Their contents (each array's content checks, in order; the Lengths they read from the call's arrays).
  void check_contents(bool own);
  // The Lengths `name` for the call's arrays (none: no source given and no fill), and in
  // `source` the array they came from (unchanged: the fill): what its content checks read.
  std::optional<std::vector<std::int64_t>> lengths(const std::string& name, std::string& source) const;
  // A size the call gives once its forms are checked (rules.Binding's sizes[name] = value).
  void set_size(const std::string& name, std::int64_t value);

  const SizeEnv& sizes() const { return sizes_; }
  std::int64_t size(const std::string& name) const { return sizes_.at(name); }
  bool given(const std::string& name) const;
  // The checked view of a given array, as given (a broadcast one: broadcast(view, expected(name))).
  const Checked& view(const std::string& name) const { return views_.at(name); }
  // Which of its rule's shapes a checked array has.
  std::size_t shape_index(const std::string& name) const { return shape_index_.at(name); }
  // The shape `name` must have (its rule's shape `index`), in memory order.
  std::vector<std::int64_t> expected(const std::string& name, std::size_t index = 0) const;
  // A layout-ordered array's memory-order values (strides) in logical order.
  std::vector<std::int64_t> logical(const ArrayRule& rule, const std::vector<std::int64_t>& memory) const;
  const Declaration& declaration() const { return declaration_; }

 private:
  void check_dtype(const ArrayRule& rule) const;
  void bind(const ArrayRule& rule);
  void check(const ArrayRule& rule);
  void check_like_first(const ArrayRule& rule) const;
  // Notes the list element `name` is (its list's fields in messages are its).
  void note_element(const std::string& name);
  void check_shape(const ArrayRule& rule);
  void check_contents(const ArrayRule& rule);
  // A checked int32 array's entries in C order, read once a call.
  const std::vector<std::int64_t>& entries(const std::string& name) const;
  void require(const std::vector<SizeRequirement>& requirements) const;
  // The sizes with those that shape `index` of `rule` names but nothing bound yet taken from
  // `shape`'s extents (none: its rank is not the shape's, or no size is new).
  std::optional<SizeEnv> with_new_sizes(const ArrayRule& rule, std::size_t index,
                                        const std::vector<std::int64_t>& shape) const;
  // Shape `index` of `rule` for `sizes`, in memory order (the call's leading axes first where it has them).
  std::vector<std::int64_t> shape_for(const ArrayRule& rule, std::size_t index, const SizeEnv& sizes) const;
  // The logical axis of each memory axis of a `rank`-d array of `rule` (none: memory order is
  // logical): the layout's order of the axes below `rank` (a (B, Hq, R) array in bshd: (B, R, Hq)).
  AxisOrder order(const ArrayRule& rule, std::size_t rank) const;
  // The declaration's message `text` with its fields filled in for this call.
  std::string format(const std::string& text) const;
  std::string field(const std::string& key) const;

  const Declaration& declaration_;
  std::string layout_;
  std::map<std::string, const TensorView*> given_;
  SizeEnv sizes_;
  std::map<std::string, std::string> texts_;
  std::vector<std::int64_t> leading_;  // the call's leading axes, once an array binds them
  std::map<std::string, std::string> elements_;  // a list's name -> its element being checked
  std::map<std::string, Checked> views_;
  std::map<std::string, std::size_t> shape_index_;
  std::map<std::string, std::int64_t> content_fields_;
  mutable std::map<std::string, std::vector<std::int64_t>> entries_;  // entries(): each array's, read once  // a content message's {name.index}, {name.value}, ...
};

}  // namespace mfa
