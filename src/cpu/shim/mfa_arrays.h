// Exact array bounds (the bounds-checking mode, MFA_SHIM_BOUNDS_CHECK defined,
// `bounds_check=True`): every threadgroup array, [[threadgroup(i)]] block and
// thread-local array knows its declaration and extent, and an index outside
// it -- next to the array or far away -- fails the dispatch naming the
// array, its size, the index and the .metal line. Part of the shim metal_stdlib.
//
// - Threadgroup memory goes through mfa_shim::threadgroup_ptr in this mode
//   (mfa_threadgroup_ptr.h), which carries an array_extent: pointers made
//   from an array by arithmetic or casts keep checking against the whole
//   array. A row of a 2-D array (t[i]) is checked as that row.
// - The front end rewrites a thread-local array declared in a function body,
//   `float a[4][8] = {...};`, into
//   `mfa_shim::thread_array<mfa_shim::thread_array<float, 8, Tag>, 4, Tag> a = {{...}};`
//   with the same layout and size. a[i] is checked; the array still decays to
//   a plain `thread T*` (for helpers), which is not checked from there on.
//   Arrays of unknown bound (`float a[] = {...}`), `static`/`constexpr`
//   arrays and struct members are left as they are.
#pragma once

namespace mfa_shim {

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

// The memory an array check allows: `bytes` from `base`, elements of
// `element_bytes`, and the declaration to name ("threadgroup float tile[64]",
// "[[threadgroup(0)]] threadgroup float* partial"). No declaration: unchecked.
struct array_extent {
  const char* declaration = nullptr;
  uintptr_t base = 0;
  size_t bytes = 0;
  size_t element_bytes = 1;
};

// Fails the dispatch: `bytes` at `address` are not all inside `extent`.
[[noreturn, gnu::noinline, gnu::cold]] inline void out_of_bounds(const array_extent& extent, uintptr_t address,
                                                                 size_t bytes, const call_site& at) {
  const ptrdiff_t offset = ptrdiff_t(address - extent.base);
  const ptrdiff_t size = ptrdiff_t(extent.element_bytes);
  const ptrdiff_t index = offset >= 0 ? offset / size : -((-offset + size - 1) / size);
  char access[160] = "";
  if (bytes != extent.element_bytes || offset % size != 0) {
    std::snprintf(access, sizeof access, " (a %zu-byte access at byte offset %td of %zu)", bytes, offset,
                  extent.bytes);
  }
  char message[512];
  std::snprintf(message, sizeof message, "out-of-bounds index %td into %s (%zu elements)%s at %s:%d", index,
                extent.declaration, extent.bytes / extent.element_bytes, access, at.file, at.line);
  fail(mfa_abi::current_thread, message);
}

inline void check_extent(const array_extent& extent, const void* address, size_t bytes, const call_site& at) {
  if (extent.declaration == nullptr) return;
  const uintptr_t at_address = reinterpret_cast<uintptr_t>(address);
  const uintptr_t offset = at_address - extent.base;  // wraps around below the base
  if (at_address >= extent.base && offset <= extent.bytes && bytes <= extent.bytes - offset) return;
  out_of_bounds(extent, at_address, bytes, at);
}

// A thread-local array `T name[N]` whose subscripts are checked; `Name` is a
// local type of the declaration with `static const char* declaration()`.
// An aggregate of T[N] alone: same size, layout and initialization ({{...}}).
template <class T, size_t N, class Name>
struct thread_array {
  T elements_[N];

  T& operator[](sited_index i) { return elements_[checked(i)]; }
  const T& operator[](sited_index i) const { return elements_[checked(i)]; }
  T& operator*() { return elements_[checked(sited_index(0))]; }
  const T& operator*() const { return elements_[checked(sited_index(0))]; }

  // Decay to a plain pointer (a helper's `thread T*` parameter, `a + 1`).
  // Conversion templates: compilers derive no built-in `p[i]` candidate from
  // them, so `a[i]` is never ambiguous with the checked operator above.
  template <class P, std::enable_if_t<std::is_same_v<P, T*> || std::is_same_v<P, const T*>, int> = 0>
  operator P() {
    return elements_;
  }
  template <class P, std::enable_if_t<std::is_same_v<P, const T*>, int> = 0>
  operator P() const {
    return elements_;
  }
  T* operator+(ptrdiff_t n) { return elements_ + n; }
  const T* operator+(ptrdiff_t n) const { return elements_ + n; }

  T* begin() { return elements_; }
  T* end() { return elements_ + N; }
  const T* begin() const { return elements_; }
  const T* end() const { return elements_ + N; }

 private:
  size_t checked(const sited_index& i) const {
    if (size_t(i.index) < N) return size_t(i.index);
    const array_extent extent{Name::declaration(), reinterpret_cast<uintptr_t>(elements_), sizeof(T) * N,
                              sizeof(T)};
    out_of_bounds(extent, extent.base + uintptr_t(i.index) * sizeof(T), sizeof(T), i.at);
  }
};

}  // namespace mfa_shim
