// MSL vector types: metal::vec<T, N> (float4 is vec<float, 4>) with component
// names, swizzles, constructors, elementwise operators with scalar broadcast,
// and as_type<T>(x). Part of the shim metal_stdlib.
#pragma once

namespace metal {

template <class T, int N>
struct vec;

// A swizzle such as v.zyx: an empty union member laid over the vector's
// elements (every union member starts at the first element). Reading it gives
// a vec<T, M>; assigning to it writes the components through a temporary, so
// `v.xy = v.yx` works. Pattern packs the M component indices, 2 bits each.
// Chained swizzles (v.xy.x) are not supported.
template <class T, int M, unsigned Pattern, class V = vec<T, M>>
class swizzle {
 public:
  operator V() const {
    V result;
    for (int i = 0; i < M; ++i) result[i] = elements()[index(i)];
    return result;
  }
  swizzle& operator=(const V& value) {
    static_assert(!repeats_a_component(), "cannot assign to a swizzle that repeats a component");
    for (int i = 0; i < M; ++i) elements()[index(i)] = value[i];
    return *this;
  }
  swizzle& operator=(const swizzle& other) { return *this = V(other); }

 private:
  template <class, int>
  friend struct vec;
  // Only a vector may copy one: `auto s = v.xy;` would copy an empty member,
  // so it does not compile (write `float2 s = v.xy;`).
  swizzle() = default;
  swizzle(const swizzle&) = default;

  static constexpr int index(int i) { return (Pattern >> (2 * i)) & 3; }
  static constexpr bool repeats_a_component() {
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < i; ++j)
        if (index(i) == index(j)) return true;
    return false;
  }
  const T* elements() const { return reinterpret_cast<const T*>(this); }
  T* elements() { return reinterpret_cast<T*>(this); }
};

}  // namespace metal

namespace mfa_shim {

// What an operand is: a scalar (size 1), a vector, or a swizzle of one;
// `value` is the type it reads as (the vector type, for a swizzle).
template <class X>
struct vec_traits {
  static constexpr bool is_vector = false;
  static constexpr int size = 1;
  using element = X;
  using value = X;
};
template <class T, int N>
struct vec_traits<metal::vec<T, N>> {
  static constexpr bool is_vector = true;
  static constexpr int size = N;
  using element = T;
  using value = metal::vec<T, N>;
};
template <class T, int M, unsigned P, class V>
struct vec_traits<metal::swizzle<T, M, P, V>> {
  static constexpr bool is_vector = true;
  static constexpr int size = M;
  using element = T;
  using value = V;
};
template <class X>
inline constexpr bool is_vector_v = vec_traits<X>::is_vector;

// The vector type of an elementwise operation on operands X...: the one
// vector type among them, the others being scalars (broadcast). No `type`
// (so overloads drop out) for mixed vector types or when no operand is a vector.
struct no_vector {};
struct mixed_vectors {};
template <class Found, class X, bool = is_vector_v<X>, bool = is_scalar_v<X>>
struct merge_vector {
  using type = mixed_vectors;  // neither a vector nor a scalar
};
template <class Found, class X>
struct merge_vector<Found, X, false, true> {
  using type = Found;
};
template <class X>
struct merge_vector<no_vector, X, true, false> {
  using type = typename vec_traits<X>::value;
};
template <class Found, class X>
struct merge_vector<Found, X, true, false> {
  using type = std::conditional_t<std::is_same_v<Found, typename vec_traits<X>::value>, Found,
                                  mixed_vectors>;
};
template <class Found, class... X>
struct find_vector {
  using type = Found;
};
template <class Found, class X, class... Rest>
struct find_vector<Found, X, Rest...>
    : find_vector<typename merge_vector<Found, X>::type, Rest...> {};
template <class V>
struct vector_result {};
template <class T, int N>
struct vector_result<metal::vec<T, N>> {
  using type = metal::vec<T, N>;
};
template <class... X>
using common_vector_t = typename vector_result<typename find_vector<no_vector, X...>::type>::type;

// Component `i` of an operand: of a vector (already converted to V), or the
// scalar itself, broadcast.
template <class V, class X>
constexpr typename vec_traits<V>::element component(const X& x, int i) {
  if constexpr (std::is_same_v<X, V>) {
    return x[i];
  } else {
    return static_cast<typename vec_traits<V>::element>(x);
  }
}

template <class R, class V, class F, class... X>
R elementwise_converted(F f, const X&... x) {
  R result;
  for (int i = 0; i < vec_traits<V>::size; ++i) {
    result[i] = static_cast<typename vec_traits<R>::element>(f(component<V>(x, i)...));
  }
  return result;
}

// result[i] = f(x[i]...) for each component, converted to R's element type;
// V is the operands' vector type (swizzles are read once, scalars broadcast).
template <class R, class V, class F, class... X>
R elementwise(F f, const X&... x) {
  return elementwise_converted<R, V>(f, std::conditional_t<is_vector_v<X>, V, X>(x)...);
}

}  // namespace mfa_shim

