// Pointers into [[buffer(i)]] arguments. The front end rewrites every pointer
// type spelled `device T*` or `constant T*` (kernel and helper parameters,
// locals, casts) into mfa_shim::buffer_ptr<T>, which counts the bytes each
// access reads and writes against its buffer (in the thread's own count, which
// the glue adds to mfa_abi::Counters::buffers when the thread returns)
// and, in the opt-in bounds-checking mode (MFA_SHIM_BOUNDS_CHECK defined),
// fails the dispatch on an access outside the buffer. Part of the shim metal_stdlib.
//
// Rules that follow from C++ (Metal itself accepts more):
// - Through a pointer to const, p[i], *p and p->m read the whole element
//   (sizeof(T) bytes) where they are evaluated and give a `const T&`.
// - Through a pointer to non-const, p[i] and *p give a writable_element:
//   converting it reads, assigning writes, compound assignment and ++/--
//   read and write. Members and swizzles of a writable element (p[i].x = v,
//   p->m) do not compile: copy the element, change the copy, store it back
//   (float4 e = p[i]; e.x = v; p[i] = e;), or read through a const pointer.
//   `auto e = p[i];` makes `e` a writable_element, not a copy: spell the type.
//   A `device T&` cannot bind to a writable element (it does to a const one).
// - &p[i] is a buffer_ptr when p is writable; when p points to const it is
//   a plain pointer that no longer counts: write p + i.
// - Arithmetic and copies keep counting; a buffer_ptr never becomes a plain
//   pointer. Casts between pointee types ((device float4*)p) keep the buffer.
//   Pointer types inside #define bodies are not rewritten (a cast there to a
//   plain pointer does not compile).
// - Reference arguments (`constant Params& p [[buffer(i)]]`) are not counted.
// - Atomics count their object as read (load), written (store) or both;
//   simdgroup_load / simdgroup_store count each lane's two elements.
// - In the bounds-checking mode a vector access (half2, float4, ...) must also
//   be aligned to its vector's alignment, as Metal requires: a misaligned one
//   fails the dispatch (a cast pointer that lands between vectors).
#pragma once

#include "mfa_scalar.h"  // is_scalar_v

namespace metal {
template <class T, int N>
struct vec;  // mfa_vector.h
}  // namespace metal

namespace mfa_shim {

// Whether X is an MSL vector (float2, half4, ...): the accesses that must be aligned. (Not
// mfa_vector.h's is_vector_v, so that this header stands without the vector types.)
template <class X>
inline constexpr bool is_vector_access_v = false;
template <class T, int N>
inline constexpr bool is_vector_access_v<metal::vec<T, N>> = true;

#ifdef MFA_SHIM_BOUNDS_CHECK
inline constexpr bool bounds_checked = true;
#else
inline constexpr bool bounds_checked = false;
#endif

// Whether `static_cast<U>(T)` is valid: explicit casts in MSL text (half(x),
// bfloat(x), E(x) for an enum) are static_casts. Not std::is_constructible:
// that is direct-initialization `U u(t);`, which an explicit-only conversion
// fails -- float to _Float16 on compilers that apply C++23's rules for
// extended floating types (g++ >= 13: float has the greater rank), int to a
// scoped enum on every compiler.
template <class T, class U, class = void>
struct static_castable : std::false_type {};
template <class T, class U>
struct static_castable<T, U, std::void_t<decltype(static_cast<U>(std::declval<T>()))>> : std::true_type {};

// Whether `element = value` is valid MSL for an element of type T: what
// converts implicitly in C++, and any scalar to any scalar (MSL converts
// float to half implicitly; g++ >= 13 does not count that as an implicit
// conversion, so std::is_convertible says no there).
template <class U, class T>
inline constexpr bool msl_assignable_v =
    std::is_convertible_v<const U&, T> || (is_scalar_v<U> && is_scalar_v<T>);

// One element behind a writable checked pointer (buffer_ptr, and
// threadgroup_ptr in the race-checking mode; see the rules above). `Pointer`
// has element_type and access(offset, reads, writes).
template <class Pointer>
class writable_element {
  using T = typename Pointer::element_type;

 public:
  explicit writable_element(const Pointer& at) : at_(at) {}
  writable_element(const writable_element&) = default;

