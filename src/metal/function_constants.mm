#include "metal/function_constants.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <variant>

#include "mfa/errors.hpp"

namespace mfa::metal {

namespace {

using Setter = void (*)(MTLFunctionConstantValues* values, NSUInteger index, const ConstantValue& value);

// The core already checked that the value fits the declared type; this only converts.
template <typename T, MTLDataType type>
MFA_METAL_AVAILABILITY void set_as(MTLFunctionConstantValues* values, NSUInteger index, const ConstantValue& value) {
  const T typed = std::visit([](auto v) { return static_cast<T>(v); }, value);
  [values setConstantValue:&typed type:type atIndex:index];
}

// bfloat is the upper half of a float, rounded to nearest even.
std::uint16_t to_bfloat_bits(float value) {
  if (std::isnan(value)) return 0x7fc0;
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<std::uint16_t>(bits >> 16);
}

MFA_METAL_AVAILABILITY void set_bfloat(MTLFunctionConstantValues* values, NSUInteger index,
                                       const ConstantValue& value) {
  const std::uint16_t bits = to_bfloat_bits(std::visit([](auto v) { return static_cast<float>(v); }, value));
  [values setConstantValue:&bits type:MTLDataTypeBFloat atIndex:index];
}

// Every scalar type MSL allows for a function constant, under each spelling
// reflection may report.
MFA_METAL_AVAILABILITY const std::map<std::string, Setter>& setters() {
  static const std::map<std::string, Setter> table = {
      {"bool", &set_as<bool, MTLDataTypeBool>},
      {"char", &set_as<std::int8_t, MTLDataTypeChar>},
      {"int8_t", &set_as<std::int8_t, MTLDataTypeChar>},
      {"uchar", &set_as<std::uint8_t, MTLDataTypeUChar>},
      {"uint8_t", &set_as<std::uint8_t, MTLDataTypeUChar>},
      {"short", &set_as<std::int16_t, MTLDataTypeShort>},
      {"int16_t", &set_as<std::int16_t, MTLDataTypeShort>},
      {"ushort", &set_as<std::uint16_t, MTLDataTypeUShort>},
      {"uint16_t", &set_as<std::uint16_t, MTLDataTypeUShort>},
      {"int", &set_as<std::int32_t, MTLDataTypeInt>},
      {"int32_t", &set_as<std::int32_t, MTLDataTypeInt>},
      {"uint", &set_as<std::uint32_t, MTLDataTypeUInt>},
      {"uint32_t", &set_as<std::uint32_t, MTLDataTypeUInt>},
      {"long", &set_as<std::int64_t, MTLDataTypeLong>},
      {"int64_t", &set_as<std::int64_t, MTLDataTypeLong>},
      {"ulong", &set_as<std::uint64_t, MTLDataTypeULong>},
      {"uint64_t", &set_as<std::uint64_t, MTLDataTypeULong>},
      {"half", &set_as<_Float16, MTLDataTypeHalf>},
      {"bfloat", &set_bfloat},
      {"float", &set_as<float, MTLDataTypeFloat>},
  };
  return table;
}

}  // namespace

MTLFunctionConstantValues* make_constant_values(const FunctionInfo& function,
                                                const std::map<int, ConstantValue>& constants) {
  MTLFunctionConstantValues* values = [MTLFunctionConstantValues new];
  for (const auto& [index, value] : constants) {
    const FunctionConstantInfo* declared = nullptr;
    for (const FunctionConstantInfo& constant : function.constants)
      if (constant.index == index) declared = &constant;
    if (!declared)
      throw ArgumentError("kernel '" + function.name + "' declares no function constant with index " +
                          std::to_string(index));
    auto setter = setters().find(declared->type);
    if (setter == setters().end())
      throw ArgumentError("kernel '" + function.name + "': function constant '" + declared->name + "' has type '" +
                          declared->type + "'; the Metal backend sets scalar bool, integer, half, bfloat and float "
                          "constants only");
    setter->second(values, static_cast<NSUInteger>(index), value);
  }
  return values;
}

}  // namespace mfa::metal
