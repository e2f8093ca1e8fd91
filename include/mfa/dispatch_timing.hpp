// Asking every backend for each dispatch's seconds. The cpu backend measures
// them always; Metal only while asked (it then gives each dispatch its own
// compute encoder and samples GPU timestamps around it), so normal calls pay
// nothing. mfa_native.profile() asks while its block is active; the tuner
// times candidates inside such a block.
#pragma once

namespace mfa {

// While at least one DispatchTiming is alive (in any thread), batches commit
// with per-dispatch timing.
class DispatchTiming {
 public:
  DispatchTiming();
  ~DispatchTiming();
  DispatchTiming(const DispatchTiming&) = delete;
  DispatchTiming& operator=(const DispatchTiming&) = delete;

  static bool requested();
};

}  // namespace mfa
