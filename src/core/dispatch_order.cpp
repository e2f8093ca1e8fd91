#include "core/dispatch_order.hpp"

#include <cstdint>

#include "mfa/pipeline.hpp"

namespace mfa {
namespace {

// The bytes a binding lets a kernel reach: from its offset to the end of its buffer.
struct Access {
  const BufferStorage* storage;
  std::uintptr_t address;  // host address of the range, 0 when the storage has none (GPU-private)
  std::size_t begin, end;  // within the storage's buffer
  bool writes;

  std::uintptr_t address_begin() const { return address + begin; }
  std::uintptr_t address_end() const { return address + end; }

  bool overlaps(const Access& other) const {
    if (address != 0 && other.address != 0) {
      return address_begin() < other.address_end() && other.address_begin() < address_end();
    }
    // Without host addresses, only the storage says what is shared; two
    // address-less storages may be views of one allocation.
    if (storage != other.storage) return address == 0 && other.address == 0;
    return begin < other.end && other.begin < end;
  }
};

std::vector<Access> accesses_of(const Dispatch& dispatch) {
  std::vector<Access> accesses;
  for (const Binding& binding : dispatch.bindings) {
    if (!binding.buffer) continue;  // inline bytes: copied, never shared
    const ArgumentInfo* argument = dispatch.pipeline->function().buffer(binding.index);
    accesses.push_back({binding.buffer.storage(), reinterpret_cast<std::uintptr_t>(binding.buffer.data()),
                        binding.offset, binding.buffer.size(), argument == nullptr || !argument->is_const});
  }
  return accesses;
}

bool overlaps_any(const Access& access, const std::vector<Access>& others) {
  for (const Access& other : others) {
    if (access.overlaps(other)) return true;
  }
  return false;
}

}  // namespace

std::vector<bool> barriers_before(const std::vector<Dispatch>& dispatches) {
  std::vector<bool> barriers(dispatches.size(), false);
  std::vector<Access> since_barrier;  // every access of the dispatches since the last barrier
  std::vector<Access> written;        // the writing ones among them
  for (std::size_t i = 0; i < dispatches.size(); ++i) {
    const std::vector<Access> accesses = accesses_of(dispatches[i]);
    for (const Access& access : accesses) {
      if (overlaps_any(access, written) || (access.writes && overlaps_any(access, since_barrier))) {
        barriers[i] = true;
        since_barrier.clear();
        written.clear();
        break;
      }
    }
    for (const Access& access : accesses) {
      since_barrier.push_back(access);
      if (access.writes) written.push_back(access);
    }
  }
  return barriers;
}

}  // namespace mfa
