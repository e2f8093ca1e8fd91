#include "race_detector.hpp"

namespace mfa::cpu {

void RaceDetector::begin_group(const mfa_abi::SimdGroup* simdgroups, std::size_t bytes) {
  ++epoch_;
  bytes_ = bytes;
  simdgroups_ = simdgroups;
}

bool RaceDetector::races(const Access& earlier, std::uint32_t thread) const {
  if (earlier.thread == kNoThread || earlier.thread == thread) return false;
  const std::uint32_t simdgroup = earlier.thread / mfa_abi::kSimdWidth;
  const bool same_simdgroup = simdgroup == thread / mfa_abi::kSimdWidth;
  return !(same_simdgroup && earlier.simdgroup_epoch < simdgroups_[simdgroup].ordering_barriers);
}

// Keeps the reader's latest access, in its own slot, a free one, or one that
// is ordered before it (any access racing that one races this one too).
void RaceDetector::add_reader(Byte& byte, const Access& reader) const {
  for (Access& slot : byte.readers) {
    if (slot.thread == reader.thread) {
      slot = reader;
      return;
    }
  }
  for (Access& slot : byte.readers) {
    if (slot.thread == kNoThread || !races(slot, reader.thread)) {
      slot = reader;
      return;
    }
  }
}

std::optional<RaceDetector::Race> RaceDetector::access(std::size_t offset, std::size_t bytes, bool reads,
                                                       bool writes, std::uint32_t thread, const char* file,
                                                       int line) {
  if (shadow_.size() < bytes_) shadow_.resize(bytes_);
  const std::uint32_t simdgroup = thread / mfa_abi::kSimdWidth;
  const Access now{thread, simdgroups_[simdgroup].ordering_barriers, file, line, writes};
  for (std::size_t at = offset; at < offset + bytes; ++at) {
    Byte& byte = shadow_[at];
    if (byte.epoch != epoch_) byte = Byte{epoch_, {}, {}};
    if (races(byte.writer, thread)) return Race{at, byte.writer, now};
    if (writes) {
      for (const Access& reader : byte.readers) {
        if (races(reader, thread)) return Race{at, reader, now};
      }
      byte.writer = now;
    }
    if (reads) {
      Access reader = now;
      reader.writes = false;
      add_reader(byte, reader);
    }
  }
  return std::nullopt;
}

}  // namespace mfa::cpu
