// The race detector for threadgroup memory (sanitize="race"): the threads of
// a group take turns on one OS thread, so ThreadSanitizer cannot see their
// races; this records, per byte, the last writer and up to two readers since
// the last barrier that orders threadgroup memory, and finds a read after a
// write, a write after a read or a write after a write by different threads
// with no such barrier between them.
//
// Synchronization points: a threadgroup_barrier whose flags include
// mem_threadgroup orders every access before it against every access after
// it; a simdgroup_barrier with mem_threadgroup does so for the lanes of its
// simdgroup. Nothing else does: not barriers with other flags, not SIMD-group
// functions (simd_sum, shuffles, ...), whose lanes Metal does not order in
// memory. Atomics are not recorded (they do not race).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "shim/mfa_kernel_abi.h"

namespace mfa::cpu {

class RaceDetector {
 public:
  struct Access {
    std::uint32_t thread = kNoThread;  // index in the threadgroup
    std::uint64_t simdgroup_epoch = 0;  // its simdgroup's ordering barriers so far
    const char* file = nullptr;
    int line = 0;
    bool writes = false;
  };
  // Two accesses of one byte that race: `earlier` was recorded first.
  struct Race {
    std::size_t offset;  // byte of threadgroup memory
    Access earlier, later;
  };

  // A new threadgroup over `bytes` of memory, whose simdgroups count their
  // ordering barriers in `simdgroups` (SimdGroup::ordering_barriers): nothing
  // recorded before counts. Allocates the shadow only when first used.
  void begin_group(const mfa_abi::SimdGroup* simdgroups, std::size_t bytes);
  void threadgroup_barrier() { ++epoch_; }

  // Records that `thread` reads and/or writes bytes [offset, offset + bytes);
  // returns the first race it makes, if any.
  std::optional<Race> access(std::size_t offset, std::size_t bytes, bool reads, bool writes,
                             std::uint32_t thread, const char* file, int line);

 private:
  static constexpr std::uint32_t kNoThread = ~std::uint32_t(0);

  struct Byte {
    std::uint64_t epoch = 0;  // threadgroup barriers before the accesses below; older: forgotten
    Access writer;
    Access readers[2];
  };

  // Whether `earlier` is by another thread and not ordered before `thread`'s access.
  bool races(const Access& earlier, std::uint32_t thread) const;
  void add_reader(Byte& byte, const Access& reader) const;

  std::vector<Byte> shadow_;
  std::size_t bytes_ = 0;
  std::uint64_t epoch_ = 0;  // never reset: a new group or a barrier moves it on
  const mfa_abi::SimdGroup* simdgroups_ = nullptr;
};

}  // namespace mfa::cpu
