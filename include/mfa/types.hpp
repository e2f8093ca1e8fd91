// Small value types shared by the whole public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace mfa {

enum class DeviceKind { cpu, metal };

const char* to_string(DeviceKind kind);
DeviceKind device_kind_from_string(const std::string& name);  // throws ArgumentError

// A 1..3 dimensional extent (grid or threadgroup size); unused axes are 1.
struct Size3 {
  std::uint32_t x = 1, y = 1, z = 1;
  std::uint64_t volume() const { return std::uint64_t(x) * y * z; }
  bool operator==(const Size3& o) const { return x == o.x && y == o.y && z == o.z; }
};

// Metal's argument tables: [[buffer(0..30)]] and [[threadgroup(0..30)]].
constexpr int kMaxArgumentIndex = 30;
// Threadgroup memory lengths are rounded up to multiples of this (Metal requires it).
constexpr std::size_t kThreadgroupMemoryGranule = 16;
// DLPack's device type for Metal tensors (kDLMetal): DLTensor::data is an
// id<MTLBuffer>, byte_offset where the tensor starts in it.
constexpr int kDLPackMetal = 8;

// Limits every device reports; kernels are validated against them.
struct DeviceLimits {
  std::uint32_t max_threads_per_threadgroup = 1024;
  std::size_t max_threadgroup_memory = 32 * 1024;
  std::uint32_t simd_width = 32;
};

// A function constant value as the caller gives it; the backend converts it
// to the type the kernel declares (bool, integer types, half, bfloat, float).
using ConstantValue = std::variant<bool, std::int64_t, double>;

// Device memory one pointer argument ([[buffer(index)]] `device T*` or
// `constant T*`) moved in a dispatch: sizeof(T) per element loaded or stored.
struct BufferTraffic {
  int index = -1;
  std::string name;  // the kernel's argument name
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
};

// What one dispatch did. A field is empty when the backend cannot count it.
struct DispatchStats {
  std::string kernel;
  std::uint64_t threadgroups = 0;
  std::optional<std::uint64_t> simdgroup_matrix_ops;  // 8x8x8 multiply-accumulates, once per simdgroup
  std::optional<std::uint64_t> barriers;              // threadgroup barriers completed
  std::optional<double> seconds;                      // wall (cpu) or GPU timestamps (metal)
  // Every pointer buffer argument, by index; counted exactly by the cpu backend.
  std::optional<std::vector<BufferTraffic>> traffic;
};

}  // namespace mfa
