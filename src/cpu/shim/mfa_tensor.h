// metal::tensor views over device and threadgroup memory, as Metal 4 tensor
// ops take them: extents (static, dynamic_extent, dextents), strides, slices.
// Part of the shim <metal_tensor>.
//
// Differences from Metal that follow from the shim's pointers:
// - A view is made with `tensor(pointer, extents)` or `tensor(pointer,
//   extents, strides)` (class template argument deduction; `auto t = ...`),
//   and its first template argument is the pointer type (buffer_ptr<half>,
//   threadgroup_ptr<float>, float*), not `device half`: a type spelled
//   `tensor<device half, dextents<int32_t, 2>, tensor_inline>` does not
//   compile here. Every access goes through that pointer, so device traffic
//   is counted and the bounds and race checks see each element.
// - Dimension 0 is the contiguous one: element (x, y) of a rank-2 tensor is
//   at x * stride(0) + y * stride(1); default strides are packed (1, extent(0)).
// - slice(x, y) and slice<E0, E1>(x, y) / static_slice<E0, E1>(x, y) shift
//   the origin; a dynamic extent of the slice is what remains of the parent's.
#pragma once

namespace mfa_shim {

// The plain address a plain or checked pointer holds.
template <class T>
T* raw_address(T* pointer) {
  return pointer;
}
template <class Pointer>
auto raw_address(const Pointer& pointer) -> decltype(pointer.address()) {
  return pointer.address();
}

struct tensor_access;  // mfa_matmul2d.h, mfa_cooperative_tensor.h: element access for tensor ops

}  // namespace mfa_shim

namespace metal {

inline constexpr size_t dynamic_extent = static_cast<size_t>(-1);

// metal::array, as tensor strides and multidimensional indices are given:
// `array<int, 2>({1, stride})`.
template <class T, size_t N>
struct array {
  T elements[N];

  constexpr T& operator[](size_t i) { return elements[i]; }
  constexpr const T& operator[](size_t i) const { return elements[i]; }
  static constexpr size_t size() { return N; }
};

template <class IndexType, size_t... Extents>
class extents {
  static_assert(sizeof...(Extents) > 0, "the cpu backend's tensors have rank 1 or more");
  static constexpr size_t static_extents[] = {Extents...};

 public:
  using index_type = IndexType;

  static constexpr size_t rank() { return sizeof...(Extents); }
  static constexpr size_t rank_dynamic() { return ((Extents == dynamic_extent ? 1 : 0) + ...); }
  static constexpr size_t static_extent(size_t r) { return static_extents[r]; }

  constexpr extents() : values_{static_cast<IndexType>(Extents == dynamic_extent ? 0 : Extents)...} {}
  // The dynamic extents in order, or every extent.
  template <class... I, std::enable_if_t<sizeof...(I) != 0 && (sizeof...(I) == rank_dynamic() ||
                                                              sizeof...(I) == rank()), int> = 0>
  constexpr explicit extents(I... given) : extents() {
    const IndexType values[] = {static_cast<IndexType>(given)...};
    size_t next = 0;
    for (size_t r = 0; r < rank(); ++r) {
      if (sizeof...(I) == rank()) {
        values_[r] = values[r];
      } else if (static_extents[r] == dynamic_extent) {
        values_[r] = values[next++];
      }
    }
  }

  constexpr IndexType extent(size_t r) const { return values_[r]; }

 private:
  IndexType values_[sizeof...(Extents)];
};

namespace mfa_tensor_detail {
template <size_t>
inline constexpr size_t dynamic_extent_for = dynamic_extent;

template <class IndexType, class Sequence>
struct all_dynamic;
template <class IndexType, size_t... R>
struct all_dynamic<IndexType, std::index_sequence<R...>> {
  using type = extents<IndexType, dynamic_extent_for<R>...>;
};
}  // namespace mfa_tensor_detail

template <class IndexType, size_t Rank>
using dextents = typename mfa_tensor_detail::all_dynamic<IndexType, std::make_index_sequence<Rank>>::type;

// A view made in the kernel: the one kind of tensor the cpu backend has (Metal's
// default, tensor_handle, is a host-bound kernel argument).
struct tensor_inline {};

template <class Pointer, class Extents, class Descriptor = tensor_inline>
class tensor {
  static_assert(std::is_same_v<Descriptor, tensor_inline>,
                "the cpu backend's tensors are views made in the kernel: auto t = tensor(pointer, extents, strides)");

 public:
  using element_type = mfa_shim::pointee_t<Pointer>;
  using value_type = std::remove_cv_t<element_type>;
  using extents_type = Extents;
  using index_type = typename Extents::index_type;
  static constexpr size_t rank = Extents::rank();
  using strides_type = array<index_type, rank>;

