// SIMD-group functions and barriers, run through the executor's Runtime (see
// mfa_kernel_abi.h for the protocol). Part of the shim metal_stdlib.
#pragma once

namespace mfa_shim {

template <class T>
void write_slot(unsigned char* slot, const T& value) {
  static_assert(sizeof(T) <= mfa_abi::kSlotBytes, "operand too large for a simdgroup collective");
  std::memcpy(slot, static_cast<const void*>(&value), sizeof(T));
}

template <class T>
T read_slot(const unsigned char* slot) {
  T value;
  std::memcpy(static_cast<void*>(&value), slot, sizeof(T));
  return value;
}

template <class F>
void for_each_active_lane(const mfa_abi::SimdGroup& simd, F f) {
  for (unsigned lane = 0; lane < mfa_abi::kSimdWidth; ++lane) {
    if ((simd.active >> lane) & 1u) f(lane);
  }
}

// Meets the other lanes of the simdgroup at `op`; the one lane the runtime
// picks runs compute(simd, thread) while the others wait.
template <class Compute>
void synchronize_simdgroup(const char* op, const call_site& at, int full, Compute compute) {
  mfa_abi::ThreadState* const thread = mfa_abi::current_thread;
  const mfa_abi::Site site{op, at.file, at.line, 0};
  const mfa_abi::Runtime& runtime = *thread->dispatch->runtime;
  if (runtime.simd_arrive(thread, &site, full)) {
    mfa_abi::current_thread = thread;
    compute(*thread->simd, thread);
    runtime.simd_release(thread);
  }
  mfa_abi::current_thread = thread;
}

// A collective: each lane brings `operand` in its in[] slot; compute fills the
// out[] slot of every active lane; each lane returns its own out[] as Out.
template <class Out, class In, class Compute>
Out collective(const char* op, const call_site& at, int full, const In& operand, Compute compute) {
  mfa_abi::ThreadState* const thread = mfa_abi::current_thread;
  const unsigned lane = thread->thread_index_in_simdgroup;
  write_slot(thread->simd->in[lane], operand);
  synchronize_simdgroup(op, at, full, compute);
  return read_slot<Out>(thread->simd->out[lane]);
}

// The type a collective works on: vectors for swizzles, else the type itself.
template <class T>
using operand_t = typename vec_traits<T>::value;

template <class T>
void check_operand() {
  static_assert(is_scalar_v<T> || is_vector_v<T>, "SIMD-group functions take scalars and vectors");
}

// Every active lane gets `combine` folded over the active lanes in lane order.
template <class T, class Combine>
T reduce(const char* op, const call_site& at, const T& value, Combine combine) {
  check_operand<T>();
  return collective<T>(op, at, 0, value, [&](mfa_abi::SimdGroup& simd, mfa_abi::ThreadState*) {
    T total{};
    bool first = true;
    for_each_active_lane(simd, [&](unsigned lane) {
      const T operand = read_slot<T>(simd.in[lane]);
      total = first ? operand : static_cast<T>(combine(total, operand));
      first = false;
    });
    for_each_active_lane(simd, [&](unsigned lane) { write_slot(simd.out[lane], total); });
  });
}

// Sum over the active lanes before this one (exclusive) or up to it (inclusive).
template <class T>
T prefix_sum(const char* op, const call_site& at, const T& value, bool inclusive) {
  check_operand<T>();
  return collective<T>(op, at, 0, value, [&](mfa_abi::SimdGroup& simd, mfa_abi::ThreadState*) {
    T running = static_cast<T>(0);
    for_each_active_lane(simd, [&](unsigned lane) {
      const T operand = read_slot<T>(simd.in[lane]);
      if (inclusive) running = static_cast<T>(running + operand);
      write_slot(simd.out[lane], running);
      if (!inclusive) running = static_cast<T>(running + operand);
    });
  });
}

inline constexpr int kKeepOwnValue = -1;

template <class T>
struct shuffle_operand {
  T value;
  int source_lane;  // kKeepOwnValue: the source is outside the simdgroup
};

// Each lane reads the value of its source lane. A source that is an inactive
// lane (or no lane at all) fails the dispatch: Metal leaves it undefined.
template <class T>
T shuffle(const char* op, const call_site& at, const T& value, int source_lane) {
  check_operand<T>();
  using Operand = shuffle_operand<T>;
  return collective<T>(op, at, 0, Operand{value, source_lane},
                       [&](mfa_abi::SimdGroup& simd, mfa_abi::ThreadState* thread) {
    for_each_active_lane(simd, [&](unsigned lane) {
      const int source = read_slot<Operand>(simd.in[lane]).source_lane;
      const unsigned from = source == kKeepOwnValue ? lane : static_cast<unsigned>(source);
      if (from >= mfa_abi::kSimdWidth || !((simd.active >> from) & 1u)) {
        char message[200];
        std::snprintf(message, sizeof message,
                      "%s at %s:%d: lane %u reads lane %d, which is not an active lane of its "
                      "simdgroup (active lanes 0x%08x)",
                      op, at.file, at.line, lane, source, static_cast<unsigned>(simd.active));
        fail(thread, message);
      }
      write_slot(simd.out[lane], read_slot<Operand>(simd.in[from]).value);
    });
  });
}

// A ballot: bit l of `votes` is set when active lane l's predicate is true.
struct ballot_result {
  uint32_t votes;
  uint32_t active;
};

inline ballot_result ballot(const char* op, const call_site& at, bool predicate) {
  return collective<ballot_result>(op, at, 0, predicate,
                                   [](mfa_abi::SimdGroup& simd, mfa_abi::ThreadState*) {
    ballot_result result{0, simd.active};
    for_each_active_lane(simd, [&](unsigned lane) {
      if (read_slot<bool>(simd.in[lane])) result.votes |= 1u << lane;
    });
    for_each_active_lane(simd, [&](unsigned lane) { write_slot(simd.out[lane], result); });
  });
}

}  // namespace mfa_shim

