#include "mfa/dispatch_timing.hpp"

#include <atomic>

namespace mfa {

namespace {

std::atomic<int>& requests() {
  static std::atomic<int> count{0};
  return count;
}

}  // namespace

DispatchTiming::DispatchTiming() { ++requests(); }

DispatchTiming::~DispatchTiming() { --requests(); }

bool DispatchTiming::requested() { return requests().load() > 0; }

}  // namespace mfa