  tensor(Pointer data, const Extents& sizes) : data_(data), extents_(sizes), strides_(packed_strides(sizes)) {}
  template <class S>
  tensor(Pointer data, const Extents& sizes, const array<S, rank>& strides)
      : data_(data), extents_(sizes), strides_(converted(strides)) {}

  const Extents& extents() const { return extents_; }

  // The origin moved to `origin`; every extent is what remains.
  template <class... I, std::enable_if_t<sizeof...(I) == rank, int> = 0>
  auto slice(I... origin) const {
    return sliced<dextents<index_type, rank>>(origin...);
  }
  // The origin moved to `origin`, with the given extents (dynamic_extent: what remains).
  template <size_t... E, class... I, std::enable_if_t<sizeof...(E) == rank && sizeof...(I) == rank, int> = 0>
  auto slice(I... origin) const {
    return sliced<metal::extents<index_type, E...>>(origin...);
  }
  template <size_t... E, class... I, std::enable_if_t<sizeof...(E) == rank && sizeof...(I) == rank, int> = 0>
  auto static_slice(I... origin) const {
    return sliced<metal::extents<index_type, E...>>(origin...);
  }

 private:
  friend struct mfa_shim::tensor_access;

  static strides_type packed_strides(const Extents& sizes) {
    strides_type strides{};
    index_type stride = 1;
    for (size_t r = 0; r < rank; ++r) {
      strides[r] = stride;
      stride *= sizes.extent(r);
    }
    return strides;
  }
  template <class S>
  static strides_type converted(const array<S, rank>& strides) {
    strides_type result{};
    for (size_t r = 0; r < rank; ++r) result[r] = static_cast<index_type>(strides[r]);
    return result;
  }
  size_t offset_of(const array<index_type, rank>& index) const {
    ptrdiff_t offset = 0;
    for (size_t r = 0; r < rank; ++r) offset += ptrdiff_t(index[r]) * ptrdiff_t(strides_[r]);
    return size_t(offset);
  }
  template <class SliceExtents, class... I>
  tensor<Pointer, SliceExtents, tensor_inline> sliced(I... origin) const {
    const index_type start[] = {static_cast<index_type>(origin)...};
    array<index_type, rank> sizes{};
    for (size_t r = 0; r < rank; ++r) {
      const bool dynamic = SliceExtents::static_extent(r) == dynamic_extent;
      const index_type remaining = extents_.extent(r) > start[r] ? extents_.extent(r) - start[r] : 0;
      sizes[r] = dynamic ? remaining : static_cast<index_type>(SliceExtents::static_extent(r));
    }
    ptrdiff_t offset = 0;
    for (size_t r = 0; r < rank; ++r) offset += ptrdiff_t(start[r]) * ptrdiff_t(strides_[r]);
    return {data_ + offset, make_extents<SliceExtents>(sizes, std::make_index_sequence<rank>()), strides_};
  }
  template <class SliceExtents, size_t... R>
  static SliceExtents make_extents(const array<index_type, rank>& sizes, std::index_sequence<R...>) {
    return SliceExtents(sizes[R]...);
  }

  Pointer data_;
  Extents extents_;
  strides_type strides_;
};

}  // namespace metal

namespace mfa_shim {

template <class T>
inline constexpr bool is_tensor_v = false;
template <class Pointer, class Extents, class Descriptor>
inline constexpr bool is_tensor_v<metal::tensor<Pointer, Extents, Descriptor>> = true;

// Element (x, y) of a rank-2 tensor, for the tensor ops.
struct tensor_access {
  template <class Tensor>
  static bool contains(const Tensor& t, long x, long y) {
    static_assert(Tensor::rank == 2, "the cpu backend's tensor ops take rank-2 tensors");
    return x >= 0 && y >= 0 && x < long(t.extents_.extent(0)) && y < long(t.extents_.extent(1));
  }
  template <class Tensor>
  static long extent(const Tensor& t, size_t r) {
    return long(t.extents_.extent(r));
  }
  // Through the tensor's pointer: counted, bounds checked and recorded for
  // the race detector at `at`, as that pointer's accesses are.
  template <class Tensor>
  static decltype(auto) element(const Tensor& t, long x, long y, const call_site& at) {
    return element_at(t.data_, offset(t, x, y), at);
  }
  // The plain address, for arithmetic on elements the checks have seen.
  template <class Tensor>
  static const typename Tensor::value_type* address(const Tensor& t, long x, long y) {
    return raw_address(t.data_) + offset(t, x, y);
  }

 private:
  template <class Tensor>
  static size_t offset(const Tensor& t, long x, long y) {
    return size_t(x * long(t.strides_[0]) + y * long(t.strides_[1]));
  }
};

}  // namespace mfa_shim
