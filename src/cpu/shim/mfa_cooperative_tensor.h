// metal::cooperative_tensor: a tensor op's result spread over the threads of
// its execution scope, each thread owning some elements in its own storage.
// Part of the shim's MetalPerformancePrimitives.
//
// Which thread owns which element is implementation defined in Metal (Apple
// has not published it, and it has changed between OS releases). The shim
// draws it per compile from MFA_SHIM_LAYOUT_SEED (the kernel compiler passes
// MFA_NATIVE_SHIM_LAYOUT_SEED, default 0), so a kernel that assumes one
// layout (reads slot i of thread t as a fixed element) fails for some seed.
// Kernels find an element with is_valid_element(i) and
// get_multidimensional_index(i), move whole tensors with load / store, and
// reach another cooperative tensor's matching element with map_iterator
// where mpp::tensor_ops::is_iterator_compatible says every thread holds it
// (layouts of different shapes, a row reduction's and its matrix's, say,
// are drawn independently and rarely are). A new cooperative tensor holds
// 0xFF bytes (NaN in every float format).
#pragma once

#ifndef MFA_SHIM_LAYOUT_SEED
#error "MFA_SHIM_LAYOUT_SEED is defined by the cpu backend's kernel compiler for tensor-op kernels"
#endif

namespace metal {
template <class ElementType, class Extents, class Layout>
class cooperative_tensor;
}  // namespace metal

namespace mfa_shim {

constexpr unsigned long long greatest_common_divisor(unsigned long long a, unsigned long long b) {
  return b == 0 ? a : greatest_common_divisor(b, a % b);
}

// The seeded distribution of a Rows x Columns matrix over `Threads` threads.
// Slot `slot` of thread `owner` is global slot g = owner * capacity + slot;
// the seed permutes global slots (g -> (multiplier * g + shift) mod slots),
// may add an invalid padding slot per thread, and picks row- or column-major
// numbering of the elements. Seed 0 is the plain layout: thread t owns
// elements t * capacity ... in row-major order.
template <int Rows, int Columns, unsigned Threads>
struct seeded_layout {
  static constexpr int rows = Rows;
  static constexpr int columns = Columns;
  static constexpr unsigned threads = Threads;
  static constexpr unsigned long long seed = MFA_SHIM_LAYOUT_SEED;
  static constexpr unsigned elements = unsigned(Rows) * unsigned(Columns);
  static constexpr unsigned capacity = (elements + Threads - 1) / Threads + unsigned((seed >> 1) & 1);
  static constexpr unsigned long long slots = (unsigned long long)capacity * Threads;
  static constexpr bool column_major = (seed & 1) != 0;

  static constexpr unsigned long long coprime_multiplier() {
    unsigned long long candidate = seed == 0 ? 1 : (seed * 2654435761ull) % slots;
    if (candidate == 0) candidate = 1;
    while (greatest_common_divisor(candidate, slots) != 1) ++candidate;
    return candidate;
  }
  static constexpr unsigned long long multiplier = coprime_multiplier();
  static constexpr unsigned long long shift = (seed * 40503ull) % slots;

