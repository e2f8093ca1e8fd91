// MSL's minimal atomics: atomic_int, atomic_uint, atomic_float in device or
// threadgroup memory and the *_explicit functions. Threadgroups run in
// parallel on OS threads, so every operation is a real (sequentially
// consistent) atomic; each first lets the other threads of the group run, so
// a spin-wait on another thread of the group makes progress. Part of the shim metal_stdlib.
#pragma once

namespace metal {

enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst,
};

template <class T>
struct atomic {
  static_assert(std::is_same_v<T, int> || std::is_same_v<T, uint> || std::is_same_v<T, float> ||
                    std::is_same_v<T, bool> || std::is_same_v<T, ulong>,
                "MSL atomics hold int, uint, float, bool or ulong");

  T load() {
    T result;
    __atomic_load(&value_, &result, __ATOMIC_SEQ_CST);
    return result;
  }
  void store(T desired) { __atomic_store(&value_, &desired, __ATOMIC_SEQ_CST); }
  T exchange(T desired) {
    T previous;
    __atomic_exchange(&value_, &desired, &previous, __ATOMIC_SEQ_CST);
    return previous;
  }
  // On failure, `expected` receives the current value.
  bool compare_exchange(T& expected, T desired) {
    return __atomic_compare_exchange(&value_, &expected, &desired, /*weak=*/false,
                                     __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  }
  // Replaces the value v with modify(v) atomically; returns v.
  template <class Modify>
  T fetch_modify(Modify modify) {
    T expected = load();
    while (!compare_exchange(expected, modify(expected))) {
    }
    return expected;
  }

 private:
  T value_;
};

using atomic_int = atomic<int>;
using atomic_uint = atomic<uint>;
using atomic_float = atomic<float>;
using atomic_bool = atomic<bool>;

}  // namespace metal

namespace mfa_shim {

template <class X>
struct atomic_value {};
template <class T>
struct atomic_value<metal::atomic<T>> {
  using type = T;
};
// The value type of the atomic `object` points to (a plain or buffer pointer).
template <class Pointer>
using atomic_value_t = typename atomic_value<std::remove_cv_t<pointee_t<Pointer>>>::type;

// What an atomic operation does to its object, for the traffic counters.
enum class atomic_access { load, store, modify };

template <class T>
T& atomic_object(T* object, atomic_access) {
  return *object;
}
template <class T>
T& atomic_object(const buffer_ptr<T>& object, atomic_access access) {
  return object.access(0, access != atomic_access::store, access != atomic_access::load);
}
template <class T>
T& atomic_object(const threadgroup_ptr<T>& object, atomic_access) {
  // Atomics do not race: not recorded. Bounds checked like any access.
  if constexpr (bounds_checked) check_extent(object.extent(), object.address(), sizeof(T), object.site());
  return *object.address();
}

// Lets the rest of the group run, then yields the atomic the pointer designates.
template <class Pointer>
auto& atomic_target(Pointer object, atomic_access access, const char* op, const call_site& at) {
  mfa_abi::ThreadState* const thread = mfa_abi::current_thread;
  const mfa_abi::Site site{op, at.file, at.line, 0};
  thread->dispatch->runtime->yield(thread, &site);
  mfa_abi::current_thread = thread;
  return atomic_object(object, access);
}

}  // namespace mfa_shim

namespace metal {

template <class Pointer, class T = mfa_shim::atomic_value_t<Pointer>>
T atomic_load_explicit(Pointer object, memory_order,
                       mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::atomic_target(object, mfa_shim::atomic_access::load, "atomic_load_explicit", at)
      .load();
}

template <class Pointer, class U, class T = mfa_shim::atomic_value_t<Pointer>>
void atomic_store_explicit(Pointer object, U desired, memory_order,
                           mfa_shim::call_site at = mfa_shim::call_site()) {
  mfa_shim::atomic_target(object, mfa_shim::atomic_access::store, "atomic_store_explicit", at)
      .store(static_cast<T>(desired));
}

template <class Pointer, class U, class T = mfa_shim::atomic_value_t<Pointer>>
T atomic_exchange_explicit(Pointer object, U desired, memory_order,
                           mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::atomic_target(object, mfa_shim::atomic_access::modify, "atomic_exchange_explicit", at)
      .exchange(static_cast<T>(desired));
}

template <class Pointer, class U, class T = mfa_shim::atomic_value_t<Pointer>>
bool atomic_compare_exchange_weak_explicit(Pointer object, T* expected, U desired, memory_order,
                                           memory_order,
                                           mfa_shim::call_site at = mfa_shim::call_site()) {
  return mfa_shim::atomic_target(object, mfa_shim::atomic_access::modify,
                                 "atomic_compare_exchange_weak_explicit", at)
      .compare_exchange(*expected, static_cast<T>(desired));
}

#define MFA_ATOMIC_FETCH(name, expression)                                                      \
  template <class Pointer, class U, class T = mfa_shim::atomic_value_t<Pointer>>                \
  T atomic_fetch_##name##_explicit(Pointer object, U operand, memory_order,                     \
                                   mfa_shim::call_site at = mfa_shim::call_site()) {            \
    const T y = static_cast<T>(operand);                                                        \
    return mfa_shim::atomic_target(object, mfa_shim::atomic_access::modify,                     \
                                 "atomic_fetch_" #name "_explicit", at)                         \
        .fetch_modify([y](T x) { return static_cast<T>(expression); });                         \
  }
MFA_ATOMIC_FETCH(add, x + y)
MFA_ATOMIC_FETCH(sub, x - y)
MFA_ATOMIC_FETCH(min, min(x, y))
MFA_ATOMIC_FETCH(max, max(x, y))
MFA_ATOMIC_FETCH(and, x & y)
MFA_ATOMIC_FETCH(or, x | y)
MFA_ATOMIC_FETCH(xor, x ^ y)
#undef MFA_ATOMIC_FETCH

}  // namespace metal
