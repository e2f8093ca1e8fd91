#include "block_mask.hpp"

#include <algorithm>
#include <cstring>

#include "attention_problem.hpp"
#include "binder.hpp"
#include "view_packing.hpp"

namespace mfa::block_mask {

namespace {

// block_mask.py's PAIRS: (num_blocks, indices), in the order the passes bind them.
const std::pair<const char*, const char*> kPairs[] = {{"kv_num_blocks", "kv_indices"},
                                                      {"full_kv_num_blocks", "full_kv_indices"},
                                                      {"q_num_blocks", "q_indices"},
                                                      {"full_q_num_blocks", "full_q_indices"}};

// A BlockMask's list or bits by name (null: not given).
const TensorView* list_of(const BlockMask& mask, const std::string& name) {
  if (name == "kv_num_blocks") return &mask.kv_num_blocks;
  if (name == "kv_indices") return &mask.kv_indices;
  const std::pair<const char*, const std::optional<TensorView>*> optional[] = {
      {"full_kv_num_blocks", &mask.full_kv_num_blocks}, {"full_kv_indices", &mask.full_kv_indices},
      {"q_num_blocks", &mask.q_num_blocks},             {"q_indices", &mask.q_indices},
      {"full_q_num_blocks", &mask.full_q_num_blocks},   {"full_q_indices", &mask.full_q_indices},
      {"kv_bit_blocks", &mask.kv_bit_blocks},           {"kv_bits", &mask.kv_bits}};
  for (const auto& [known, list] : optional)
    if (name == known) return *list ? &**list : nullptr;
  return nullptr;
}

std::string pair_text(std::pair<std::int64_t, std::int64_t> pair) { return shape_text({pair.first, pair.second}); }

std::vector<std::int64_t> leading(const Checked& view) { return {view.shape[0], view.shape[1]}; }

// Whether two float elements (their bits; `magnitude` and `exponent` the encoding's masks) are
// equal as numbers, NaN equal to NaN (numpy's array_equal with equal_nan): the same bits, both
// zeros, or both NaN.
bool same_number(std::uint32_t a, std::uint32_t b, std::uint32_t magnitude, std::uint32_t exponent) {
  const auto nan = [&](std::uint32_t x) { return (x & exponent) == exponent && (x & magnitude & ~exponent); };
  return a == b || ((a & magnitude) == 0 && (b & magnitude) == 0) || (nan(a) && nan(b));
}

// block_sparse.py's _same_values: the same shape, dtype and values (NaN equal to NaN).
bool same_values(const TensorView& a, const TensorView& b) {
  if (a.shape != b.shape || a.dtype != b.dtype) return false;
  const Checked x = checked(a, "mask"), y = checked(b, "mask");
  const std::size_t item = dtype_size(a.dtype);
  std::vector<std::int64_t> index(a.shape.size(), 0);
  for (std::int64_t n = 0; n < x.elements; ++n) {
    std::int64_t at_x = 0, at_y = 0;
    for (std::size_t i = 0; i < index.size(); ++i) at_x += index[i] * x.strides[i], at_y += index[i] * y.strides[i];
    std::uint32_t u = 0, w = 0;
    std::memcpy(&u, static_cast<const unsigned char*>(a.data) + at_x * std::int64_t(item), item);
    std::memcpy(&w, static_cast<const unsigned char*>(b.data) + at_y * std::int64_t(item), item);
    const bool same = a.dtype == DType::float32    ? same_number(u, w, 0x7fffffffu, 0x7f800000u)
                      : a.dtype == DType::float16  ? same_number(u, w, 0x7fffu, 0x7c00u)
                      : a.dtype == DType::bfloat16 ? same_number(u, w, 0x7fffu, 0x7f80u)
                                                   : u == w;
    if (!same) return false;
    for (std::size_t i = index.size(); i-- > 0;) {
      if (++index[i] < a.shape[i]) break;
      index[i] = 0;
    }
  }
  return true;
}

std::string causal_repr(Causal causal) { return std::string("'") + attention_problem::causal_name(causal) + "'"; }

std::string window_repr(const std::optional<std::pair<std::int64_t, std::int64_t>>& window) {
  return window ? pair_text(*window) : "None";
}

}  // namespace

Lists::Lists(const BlockMask& mask) : block_size_(mask.block_size), shape_(mask.seq_lengths) {
  if (block_size_.first < 1 || block_size_.second < 1)  // block_size_pair
    throw ArgumentError("block sizes must be positive, got " + pair_text(block_size_));
  for (const auto& [num, indices] : kPairs) {
    const TensorView *counts = list_of(mask, num), *listed = list_of(mask, indices);
    if (!counts != !listed)
      throw ArgumentError(std::string(num) + " and " + indices + " come together: pass both or neither");
    if (!counts) continue;
    add(num, *counts, 3);
    add(indices, *listed, 4);
    const Checked &n = views_.at(num), &l = views_.at(indices);
    if (!std::equal(n.shape.begin(), n.shape.end(), l.shape.begin()))
      throw ArgumentError(std::string(indices) + " " + shape_text(l.shape) + " must extend " + num + " " +
                          shape_text(n.shape) + " by one axis");
  }
  if (has("q_num_blocks") && has("full_kv_num_blocks") != has("full_q_num_blocks"))
    throw ArgumentError("with the transposed lists, give full_q_* exactly when full_kv_* are given");
  if (has("full_q_num_blocks") && !has("q_num_blocks"))
    throw ArgumentError("full_q_* need q_num_blocks and q_indices too");
  std::vector<std::int64_t> lead = {1, 1};  // joint_lead
  for (const std::string& name : names_) {
    const std::vector<std::int64_t> own = leading(views_.at(name));
    for (int i = 0; i < 2; ++i) {
      if (own[i] != 1 && lead[i] != 1 && own[i] != lead[i])
        throw ArgumentError(name + " has leading axes " + shape_text(own) + ", which do not broadcast with the "
                            "other lists' " + shape_text(lead));
    }
    for (int i = 0; i < 2; ++i) lead[i] = lead[i] == 1 ? own[i] : lead[i];
  }
  lead_ = {lead[0], lead[1]};
  if (!mask.kv_bit_blocks != !mask.kv_bits)
    throw ArgumentError("kv_bit_blocks and kv_bits come together: pass both or neither");
  if (mask.kv_bits) {
    add("kv_bit_blocks", *mask.kv_bit_blocks, 3);
    add("kv_bits", *mask.kv_bits, 1);
    if (views_.at("kv_bit_blocks").shape != views_.at("kv_num_blocks").shape)
      throw ArgumentError("kv_bit_blocks " + shape_text(views_.at("kv_bit_blocks").shape) +
                          " must have the shape of kv_num_blocks " + shape_text(views_.at("kv_num_blocks").shape));
  }
}

// block_mask.py's _int32: an int32 array of `rank` axes.
void Lists::add(const std::string& name, const TensorView& view, std::size_t rank) {
  if (view.dtype != DType::int32) throw TypeError(name + " must be int32, got " + to_string(view.dtype));
  if (view.shape.size() != rank)
    throw ArgumentError(name + " must have " + std::to_string(rank) + " dimensions, got shape " +
                        shape_text(view.shape));
  views_[name] = checked(view, name);
  names_.push_back(name);
}

void Lists::check(const Declaration& declaration, std::int64_t B, std::int64_t Hq, std::int64_t R,
                  std::int64_t C) const {
  if (shape_ && *shape_ != std::make_pair(R, C))
    throw ArgumentError("block_mask.shape is " + pair_text(*shape_) + " but the problem has (R, C) = " +
                        pair_text({R, C}));
  std::map<std::string, const TensorView*> given;
  for (const std::string& name : names_) given[name] = views_.at(name).view;
  Binder binder(declaration, "bhsd", std::move(given),
                {{"B", B}, {"Hq", Hq}, {"R", R}, {"C", C}, {"Qb", block_size_.first}, {"Kb", block_size_.second}});
  binder.bind_sizes();
  binder.check_others();
}

std::map<std::string, std::int64_t> Lists::widths() const {
  std::map<std::string, std::int64_t> sizes;
  const std::pair<const char*, const char*> widths[] = {
      {"kv_indices", "Wp"}, {"full_kv_indices", "Wf"}, {"q_indices", "Wq"}, {"full_q_indices", "Wqf"}};
  for (const auto& [list, size] : widths)
    if (has(list)) sizes[size] = views_.at(list).shape[3];
  if (has("kv_bits")) sizes["Wb"] = views_.at("kv_bits").shape[0];
  return sizes;
}

std::map<std::string, Checked> Lists::bound(const Device& device) const {
  std::map<std::string, Checked> lists;
  for (const std::string& name : names_) {
    Checked view = views_.at(name);
    if (name != "kv_bits" && (view.shape[0] != lead_.first || view.shape[1] != lead_.second)) {
      std::vector<std::int64_t> target = view.shape;
      target[0] = lead_.first, target[1] = lead_.second;
      view = broadcast(view, target);
    }
    view_packing::make_addressable(device, view, view_packing::Reads::contiguous);
    lists.emplace(name, std::move(view));
  }
  return lists;
}

void apply_rule(const BlockMask& mask, const BlockSparseOptions& given, AttentionOptions& options) {
  if (!mask.rule) {
    options.causal = given.causal.value_or(Causal::none);
    options.window = given.window, options.mask = given.mask;
    return;
  }
  const BlockMaskRule& rule = *mask.rule;
  if (given.causal && *given.causal != rule.causal)
    throw ArgumentError("causal=" + causal_repr(*given.causal) + " contradicts the block mask's rule (from_mask with "
                        "causal=" + causal_repr(rule.causal) + "): omit causal, or pass the mask's");
  if (given.window && given.window != rule.window)
    throw ArgumentError("window=" + window_repr(given.window) + " contradicts the block mask's rule (from_mask with "
                        "window=" + window_repr(rule.window) + "): omit window, or pass the mask's");
  if (given.mask && !(rule.mask && same_values(*given.mask, *rule.mask)))
    throw ArgumentError("mask differs from the one the block mask was built from (from_mask's): omit mask, or pass "
                        "the same");
  options.causal = rule.causal, options.window = rule.window, options.mask = rule.mask;
}

}  // namespace mfa::block_mask
