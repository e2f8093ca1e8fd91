// Threadgroup memory in the checking modes: the race detector
// (MFA_SHIM_RACE_CHECK defined, `sanitize="race"`) and exact array bounds
// (MFA_SHIM_BOUNDS_CHECK, `bounds_check=True`; see mfa_arrays.h). The front end
// rewrites every pointer type spelled `threadgroup T*` into
// mfa_shim::threadgroup_ptr<T>, and kernel-scope threadgroup variables into
// threadgroup_ptrs (arrays, decayed) or writable elements (scalars). With the
// race detector every access tells the executor which bytes the thread reads
// or writes, and at which line; with bounds checks every access is checked
// against the extent of the array or [[threadgroup(i)]] block the pointer was
// made from. Outside those modes these types are not used. Part of the shim
// metal_stdlib.
//
// The rules of mfa_buffer_ptr.h apply to threadgroup memory in these modes
// (members of a writable element do not compile, ...), and:
// - p[i] records the line of the expression; *p and p->m record the line
//   where p was made (its binding, declaration or cast). A kernel-scope
//   scalar `threadgroup T x;` records the line of its declaration.
// - Atomics are not recorded (atomic operations do not race), but are
//   bounds checked.
// - simdgroup_load / simdgroup_store record each lane's two elements at the
//   line of the call.
#pragma once

#include "mfa_arrays.h"  // sited_index, array_extent

namespace mfa_shim {

#ifdef MFA_SHIM_RACE_CHECK
inline constexpr bool race_checked = true;
#else
inline constexpr bool race_checked = false;
#endif

// Threadgroup memory goes through threadgroup_ptr in either checking mode.
inline constexpr bool threadgroup_checked = race_checked || bounds_checked;

// Tells the race detector about one access (see mfa_abi::Runtime::race_access).
inline void record_threadgroup_access(const void* address, size_t bytes, unsigned access,
                                      const call_site& at) {
  mfa_abi::ThreadState* const thread = mfa_abi::current_thread;
  const mfa_abi::Site site{"threadgroup memory", at.file, at.line, 0};
  thread->dispatch->runtime->race_access(thread, address, bytes, access, &site);
}

template <class T>
class threadgroup_ptr : public pointer_operators<threadgroup_ptr<T>> {
  using row = std::remove_extent_t<T>;

 public:
  using element_type = T;
  // p[i] of a pointer to rows (a 2-D variable) is the row, itself a pointer.
  using reference = std::conditional_t<
      std::is_array_v<T>, threadgroup_ptr<row>,
      std::conditional_t<std::is_const_v<T>, std::add_lvalue_reference_t<T>, writable_element<threadgroup_ptr>>>;

  threadgroup_ptr() = default;
  threadgroup_ptr(std::nullptr_t) {}
  // A pointer that is not bounds checked (its extent is unknown).
  explicit threadgroup_ptr(T* address, call_site at = call_site()) : address_(address), at_(at) {}
  // A pointer into an array or [[threadgroup(i)]] block.
  threadgroup_ptr(T* address, const array_extent& extent, call_site at = call_site())
      : address_(address), extent_(extent), at_(at) {}
  // threadgroup_ptr<float> -> threadgroup_ptr<const float>.
  template <class U, std::enable_if_t<std::is_convertible_v<U*, T*>, int> = 0>
  threadgroup_ptr(const threadgroup_ptr<U>& other)
      : address_(other.address()), extent_(other.extent()), at_(other.site()) {}
  // Casts: (threadgroup float4*)p, ... (checked against the same extent).
  template <class U, std::enable_if_t<!std::is_convertible_v<U*, T*>, int> = 0>
  explicit threadgroup_ptr(const threadgroup_ptr<U>& other, call_site at = call_site())
      : address_(reinterpret_cast<T*>(const_cast<std::remove_cv_t<U>*>(other.address()))),
        extent_(other.extent()),
        at_(at) {}

