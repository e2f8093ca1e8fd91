// Threadgroup memory in the race-checking mode (MFA_SHIM_RACE_CHECK defined,
// `sanitize="race"`): the front end rewrites every pointer type spelled
// `threadgroup T*` into mfa_shim::threadgroup_ptr<T>, and kernel-scope
// threadgroup variables into threadgroup_ptrs (arrays, decayed) or writable
// elements (scalars). Every access then tells the executor's race detector
// which bytes the thread reads or writes, and at which line. Outside that
// mode these types are not used. Part of the shim metal_stdlib.
//
// The rules of mfa_buffer_ptr.h apply to threadgroup memory in this mode
// (members of a writable element do not compile, ...), and:
// - p[i] records the line of the expression; *p and p->m record the line
//   where p was made (its binding, declaration or cast). A kernel-scope
//   scalar `threadgroup T x;` records the line of its declaration.
// - Atomics are not recorded: atomic operations do not race.
// - simdgroup_load / simdgroup_store record each lane's two elements at the
//   line of the call.
#pragma once

namespace mfa_shim {

#ifdef MFA_SHIM_RACE_CHECK
inline constexpr bool race_checked = true;
#else
inline constexpr bool race_checked = false;
#endif

// An index that knows where it was written: the default arguments of a
// converting constructor are evaluated where the conversion happens, in
// the kernel's (#line'd) text.
struct sited_index {
  template <class I, std::enable_if_t<std::is_convertible_v<I, ptrdiff_t>, int> = 0>
  sited_index(const I& i, const char* file = __builtin_FILE(), int line = __builtin_LINE())
      : index(static_cast<ptrdiff_t>(i)), at(file, line) {}
  ptrdiff_t index;
  call_site at;
};

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
  explicit threadgroup_ptr(T* address, call_site at = call_site()) : address_(address), at_(at) {}
  // threadgroup_ptr<float> -> threadgroup_ptr<const float>.
  template <class U, std::enable_if_t<std::is_convertible_v<U*, T*>, int> = 0>
  threadgroup_ptr(const threadgroup_ptr<U>& other) : address_(other.address()), at_(other.site()) {}
  // Casts: (threadgroup float4*)p, ...
  template <class U, std::enable_if_t<!std::is_convertible_v<U*, T*>, int> = 0>
  explicit threadgroup_ptr(const threadgroup_ptr<U>& other, call_site at = call_site())
      : address_(reinterpret_cast<T*>(const_cast<std::remove_cv_t<U>*>(other.address()))), at_(at) {}

  reference operator*() const { return (*this)[sited_index(0, at_.file, at_.line)]; }
  reference operator[](sited_index i) const {
    threadgroup_ptr element = moved(i.index);
    element.at_ = i.at;
    if constexpr (std::is_array_v<T>) {
      return reference(reinterpret_cast<row*>(element.address_), i.at);
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
    if constexpr (race_checked) {
      record_threadgroup_access(element, sizeof(T),
                                (reads ? mfa_abi::kAccessRead : 0) | (writes ? mfa_abi::kAccessWrite : 0), at_);
    }
    return *element;
  }

  T* address() const { return address_; }
  const call_site& site() const { return at_; }
  threadgroup_ptr moved(ptrdiff_t n) const {
    threadgroup_ptr result = *this;
    result.address_ = reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(address_) + n * ptrdiff_t(sizeof(T)));
    return result;
  }

 private:
  T* address_ = nullptr;
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
// the variable itself, or in the race-checking mode an array's decayed
// threadgroup_ptr or a scalar's writable element.
template <class T>
decltype(auto) threadgroup_variable(call_site at = call_site()) {
  void* const storage = threadgroup_alloc(sizeof(T), alignof(T));
  if constexpr (!race_checked) {
    return *static_cast<T*>(storage);
  } else if constexpr (std::is_array_v<T>) {
    using element = std::remove_extent_t<T>;
    return threadgroup_ptr<element>(static_cast<element*>(storage), at);
  } else {
    return writable_element<threadgroup_ptr<T>>(threadgroup_ptr<T>(static_cast<T*>(storage), at));
  }
}

}  // namespace mfa_shim