namespace metal {

// Members shared by vec<T, 2>, vec<T, 3> and vec<T, 4>.
#define MFA_VEC_COMMON(N)                                                                     \
  using value_type = T;                                                                       \
  vec() = default;                                                                            \
  vec(const vec&) = default;                                                                  \
  /* Written out: the swizzles' own assignments delete the union's implicit one. */          \
  vec& operator=(const vec& other) {                                                          \
    for (int i = 0; i < N; ++i) data_[i] = other.data_[i];                                    \
    return *this;                                                                             \
  }                                                                                           \
  /* A scalar broadcasts (implicitly, as in MSL). */                                          \
  template <class S, std::enable_if_t<mfa_shim::is_scalar_v<S>, int> = 0>                    \
  constexpr vec(S scalar) : data_{} {                                                         \
    for (int i = 0; i < N; ++i) data_[i] = static_cast<T>(scalar);                            \
  }                                                                                           \
  /* Conversions between element types are explicit, as in MSL. */                           \
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>                       \
  explicit constexpr vec(const vec<U, N>& other) : data_{} {                                  \
    for (int i = 0; i < N; ++i) data_[i] = static_cast<T>(other[i]);                          \
  }                                                                                           \
  template <class U, unsigned P, class W, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>  \
  explicit vec(const swizzle<U, N, P, W>& other) : vec(W(other)) {}                           \
  /* Composites: float4(v.xy, 0.0f, 1.0f), float3(a, b, c), ... */                           \
  template <class A, class B, class... Rest>                                                  \
  constexpr vec(const A& a, const B& b, const Rest&... rest) : data_{} {                      \
    static_assert(((mfa_shim::vec_traits<A>::size + mfa_shim::vec_traits<B>::size) + ... +    \
                   mfa_shim::vec_traits<Rest>::size) == N,                                    \
                  "a vector constructor needs exactly as many components as the vector has"); \
    int next = 0;                                                                             \
    append(next, a);                                                                          \
    append(next, b);                                                                          \
    (append(next, rest), ...);                                                                \
  }                                                                                           \
  constexpr T& operator[](int i) { return data_[i]; }                                         \
  constexpr const T& operator[](int i) const { return data_[i]; }                             \
                                                                                              \
 private:                                                                                     \
  template <class X>                                                                          \
  constexpr void append(int& next, const X& x) {                                              \
    using traits = mfa_shim::vec_traits<X>;                                                   \
    if constexpr (traits::is_vector) {                                                        \
      static_assert(std::is_same_v<typename traits::element, T>,                              \
                    "vector arguments of a vector constructor must have its element type");   \
      const typename traits::value part = x;                                                 \
      for (int i = 0; i < traits::size; ++i) data_[next++] = part[i];                         \
    } else {                                                                                  \
      static_assert(mfa_shim::is_scalar_v<X>, "vector constructor arguments must be scalars or vectors"); \
      data_[next++] = static_cast<T>(x);                                                      \
    }                                                                                         \
  }                                                                                           \
                                                                                              \
 public:

// Swizzle members: every combination of 2, 3 or 4 component indices below N,
// each under its xyzw and its rgba name. MFA_FORk_N(F, ctx...) calls
// F(i, ctx...) for i < N; each nesting level needs its own macro.
#define MFA_XYZW_0 x
#define MFA_XYZW_1 y
#define MFA_XYZW_2 z
#define MFA_XYZW_3 w
#define MFA_RGBA_0 r
#define MFA_RGBA_1 g
#define MFA_RGBA_2 b
#define MFA_RGBA_3 a
#define MFA_CAT(p, q) MFA_CAT_(p, q)
#define MFA_CAT_(p, q) p##q
#define MFA_NAME2(set, i, j) MFA_CAT(set##i, set##j)
#define MFA_NAME3(set, i, j, k) MFA_CAT(MFA_NAME2(set, i, j), set##k)
#define MFA_NAME4(set, i, j, k, l) MFA_CAT(MFA_NAME3(set, i, j, k), set##l)
#define MFA_SWIZZLE2(i, j) \
  swizzle<T, 2, (i) | (j) << 2> MFA_NAME2(MFA_XYZW_, i, j), MFA_NAME2(MFA_RGBA_, i, j);
#define MFA_SWIZZLE3(i, j, k)                                         \
  swizzle<T, 3, (i) | (j) << 2 | (k) << 4> MFA_NAME3(MFA_XYZW_, i, j, k), \
      MFA_NAME3(MFA_RGBA_, i, j, k);
#define MFA_SWIZZLE4(i, j, k, l)                                                  \
  swizzle<T, 4, (i) | (j) << 2 | (k) << 4 | (l) << 6> MFA_NAME4(MFA_XYZW_, i, j, k, l), \
      MFA_NAME4(MFA_RGBA_, i, j, k, l);
#define MFA_FOR1_2(F, ...) F(0, __VA_ARGS__) F(1, __VA_ARGS__)
#define MFA_FOR1_3(F, ...) MFA_FOR1_2(F, __VA_ARGS__) F(2, __VA_ARGS__)
#define MFA_FOR1_4(F, ...) MFA_FOR1_3(F, __VA_ARGS__) F(3, __VA_ARGS__)
#define MFA_FOR2_2(F, ...) F(0, __VA_ARGS__) F(1, __VA_ARGS__)
#define MFA_FOR2_3(F, ...) MFA_FOR2_2(F, __VA_ARGS__) F(2, __VA_ARGS__)
#define MFA_FOR2_4(F, ...) MFA_FOR2_3(F, __VA_ARGS__) F(3, __VA_ARGS__)
#define MFA_FOR3_2(F, ...) F(0, __VA_ARGS__) F(1, __VA_ARGS__)
#define MFA_FOR3_3(F, ...) MFA_FOR3_2(F, __VA_ARGS__) F(2, __VA_ARGS__)
#define MFA_FOR3_4(F, ...) MFA_FOR3_3(F, __VA_ARGS__) F(3, __VA_ARGS__)
#define MFA_FOR4_2(F, ...) F(0, __VA_ARGS__) F(1, __VA_ARGS__)
#define MFA_FOR4_3(F, ...) MFA_FOR4_2(F, __VA_ARGS__) F(2, __VA_ARGS__)
#define MFA_FOR4_4(F, ...) MFA_FOR4_3(F, __VA_ARGS__) F(3, __VA_ARGS__)
#define MFA_SWIZZLES_FROM_1(i, N) MFA_FOR2_##N(MFA_SWIZZLES_FROM_2, N, i)
#define MFA_SWIZZLES_FROM_2(j, N, i) \
  MFA_SWIZZLE2(i, j) MFA_FOR3_##N(MFA_SWIZZLES_FROM_3, N, i, j)
#define MFA_SWIZZLES_FROM_3(k, N, i, j) \
  MFA_SWIZZLE3(i, j, k) MFA_FOR4_##N(MFA_SWIZZLES_FROM_4, N, i, j, k)
#define MFA_SWIZZLES_FROM_4(l, N, i, j, k) MFA_SWIZZLE4(i, j, k, l)
#define MFA_SWIZZLES(N) MFA_FOR1_##N(MFA_SWIZZLES_FROM_1, N)

// Sizes and alignments are Metal's: a 3-vector occupies 4 elements.
template <class T>
struct alignas(2 * sizeof(T)) vec<T, 2> {
  union {
    T data_[2];
    struct {
      T x, y;
    };
    struct {
      T r, g;
    };
    MFA_SWIZZLES(2)
  };
  MFA_VEC_COMMON(2)
};

template <class T>
struct alignas(4 * sizeof(T)) vec<T, 3> {
  union {
    T data_[4];
    struct {
      T x, y, z;
    };
    struct {
      T r, g, b;
    };
    MFA_SWIZZLES(3)
  };
  MFA_VEC_COMMON(3)
};

template <class T>
struct alignas(4 * sizeof(T)) vec<T, 4> {
  union {
    T data_[4];
    struct {
      T x, y, z, w;
    };
    struct {
      T r, g, b, a;
    };
    MFA_SWIZZLES(4)
  };
  MFA_VEC_COMMON(4)
};

#undef MFA_VEC_COMMON
#undef MFA_SWIZZLES
#undef MFA_SWIZZLES_FROM_1
#undef MFA_SWIZZLES_FROM_2
#undef MFA_SWIZZLES_FROM_3
#undef MFA_SWIZZLES_FROM_4
#undef MFA_FOR1_2
#undef MFA_FOR1_3
#undef MFA_FOR1_4
#undef MFA_FOR2_2
#undef MFA_FOR2_3
#undef MFA_FOR2_4
#undef MFA_FOR3_2
#undef MFA_FOR3_3
#undef MFA_FOR3_4
#undef MFA_FOR4_2
#undef MFA_FOR4_3
#undef MFA_FOR4_4
#undef MFA_SWIZZLE2
#undef MFA_SWIZZLE3
#undef MFA_SWIZZLE4
#undef MFA_NAME2
#undef MFA_NAME3
#undef MFA_NAME4
#undef MFA_CAT
#undef MFA_CAT_
#undef MFA_XYZW_0
#undef MFA_XYZW_1
#undef MFA_XYZW_2
#undef MFA_XYZW_3
#undef MFA_RGBA_0
#undef MFA_RGBA_1
#undef MFA_RGBA_2
#undef MFA_RGBA_3

// Elementwise operators on vectors and swizzles, with scalars broadcast to
// the vector's element type. Operands of different vector types do not mix.
#define MFA_VEC_ARITHMETIC(op)                                                       \
  template <class A, class B, class V = mfa_shim::common_vector_t<A, B>>             \
  V operator op(const A& a, const B& b) {                                            \
    return mfa_shim::elementwise<V, V>([](auto x, auto y) { return x op y; }, a, b); \
  }                                                                                  \
  template <class A, class B, class = mfa_shim::common_vector_t<A, B>,              \
            std::enable_if_t<mfa_shim::is_vector_v<A>, int> = 0>                     \
  A& operator op##=(A& a, const B& b) {                                              \
    return a = a op b;                                                               \
  }
