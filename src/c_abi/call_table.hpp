// The ops the C ABI (include/mfa/mfa.h) runs, as tables: per op, one row per
// argument (its Python name, the setters it takes, whether it is required, and
// for an option how its value lands in the op's options) and the C++ function
// the op's values are handed to. The generic binder driven by each op's
// declaration replaces these rows; the C functions stay as they are.
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "mfa/attention.hpp"
#include "mfa/block_sparse.hpp"
#include "mfa/int8.hpp"
#include "mfa/kvcache.hpp"
#include "mfa/merge.hpp"
#include "mfa/quantize.hpp"
#include "mfa/sparse.hpp"
#include "mfa/varlen.hpp"

namespace mfa::c_abi {

// A quantized tensor as C gives it: its format and data (the logical dtype is q's), and an
// affine one's scales, biases, bits and group size (mfa_call_set_quantized_affine).
struct Quantized {
  std::string format;
  TensorView data;
  std::optional<TensorView> scales{}, biases{};
  std::optional<std::int64_t> bits{}, group_size{};
};

// The setter a value came through: Value's alternatives, in this order.
enum class Kind { tensor, tensors, real, integer, boolean, text, int_pair, quantized };
constexpr Kind kKinds[] = {Kind::tensor, Kind::tensors, Kind::real,     Kind::integer,
                           Kind::boolean, Kind::text,  Kind::int_pair, Kind::quantized};
using Value = std::variant<TensorView, std::vector<TensorView>, double, std::int64_t, bool, std::string,
                           std::pair<std::int64_t, std::int64_t>, Quantized>;

constexpr unsigned bit(Kind kind) { return 1u << unsigned(kind); }
const char* setter_name(Kind kind);  // "mfa_call_set_float", ...

struct Op;

// The values a call was given, by argument name.
class Given {
 public:
  Given(const Op& op, const std::map<std::string, Value>& values) : op_(op), values_(values) {}
  const TensorView& tensor(const std::string& name) const;   // a required tensor (checked before run)
  const TensorView* optional_tensor(const std::string& name) const;
  // An argument the op reads itself (not an AttentionOptions field): its value, or `otherwise`.
  template <class T>
  T value(const std::string& name, T otherwise) const {
    auto it = values_.find(name);
    return it == values_.end() ? otherwise : std::get<T>(it->second);
  }
  // The value of an argument (null: not given).
  const Value* find(const std::string& name) const;
  // An integer argument the op reads itself (nullopt: not given).
  std::optional<std::int64_t> integer(const std::string& name) const;
  // A required list of tensors.
  const std::vector<TensorView>& tensors(const std::string& name) const;
  // A required cache: a tensor, or a quantized tensor of `dtype` (q's).
  KVCache cache(const std::string& name, DType dtype) const;
  // The op's options: every option row applied to the values given.
  AttentionOptions options() const;

 private:
  const Op& op_;
  const std::map<std::string, Value>& values_;
};

struct Param {
  const char* name;
  unsigned kinds;   // bit(kind) per setter the argument takes
  bool required;
  // An option: stores `value` in `options`, throwing as Python does for a bad
  // value; nullptr for a tensor or flag the op's function takes by name.
  void (*option)(const Value& value, AttentionOptions& options);
};

struct Op {
  const char* name;
  std::vector<Param> params;
  void (*run)(const Device& device, const Bundle& bundle, const Given& given);
  // The op encoded into a caller's id<MTLCommandBuffer> (include/mfa/metal.hpp);
  // nullptr where this build has no Metal backend.
  std::shared_future<void> (*encode_metal)(const Device& device, const Bundle& bundle, const Given& given,
                                           void* command_buffer);

  const Param* param(const std::string& name) const;
};

// nullptr when there is no op of that name.
const Op* find_op(const std::string& name);
std::string op_names();  // "attention, attention_backward"

}  // namespace mfa::c_abi