  operator T() const { return at_.access(0, true, false); }
  // Explicit casts to other types: float(p[i]) for a bfloat element,
  // half(p[i]) for a float one (see static_castable).
  template <class U, std::enable_if_t<!std::is_same_v<U, T> && static_castable<const T&, U>::value, int> = 0>
  explicit operator U() const {
    return static_cast<U>(T(*this));
  }

  writable_element& operator=(const writable_element& other) { return *this = T(other); }
  template <class Other>
  writable_element& operator=(const writable_element<Other>& other) {
    return *this = typename Other::element_type(other);
  }
  template <class U, std::enable_if_t<msl_assignable_v<U, T>, int> = 0>
  writable_element& operator=(const U& value) {
    at_.access(0, false, true) = static_cast<T>(value);
    return *this;
  }

#define MFA_COMPOUND_ASSIGNMENT(op)                   \
  template <class U>                                  \
  writable_element& operator op(const U& operand) {   \
    T& element = at_.access(0, true, true);           \
    element op operand;                               \
    return *this;                                     \
  }
  MFA_COMPOUND_ASSIGNMENT(+=)
  MFA_COMPOUND_ASSIGNMENT(-=)
  MFA_COMPOUND_ASSIGNMENT(*=)
  MFA_COMPOUND_ASSIGNMENT(/=)
  MFA_COMPOUND_ASSIGNMENT(%=)
  MFA_COMPOUND_ASSIGNMENT(&=)
  MFA_COMPOUND_ASSIGNMENT(|=)
  MFA_COMPOUND_ASSIGNMENT(^=)
  MFA_COMPOUND_ASSIGNMENT(<<=)
  MFA_COMPOUND_ASSIGNMENT(>>=)
#undef MFA_COMPOUND_ASSIGNMENT

  writable_element& operator++() { return *this += 1; }
  writable_element& operator--() { return *this -= 1; }
  T operator++(int) { return step(1); }
  T operator--(int) { return step(-1); }

  Pointer operator&() const { return at_; }

 private:
  T step(int by) {
    T& element = at_.access(0, true, true);
    const T before = element;
    element += by;
    return before;
  }

  Pointer at_;
};

// Arithmetic and comparisons of a checked pointer `Derived`, which has
// moved(n) (the pointer n elements on) and address().
template <class Derived>
class pointer_operators {
 public:
  Derived operator+(ptrdiff_t n) const { return self().moved(n); }
  Derived operator-(ptrdiff_t n) const { return self().moved(-n); }
  friend Derived operator+(ptrdiff_t n, const Derived& p) { return p.moved(n); }
  ptrdiff_t operator-(const Derived& other) const { return self().address() - other.address(); }
  Derived& operator+=(ptrdiff_t n) { return mutable_self() = self().moved(n); }
  Derived& operator-=(ptrdiff_t n) { return mutable_self() = self().moved(-n); }
  Derived& operator++() { return *this += 1; }
  Derived& operator--() { return *this -= 1; }
  Derived operator++(int) {
    const Derived before = self();
    *this += 1;
    return before;
  }
  Derived operator--(int) {
    const Derived before = self();
    *this -= 1;
    return before;
  }
  explicit operator bool() const { return self().address() != nullptr; }

  friend bool operator==(const Derived& a, const Derived& b) { return a.address() == b.address(); }
  friend bool operator!=(const Derived& a, const Derived& b) { return a.address() != b.address(); }
  friend bool operator<(const Derived& a, const Derived& b) { return a.address() < b.address(); }
  friend bool operator<=(const Derived& a, const Derived& b) { return a.address() <= b.address(); }
  friend bool operator>(const Derived& a, const Derived& b) { return a.address() > b.address(); }
  friend bool operator>=(const Derived& a, const Derived& b) { return a.address() >= b.address(); }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
  Derived& mutable_self() { return static_cast<Derived&>(*this); }
};

template <class T>
class buffer_ptr : public pointer_operators<buffer_ptr<T>> {
 public:
  using element_type = T;
  // (add_lvalue_reference_t: a `device void*` has no element to access.)
  using reference =
      std::conditional_t<std::is_const_v<T>, std::add_lvalue_reference_t<T>, writable_element<buffer_ptr>>;

