// Memory the front end's glue and rewrites rely on: kernel-scope threadgroup
// variables (threadgroup_alloc) and bounds-checked device pointers
// (checked_ptr, the opt-in checking mode). Part of the shim metal_stdlib.
#pragma once

namespace mfa_shim {

// Storage for one kernel-scope `threadgroup` variable. Every thread of the
// group declares the same variables in the same order, so every thread gets
// the same address. Fails the dispatch when the variables no longer fit
// beside the [[threadgroup(i)]] arguments.
inline void* threadgroup_alloc(size_t bytes, size_t align) {
  mfa_abi::ThreadState* const thread = mfa_abi::current_thread;
  unsigned char* const memory = thread->group->threadgroup_memory;
  const uintptr_t base = reinterpret_cast<uintptr_t>(memory);
  const size_t start = ((base + thread->static_cursor + align - 1) & ~(uintptr_t(align) - 1)) - base;
  const size_t end = start + bytes;
  const size_t limit = thread->dispatch->threadgroup_memory_limit;
  if (end > limit) {
    const size_t arguments = thread->group->static_base;
    char message[200];
    std::snprintf(message, sizeof message,
                  "threadgroup memory over %zu KiB: kernel-scope threadgroup variables need %zu "
                  "bytes after %zu bytes of [[threadgroup]] arguments",
                  limit / 1024, end - arguments, arguments);
    fail(thread, message);
  }
  thread->static_cursor = end;
  return memory + start;
}

// A device pointer that checks every access against its buffer's bounds.
// Arithmetic is unchecked (one-past-the-end pointers are fine); converting it
// to a plain pointer (to pass it to a helper function, or by a cast) gives up
// the checks for that copy.
template <class T>
class checked_ptr {
 public:
  checked_ptr(T* base, size_t bytes, unsigned buffer_index)
      : pointer_(base), base_(reinterpret_cast<uintptr_t>(base)), bytes_(bytes),
        buffer_index_(buffer_index) {}
  // checked_ptr<float> -> checked_ptr<const float>.
  template <class U, std::enable_if_t<std::is_convertible_v<U*, T*>, int> = 0>
  checked_ptr(const checked_ptr<U>& other)
      : pointer_(other.pointer_), base_(other.base_), bytes_(other.bytes_),
        buffer_index_(other.buffer_index_) {}

  // (add_lvalue_reference_t: a `device void*` argument has no element to access.)
  std::add_lvalue_reference_t<T> operator*() const { return *checked(0); }
  T* operator->() const { return checked(0); }
  std::add_lvalue_reference_t<T> operator[](ptrdiff_t i) const { return *checked(i); }

  operator T*() const { return pointer_; }
  template <class U>
  explicit operator U*() const {
    return reinterpret_cast<U*>(pointer_);
  }

  checked_ptr operator+(ptrdiff_t n) const { return moved(n); }
  checked_ptr operator-(ptrdiff_t n) const { return moved(-n); }
  friend checked_ptr operator+(ptrdiff_t n, const checked_ptr& p) { return p.moved(n); }
  ptrdiff_t operator-(const checked_ptr& other) const { return pointer_ - other.pointer_; }
  checked_ptr& operator+=(ptrdiff_t n) { return *this = moved(n); }
  checked_ptr& operator-=(ptrdiff_t n) { return *this = moved(-n); }
  checked_ptr& operator++() { return *this += 1; }
  checked_ptr& operator--() { return *this -= 1; }
  checked_ptr operator++(int) {
    const checked_ptr before = *this;
    *this += 1;
    return before;
  }
  checked_ptr operator--(int) {
    const checked_ptr before = *this;
    *this -= 1;
    return before;
  }

 private:
  template <class>
  friend class checked_ptr;

  checked_ptr moved(ptrdiff_t n) const {
    checked_ptr result = *this;
    result.pointer_ = reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(pointer_) + n * ptrdiff_t(sizeof(T)));
    return result;
  }

  T* checked(ptrdiff_t i) const {
    const ptrdiff_t offset = ptrdiff_t(reinterpret_cast<uintptr_t>(pointer_) - base_) + i * ptrdiff_t(sizeof(T));
    if (offset < 0 || size_t(offset) + sizeof(T) > bytes_) {
      char message[200];
      std::snprintf(message, sizeof message,
                    "out-of-bounds access to buffer(%u): byte offset %td, %zu bytes, buffer has "
                    "%zu bytes",
                    buffer_index_, offset, sizeof(T), bytes_);
      fail(mfa_abi::current_thread, message);
    }
    return reinterpret_cast<T*>(base_ + size_t(offset));
  }

  T* pointer_;
  uintptr_t base_;
  size_t bytes_;
  unsigned buffer_index_;
};

}  // namespace mfa_shim
