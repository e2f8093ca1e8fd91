// Where the dispatches of a batch depend on each other: a backend that runs
// dispatches concurrently (Metal's concurrent encoder) puts a memory barrier
// only before the dispatches that need one.
#pragma once

#include <vector>

#include "mfa/backend.hpp"

namespace mfa {

// For each dispatch, whether a barrier must come before it: it reads or
// writes memory that a dispatch since the last barrier wrote, or writes
// memory that such a dispatch read. A buffer argument is written unless the
// kernel declares it const (reflection); inline bytes are never shared.
// Memory is the same when the byte ranges of two bindings overlap (by host
// address, or within one storage when it has none). The first dispatch never
// needs a barrier.
std::vector<bool> barriers_before(const std::vector<Dispatch>& dispatches);

}  // namespace mfa
