#include "mfa/types.hpp"

#include "mfa/errors.hpp"

namespace mfa {

const char* to_string(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::metal: return "metal";
  }
  return "unknown";
}

DeviceKind device_kind_from_string(const std::string& name) {
  if (name == "cpu") return DeviceKind::cpu;
  if (name == "metal") return DeviceKind::metal;
  throw ArgumentError("device kind must be 'cpu' or 'metal', got '" + name + "'");
}

}  // namespace mfa