  // The element (row-major or column-major number) in a slot; >= elements when the slot holds none.
  static constexpr unsigned element(unsigned owner, unsigned slot) {
    return unsigned((multiplier * ((unsigned long long)owner * capacity + slot) + shift) % slots);
  }
  static constexpr bool is_valid(unsigned owner, unsigned slot) { return element(owner, slot) < elements; }
  static constexpr int row(unsigned element) {
    return int(column_major ? element % unsigned(Rows) : element / unsigned(Columns));
  }
  static constexpr int column(unsigned element) {
    return int(column_major ? element / unsigned(Rows) : element % unsigned(Columns));
  }
};

// The slot of `owner` in Layout holding what slot `other_slot` of `owner`
// holds in OtherLayout, projected onto Layout's shape (a row reduction keeps
// the row); Layout::capacity when there is none.
template <class Layout, class OtherLayout>
constexpr unsigned mapped_slot(unsigned owner, unsigned other_slot) {
  static_assert(Layout::threads == OtherLayout::threads &&
                    (Layout::rows == OtherLayout::rows || Layout::rows == 1) &&
                    (Layout::columns == OtherLayout::columns || Layout::columns == 1),
                "map_iterator: cooperative tensors of one scope, the other's elements projecting onto this one's shape");
  if (other_slot >= OtherLayout::capacity || !OtherLayout::is_valid(owner, other_slot)) return Layout::capacity;
  const unsigned other_element = OtherLayout::element(owner, other_slot);
  const unsigned row = Layout::rows == 1 ? 0 : unsigned(OtherLayout::row(other_element));
  const unsigned column = Layout::columns == 1 ? 0 : unsigned(OtherLayout::column(other_element));
  const unsigned element =
      Layout::column_major ? column * unsigned(Layout::rows) + row : row * unsigned(Layout::columns) + column;
  for (unsigned slot = 0; slot < Layout::capacity; ++slot) {
    if (Layout::element(owner, slot) == element) return slot;
  }
  return Layout::capacity;
}

// Slot `slot` of one thread's cooperative tensor (`Tensor` may be const):
// begin() is slot 0, end() slot get_capacity(), and map_iterator finds the
// matching slot of another cooperative tensor of the same thread.
template <class Tensor>
class cooperative_iterator {
 public:
  cooperative_iterator(Tensor& tensor, unsigned slot) : tensor_(&tensor), slot_(slot) {}

  decltype(auto) operator*() const { return (*tensor_)[static_cast<ushort>(slot_)]; }
  cooperative_iterator& operator++() {
    ++slot_;
    return *this;
  }
  cooperative_iterator operator++(int) {
    const cooperative_iterator before = *this;
    ++slot_;
    return before;
  }
  cooperative_iterator operator+(int n) const { return cooperative_iterator(*tensor_, slot_ + n); }
  int operator-(const cooperative_iterator& other) const { return int(slot_) - int(other.slot_); }
  bool operator==(const cooperative_iterator& other) const { return tensor_ == other.tensor_ && slot_ == other.slot_; }
  bool operator!=(const cooperative_iterator& other) const { return !(*this == other); }

 private:
  template <class, class, class>
  friend class metal::cooperative_tensor;

  Tensor& tensor() const { return *tensor_; }
  unsigned slot() const { return slot_; }

  Tensor* tensor_;
  unsigned slot_;
};

// Makes cooperative tensors: tensor ops' get_*_cooperative_tensor, never kernels.
struct cooperative_tensor_maker {
  template <class CooperativeTensor>
  static CooperativeTensor make(unsigned participant) {
    return CooperativeTensor(participant);
  }
};

}  // namespace mfa_shim

namespace metal {

// Extents are (columns, rows), as a tensor's. `Layout` is a
// mfa_shim::seeded_layout; the element type is the op's destination type.
template <class ElementType, class Extents, class Layout>
class cooperative_tensor {
 public:
  using element_type = ElementType;
  using value_type = ElementType;
  using extents_type = Extents;
  using layout_type = Layout;
  using index_type = typename Extents::index_type;
  using thread_index_type = ushort;

  static constexpr thread_index_type get_capacity() { return Layout::capacity; }
  bool is_valid_element(thread_index_type i) const { return i < Layout::capacity && Layout::is_valid(participant_, i); }
  // (column, row) of slot i; (0, 0) for a slot that holds no element.
  array<index_type, 2> get_multidimensional_index(thread_index_type i) const {
    if (!is_valid_element(i)) return {{0, 0}};
    const unsigned e = Layout::element(participant_, i);
    return {{index_type(Layout::column(e)), index_type(Layout::row(e))}};
  }

  ElementType& operator[](thread_index_type i) { return elements_[checked(i)]; }
  const ElementType& operator[](thread_index_type i) const { return elements_[checked(i)]; }

  using iterator = mfa_shim::cooperative_iterator<cooperative_tensor>;
  using const_iterator = mfa_shim::cooperative_iterator<const cooperative_tensor>;
  iterator begin() { return iterator(*this, 0); }
  iterator end() { return iterator(*this, Layout::capacity); }
  const_iterator begin() const { return const_iterator(*this, 0); }
  const_iterator end() const { return const_iterator(*this, Layout::capacity); }