namespace metal {

// simd_ballot's result: explicitly convertible to its lane mask, as in MSL
// (`(simd_vote::vote_t)simd_ballot(c)`).
class simd_vote {
 public:
  using vote_t = ulong;
  explicit constexpr simd_vote(vote_t votes = 0, vote_t active = ~vote_t(0))
      : votes_(votes), active_(active) {}
  explicit constexpr operator vote_t() const { return votes_; }
  constexpr bool any() const { return votes_ != 0; }
  constexpr bool all() const { return votes_ == active_; }  // every active lane voted true

 private:
  vote_t votes_;
  vote_t active_;
};

template <class T>
mfa_shim::operand_t<T> simd_sum(const T& x, mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::reduce<mfa_shim::operand_t<T>>("simd_sum", at, x,
                                                  [](const auto& a, const auto& b) { return a + b; });
}
template <class T>
mfa_shim::operand_t<T> simd_product(const T& x, mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::reduce<mfa_shim::operand_t<T>>("simd_product", at, x,
                                                  [](const auto& a, const auto& b) { return a * b; });
}
template <class T>
mfa_shim::operand_t<T> simd_max(const T& x, mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::reduce<mfa_shim::operand_t<T>>("simd_max", at, x,
                                                  [](const auto& a, const auto& b) { return max(a, b); });
}
template <class T>
mfa_shim::operand_t<T> simd_min(const T& x, mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::reduce<mfa_shim::operand_t<T>>("simd_min", at, x,
                                                  [](const auto& a, const auto& b) { return min(a, b); });
}
template <class T>
mfa_shim::operand_t<T> simd_and(const T& x, mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::reduce<mfa_shim::operand_t<T>>("simd_and", at, x,
                                                  [](const auto& a, const auto& b) { return a & b; });
}
template <class T>
mfa_shim::operand_t<T> simd_or(const T& x, mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::reduce<mfa_shim::operand_t<T>>("simd_or", at, x,
                                                  [](const auto& a, const auto& b) { return a | b; });
}
template <class T>
mfa_shim::operand_t<T> simd_xor(const T& x, mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::reduce<mfa_shim::operand_t<T>>("simd_xor", at, x,
                                                  [](const auto& a, const auto& b) { return a ^ b; });
}

template <class T>
mfa_shim::operand_t<T> simd_prefix_inclusive_sum(const T& x,
                                                 mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::prefix_sum<mfa_shim::operand_t<T>>("simd_prefix_inclusive_sum", at, x, true);
}
template <class T>
mfa_shim::operand_t<T> simd_prefix_exclusive_sum(const T& x,
                                                 mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::prefix_sum<mfa_shim::operand_t<T>>("simd_prefix_exclusive_sum", at, x, false);
}

template <class T>
mfa_shim::operand_t<T> simd_shuffle(const T& x, ushort lane,
                                    mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::shuffle<mfa_shim::operand_t<T>>("simd_shuffle", at, x, lane);
}
template <class T>
mfa_shim::operand_t<T> simd_broadcast(const T& x, ushort lane,
                                      mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::shuffle<mfa_shim::operand_t<T>>("simd_broadcast", at, x, lane);
}
template <class T>
mfa_shim::operand_t<T> simd_shuffle_xor(const T& x, ushort mask,
                                        mfa_shim::call_site at = mfa_shim::call_site()) {
  const int lane = static_cast<int>(mfa_abi::current_thread->thread_index_in_simdgroup);
  return mfa_shim::shuffle<mfa_shim::operand_t<T>>("simd_shuffle_xor", at, x, lane ^ mask);
}
// Lanes whose source would be below lane 0 keep their own value.
template <class T>
mfa_shim::operand_t<T> simd_shuffle_up(const T& x, ushort delta,
                                       mfa_shim::call_site at = mfa_shim::call_site()) {
  const int lane = static_cast<int>(mfa_abi::current_thread->thread_index_in_simdgroup);
  const int source = lane - delta >= 0 ? lane - delta : mfa_shim::kKeepOwnValue;
  return mfa_shim::shuffle<mfa_shim::operand_t<T>>("simd_shuffle_up", at, x, source);
}
// Lanes whose source would be past the last lane keep their own value.
template <class T>
mfa_shim::operand_t<T> simd_shuffle_down(const T& x, ushort delta,
                                         mfa_shim::call_site at = mfa_shim::call_site()) {
  const int lane = static_cast<int>(mfa_abi::current_thread->thread_index_in_simdgroup);
  const int width = static_cast<int>(mfa_abi::kSimdWidth);
  const int source = lane + delta < width ? lane + delta : mfa_shim::kKeepOwnValue;
  return mfa_shim::shuffle<mfa_shim::operand_t<T>>("simd_shuffle_down", at, x, source);
}

inline simd_vote simd_ballot(bool predicate, mfa_shim::call_site at = mfa_shim::call_site()) {
  const mfa_shim::ballot_result result = mfa_shim::ballot("simd_ballot", at, predicate);
  return simd_vote(result.votes, result.active);
}
inline simd_vote simd_active_threads_mask(mfa_shim::call_site at = mfa_shim::call_site()) {
  const mfa_shim::ballot_result result = mfa_shim::ballot("simd_active_threads_mask", at, true);
  return simd_vote(result.active, result.active);
}
inline bool simd_all(bool predicate, mfa_shim::call_site at = mfa_shim::call_site()) {
  const mfa_shim::ballot_result result = mfa_shim::ballot("simd_all", at, predicate);
  return result.votes == result.active;
}
inline bool simd_any(bool predicate, mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::ballot("simd_any", at, predicate).votes != 0;
}

// Memory scopes of a barrier. Every barrier orders all memory on the CPU;
// the race detector counts only those with mem_threadgroup as ordering
// threadgroup memory, as Metal does.
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
constexpr mem_flags operator&(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) & static_cast<unsigned>(b));
}

constexpr uint32_t barrier_orders(mem_flags flags) {
  return (flags & mem_flags::mem_threadgroup) != mem_flags::mem_none ? mfa_abi::kOrdersThreadgroupMemory : 0;
}

inline void threadgroup_barrier(mem_flags flags, mfa_shim::call_site at = mfa_shim::call_site()) {
  mfa_abi::ThreadState* const thread = mfa_abi::current_thread;
  const mfa_abi::Site site{"threadgroup_barrier", at.file, at.line, barrier_orders(flags)};
  thread->dispatch->runtime->threadgroup_barrier(thread, &site);
  mfa_abi::current_thread = thread;
}

inline void simdgroup_barrier(mem_flags flags, mfa_shim::call_site at = mfa_shim::call_site()) {
  const bool orders = barrier_orders(flags) != 0;
  mfa_shim::synchronize_simdgroup("simdgroup_barrier", at, 0,
                                  [orders](mfa_abi::SimdGroup& simd, mfa_abi::ThreadState*) {
                                    if (orders) ++simd.ordering_barriers;
                                  });
}

}  // namespace metal