  reference operator*() const { return (*this)[sited_index(0, at_.file, at_.line)]; }
  reference operator[](sited_index i) const {
    threadgroup_ptr element = moved(i.index);
    element.at_ = i.at;
    if constexpr (std::is_array_v<T>) {
      // The row, checked as a whole here; its own subscripts check against the row.
      if constexpr (bounds_checked) check_extent(extent_, element.address_, sizeof(T), i.at);
      const array_extent row_extent{extent_.declaration, reinterpret_cast<uintptr_t>(element.address_), sizeof(T),
                                    sizeof(std::remove_extent_t<T>)};
      return reference(reinterpret_cast<row*>(element.address_), row_extent, i.at);
    } else if constexpr (std::is_const_v<T>) {
      return element.access(0, true, false);
    } else {
      return reference(element);
    }
  }
  T* operator->() const {
    static_assert(std::is_const_v<T>,
                  "p->member through a writable threadgroup pointer is neither a read nor a write "
                  "to the race detector: copy the element (T e = p[i]; ... p[i] = e;) or read through "
                  "a const pointer (see mfa_threadgroup_ptr.h)");
    return &access(0, true, false);
  }

  // The element `i` places on, recorded as read and/or written.
  T& access(ptrdiff_t i, bool reads, bool writes) const {
    T* const element = moved(i).address_;
    if constexpr (bounds_checked) check_extent(extent_, element, sizeof(T), at_);
    if constexpr (race_checked) {
      record_threadgroup_access(element, sizeof(T),
                                (reads ? mfa_abi::kAccessRead : 0) | (writes ? mfa_abi::kAccessWrite : 0), at_);
    }
    return *element;
  }

  T* address() const { return address_; }
  const array_extent& extent() const { return extent_; }
  const call_site& site() const { return at_; }
  threadgroup_ptr moved(ptrdiff_t n) const {
    threadgroup_ptr result = *this;
    result.address_ = reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(address_) + n * ptrdiff_t(sizeof(T)));
    return result;
  }

 private:
  T* address_ = nullptr;
  array_extent extent_;
  call_site at_{nullptr, 0};
};

// Element `i` of what `p` points to, recorded at `at` for threadgroup memory
// (simdgroup_load / simdgroup_store name their caller's line).
template <class Pointer>
decltype(auto) element_at(const Pointer& p, size_t i, const call_site&) {
  return p[i];
}
template <class T>
decltype(auto) element_at(const threadgroup_ptr<T>& p, size_t i, const call_site& at) {
  return p[sited_index(i, at.file, at.line)];
}

// Storage for a kernel-scope `threadgroup T name;` (see threadgroup_alloc):
// the variable itself, or in the checking modes an array's decayed
// threadgroup_ptr or a scalar's writable element, which know `declaration`
// ("threadgroup float tile[64]").
template <class T>
decltype(auto) threadgroup_variable(const char* declaration, call_site at = call_site()) {
  void* const storage = threadgroup_alloc(sizeof(T), alignof(T));
  const auto base = reinterpret_cast<uintptr_t>(storage);
  if constexpr (!threadgroup_checked) {
    return *static_cast<T*>(storage);
  } else if constexpr (std::is_array_v<T>) {
    using element = std::remove_extent_t<T>;
    return threadgroup_ptr<element>(static_cast<element*>(storage), array_extent{declaration, base, sizeof(T),
                                                                                  sizeof(element)}, at);
  } else {
    return writable_element<threadgroup_ptr<T>>(
        threadgroup_ptr<T>(static_cast<T*>(storage), array_extent{declaration, base, sizeof(T), sizeof(T)}, at));
  }
}

// A `threadgroup T* name [[threadgroup(i)]]` argument in the checking modes:
// the block is `bytes` long (the dispatch's threadgroup_memory[i]).
template <class T>
threadgroup_ptr<T> threadgroup_argument(T* address, size_t bytes, const char* declaration) {
  constexpr size_t element_bytes = std::is_void_v<T> ? 1 : sizeof(std::conditional_t<std::is_void_v<T>, char, T>);
  return threadgroup_ptr<T>(address, array_extent{declaration, reinterpret_cast<uintptr_t>(address), bytes,
                                                  element_bytes});
}

}  // namespace mfa_shim