  // The slot of this thread holding the element that `it` (into another
  // cooperative tensor of this thread) holds, projected onto this tensor's
  // shape (a row reduction's row, say); end() when this thread holds none of
  // it: the layouts are not compatible (mpp::tensor_ops::is_iterator_compatible).
  template <class OtherIterator>
  iterator map_iterator(OtherIterator it) {
    return iterator(*this, mapped_slot(it));
  }
  template <class OtherIterator>
  const_iterator map_iterator(OtherIterator it) const {
    return const_iterator(*this, mapped_slot(it));
  }

  // Every element inside `source`'s extents from it; the others become 0.
  template <class Tensor>
  void load(const Tensor& source, mfa_shim::call_site at = mfa_shim::call_site()) {
    for (thread_index_type i = 0; i < Layout::capacity; ++i) {
      if (!is_valid_element(i)) continue;
      const array<index_type, 2> index = get_multidimensional_index(i);
      elements_[i] = mfa_shim::tensor_access::contains(source, index[0], index[1])
                         ? static_cast<ElementType>(mfa_shim::tensor_access::element(source, index[0], index[1], at))
                         : ElementType(0);
    }
  }
  // Every element inside `destination`'s extents to it; the others are dropped.
  template <class Tensor>
  void store(const Tensor& destination, mfa_shim::call_site at = mfa_shim::call_site()) const {
    using Stored = typename Tensor::value_type;
    for (thread_index_type i = 0; i < Layout::capacity; ++i) {
      if (!is_valid_element(i)) continue;
      const array<index_type, 2> index = get_multidimensional_index(i);
      if (!mfa_shim::tensor_access::contains(destination, index[0], index[1])) continue;
      mfa_shim::tensor_access::element(destination, index[0], index[1], at) = static_cast<Stored>(elements_[i]);
    }
  }

 private:
  friend struct mfa_shim::cooperative_tensor_maker;

  // For the thread that makes it: its index among the op's threads.
  explicit cooperative_tensor(unsigned participant) : participant_(participant) {
    std::memset(static_cast<void*>(elements_), 0xFF, sizeof elements_);
  }

  template <class OtherIterator>
  unsigned mapped_slot(const OtherIterator& it) const {
    using OtherLayout = typename std::remove_cv_t<std::remove_reference_t<decltype(it.tensor())>>::layout_type;
    return mfa_shim::mapped_slot<Layout, OtherLayout>(participant_, it.slot());
  }

  thread_index_type checked(thread_index_type i) const {
    if constexpr (mfa_shim::bounds_checked) {
      if (i >= Layout::capacity) {
        char message[160];
        std::snprintf(message, sizeof message, "cooperative tensor index %u is out of bounds: its capacity is %u",
                      unsigned(i), Layout::capacity);
        mfa_shim::fail(mfa_abi::current_thread, message);
      }
    }
    return i;
  }

  ElementType elements_[Layout::capacity];
  unsigned participant_;
};

}  // namespace metal

namespace mfa_shim {

template <class T>
inline constexpr bool is_cooperative_tensor_v = false;
template <class ElementType, class Extents, class Layout>
inline constexpr bool is_cooperative_tensor_v<metal::cooperative_tensor<ElementType, Extents, Layout>> = true;

}  // namespace mfa_shim

namespace mpp {
namespace tensor_ops {

// Whether map_iterator from `source`'s elements finds every one in
// `destination`, on every thread of the scope (the same for all of them).
template <class SrcElementType, class DstElementType, class SrcExtents, class DstExtents, class SrcLayout,
          class DstLayout>
bool is_iterator_compatible(const metal::cooperative_tensor<SrcElementType, SrcExtents, SrcLayout>&,
                            const metal::cooperative_tensor<DstElementType, DstExtents, DstLayout>&) {
  for (unsigned owner = 0; owner < SrcLayout::threads; ++owner) {
    for (unsigned slot = 0; slot < SrcLayout::capacity; ++slot) {
      if (SrcLayout::is_valid(owner, slot) &&
          mfa_shim::mapped_slot<DstLayout, SrcLayout>(owner, slot) == DstLayout::capacity) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace tensor_ops
}  // namespace mpp