MFA_VEC_ARITHMETIC(+)
MFA_VEC_ARITHMETIC(-)
MFA_VEC_ARITHMETIC(*)
MFA_VEC_ARITHMETIC(/)
MFA_VEC_ARITHMETIC(%)
MFA_VEC_ARITHMETIC(&)
MFA_VEC_ARITHMETIC(|)
MFA_VEC_ARITHMETIC(^)
MFA_VEC_ARITHMETIC(<<)
MFA_VEC_ARITHMETIC(>>)
#undef MFA_VEC_ARITHMETIC

// Comparisons (and && || on bool vectors) give a bool vector.
#define MFA_VEC_PREDICATE(op)                                                                \
  template <class A, class B, class V = mfa_shim::common_vector_t<A, B>>                     \
  vec<bool, mfa_shim::vec_traits<V>::size> operator op(const A& a, const B& b) {             \
    return mfa_shim::elementwise<vec<bool, mfa_shim::vec_traits<V>::size>, V>(              \
        [](auto x, auto y) { return x op y; }, a, b);                                        \
  }
MFA_VEC_PREDICATE(==)
MFA_VEC_PREDICATE(!=)
MFA_VEC_PREDICATE(<)
MFA_VEC_PREDICATE(<=)
MFA_VEC_PREDICATE(>)
MFA_VEC_PREDICATE(>=)
MFA_VEC_PREDICATE(&&)
MFA_VEC_PREDICATE(||)
#undef MFA_VEC_PREDICATE