  // [[buffer(index)]] at `address`, `bytes` long, counting into `traffic`.
  buffer_ptr(T* address, size_t bytes, unsigned index, mfa_abi::BufferTraffic& traffic)
      : address_(address), base_(reinterpret_cast<uintptr_t>(address)), bytes_(bytes),
        index_(index), traffic_(&traffic) {}
  // buffer_ptr<float> -> buffer_ptr<const float>.
  template <class U, std::enable_if_t<std::is_convertible_v<U*, T*>, int> = 0>
  buffer_ptr(const buffer_ptr<U>& other) : buffer_ptr(other, other.address_) {}
  // Casts: (device float4*)p, (device const uchar*)p, ...
  template <class U, std::enable_if_t<!std::is_convertible_v<U*, T*>, int> = 0>
  explicit buffer_ptr(const buffer_ptr<U>& other)
      : buffer_ptr(other, reinterpret_cast<T*>(const_cast<std::remove_cv_t<U>*>(other.address_))) {}

  reference operator*() const { return (*this)[0]; }
  reference operator[](ptrdiff_t i) const {
    if constexpr (std::is_const_v<T>) {
      return access(i, true, false);
    } else {
      return reference(moved(i));
    }
  }
  T* operator->() const {
    static_assert(std::is_const_v<T>,
                  "p->member through a writable device pointer can be counted neither as a read nor "
                  "as a write: copy the element (T e = p[i]; ... p[i] = e;) or read through a "
                  "device const pointer (see mfa_buffer_ptr.h)");
    return &access(0, true, false);
  }

  // The element `i` places on, counted as read and/or written, bounds
  // checked if enabled. For shim code (atomics, writable_element).
  T& access(ptrdiff_t i, bool reads, bool writes) const {
    constexpr size_t size = sizeof(T);
    T* const element = moved(i).address_;
    if constexpr (bounds_checked) check(element, size);
    if (reads) traffic_->bytes_read += size;
    if (writes) traffic_->bytes_written += size;
    return *element;
  }

  T* address() const { return address_; }
  buffer_ptr moved(ptrdiff_t n) const {
    buffer_ptr result = *this;
    result.address_ = reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(address_) + n * ptrdiff_t(sizeof(T)));
    return result;
  }

 private:
  template <class>
  friend class buffer_ptr;

  template <class U>
  buffer_ptr(const buffer_ptr<U>& other, T* address)
      : address_(address), base_(other.base_), bytes_(other.bytes_), index_(other.index_),
        traffic_(other.traffic_) {}

  void check(const T* element, size_t size) const {
    const ptrdiff_t offset = ptrdiff_t(reinterpret_cast<uintptr_t>(element) - base_);
    if (offset < 0 || size_t(offset) + size > bytes_) {
      char message[200];
      std::snprintf(message, sizeof message,
                    "out-of-bounds access to buffer(%u): byte offset %td, %zu bytes, buffer has %zu bytes",
                    index_, offset, size, bytes_);
      fail(mfa_abi::current_thread, message);
    }
    check_alignment(element);
  }

  // A vector access must sit at a multiple of its alignment (Metal's: half2 4 bytes,
  // float2 8, float3 and float4 16), counted from the address, not the buffer's start.
  void check_alignment(const T* element) const {
    using Element = std::remove_cv_t<T>;
    if constexpr (is_vector_access_v<Element>) {
      constexpr size_t alignment = alignof(Element);
      const uintptr_t address = reinterpret_cast<uintptr_t>(element);
      if (address % alignment == 0) return;
      char message[200];
      std::snprintf(message, sizeof message,
                    "misaligned vector access to buffer(%u): byte offset %td, a %zu-byte vector needs an "
                    "address that is a multiple of %zu (it is %zu past one)",
                    index_, ptrdiff_t(address - base_), sizeof(Element), alignment, size_t(address % alignment));
      fail(mfa_abi::current_thread, message);
    }
  }

  T* address_;
  uintptr_t base_;  // where the buffer starts
  size_t bytes_;
  unsigned index_;
  mfa_abi::BufferTraffic* traffic_;
};

// The element type a plain or checked pointer points to.
template <class Pointer>
struct pointee {
  using type = typename Pointer::element_type;
};
template <class T>
struct pointee<T*> {
  using type = T;
};
template <class Pointer>
using pointee_t = typename pointee<std::remove_cv_t<Pointer>>::type;

}  // namespace mfa_shim