#define MFA_VEC_UNARY(op)                                                        \
  template <class A, class V = mfa_shim::common_vector_t<A>>                     \
  V operator op(const A& a) {                                                    \
    return mfa_shim::elementwise<V, V>([](auto x) { return op x; }, a);          \
  }
MFA_VEC_UNARY(-)
MFA_VEC_UNARY(+)
MFA_VEC_UNARY(~)
MFA_VEC_UNARY(!)
#undef MFA_VEC_UNARY

// as_type<T>(x): reinterprets the bits of x (sizes must match, as in MSL).
template <class To, class From>
To as_type(const From& from) {
  using Source = typename mfa_shim::vec_traits<From>::value;
  const Source source = from;
  static_assert(sizeof(To) == sizeof(Source), "as_type needs types of the same size");
  To result;
  std::memcpy(static_cast<void*>(&result), static_cast<const void*>(&source), sizeof(To));
  return result;
}

}  // namespace metal

// MSL's vector type names: float2 ... ulong4, global as in Metal.
#define MFA_VECTOR_TYPES(T)       \
  using T##2 = metal::vec<T, 2>; \
  using T##3 = metal::vec<T, 3>; \
  using T##4 = metal::vec<T, 4>;
MFA_VECTOR_TYPES(float)
MFA_VECTOR_TYPES(half)
MFA_VECTOR_TYPES(bfloat)
MFA_VECTOR_TYPES(int)
MFA_VECTOR_TYPES(uint)
MFA_VECTOR_TYPES(short)
MFA_VECTOR_TYPES(ushort)
MFA_VECTOR_TYPES(char)
MFA_VECTOR_TYPES(uchar)
MFA_VECTOR_TYPES(bool)
MFA_VECTOR_TYPES(long)
MFA_VECTOR_TYPES(ulong)
#undef MFA_VECTOR_TYPES
