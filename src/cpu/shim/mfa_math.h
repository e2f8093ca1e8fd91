// MSL math in metal::, metal::fast:: and metal::precise:: (all three compute
// the same, in float, on the CPU). Scalar overloads for float and half (bfloat
// converts to float), integer overloads where MSL has them, and elementwise
// vector overloads that broadcast scalar arguments. Part of the shim metal_stdlib.
#pragma once

namespace metal {

// Scalar overloads first: the vector templates below look them up by name.
#define MFA_FLOAT_FUNCTION_1(name, expression)            \
  inline float name(float x) { return expression; }       \
  inline half name(half x) { return half(name(float(x))); }
MFA_FLOAT_FUNCTION_1(exp, std::exp(x))
MFA_FLOAT_FUNCTION_1(exp2, std::exp2(x))
MFA_FLOAT_FUNCTION_1(log, std::log(x))
MFA_FLOAT_FUNCTION_1(log2, std::log2(x))
MFA_FLOAT_FUNCTION_1(log10, std::log10(x))
MFA_FLOAT_FUNCTION_1(sqrt, std::sqrt(x))
MFA_FLOAT_FUNCTION_1(rsqrt, 1.0f / std::sqrt(x))
MFA_FLOAT_FUNCTION_1(fabs, std::fabs(x))
MFA_FLOAT_FUNCTION_1(abs, std::fabs(x))
MFA_FLOAT_FUNCTION_1(floor, std::floor(x))
MFA_FLOAT_FUNCTION_1(ceil, std::ceil(x))
MFA_FLOAT_FUNCTION_1(round, std::round(x))  // halfway cases away from zero
MFA_FLOAT_FUNCTION_1(rint, std::nearbyint(x))  // halfway cases to even
MFA_FLOAT_FUNCTION_1(trunc, std::trunc(x))
MFA_FLOAT_FUNCTION_1(fract, std::fmin(x - std::floor(x), 0x1.fffffep-1f))
MFA_FLOAT_FUNCTION_1(sin, std::sin(x))
MFA_FLOAT_FUNCTION_1(cos, std::cos(x))
MFA_FLOAT_FUNCTION_1(tan, std::tan(x))
MFA_FLOAT_FUNCTION_1(asin, std::asin(x))
MFA_FLOAT_FUNCTION_1(acos, std::acos(x))
MFA_FLOAT_FUNCTION_1(atan, std::atan(x))
MFA_FLOAT_FUNCTION_1(sinh, std::sinh(x))
MFA_FLOAT_FUNCTION_1(cosh, std::cosh(x))
MFA_FLOAT_FUNCTION_1(tanh, std::tanh(x))
MFA_FLOAT_FUNCTION_1(erf, std::erf(x))
// sign keeps the sign of a zero and maps NaN to 0, as MSL specifies.
MFA_FLOAT_FUNCTION_1(sign, x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x == 0.0f ? x : 0.0f)
MFA_FLOAT_FUNCTION_1(saturate, x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f)
#undef MFA_FLOAT_FUNCTION_1

// Binary functions. The (float, double) templates make an unsuffixed literal
// (a double without g++'s -fsingle-precision-constant, e.g. on clang) pick the
// float overload instead of being ambiguous with C's double functions.
#define MFA_FLOAT_FUNCTION_2(name, expression)                                   \
  inline float name(float x, float y) { return expression; }                     \
  inline half name(half x, half y) { return half(name(float(x), float(y))); }    \
  template <class D, std::enable_if_t<std::is_same_v<D, double>, int> = 0>       \
  float name(float x, D y) {                                                      \
    return name(x, static_cast<float>(y));                                       \
  }                                                                               \
  template <class D, std::enable_if_t<std::is_same_v<D, double>, int> = 0>       \
  float name(D x, float y) {                                                      \
    return name(static_cast<float>(x), y);                                       \
  }
MFA_FLOAT_FUNCTION_2(pow, std::pow(x, y))
MFA_FLOAT_FUNCTION_2(powr, std::pow(x, y))
MFA_FLOAT_FUNCTION_2(fmin, std::fmin(x, y))
MFA_FLOAT_FUNCTION_2(fmax, std::fmax(x, y))
MFA_FLOAT_FUNCTION_2(min, y < x ? y : x)
MFA_FLOAT_FUNCTION_2(max, x < y ? y : x)
MFA_FLOAT_FUNCTION_2(copysign, std::copysign(x, y))
MFA_FLOAT_FUNCTION_2(fmod, std::fmod(x, y))
MFA_FLOAT_FUNCTION_2(atan2, std::atan2(x, y))
MFA_FLOAT_FUNCTION_2(step, y < x ? 0.0f : 1.0f)  // step(edge, x)
MFA_FLOAT_FUNCTION_2(divide, x / y)
#undef MFA_FLOAT_FUNCTION_2

#define MFA_FLOAT_FUNCTION_3(name, expression)                     \
  inline float name(float x, float y, float z) { return expression; } \
  inline half name(half x, half y, half z) {                       \
    return half(name(float(x), float(y), float(z)));               \
  }
MFA_FLOAT_FUNCTION_3(fma, std::fma(x, y, z))
MFA_FLOAT_FUNCTION_3(clamp, min(max(x, y), z))
MFA_FLOAT_FUNCTION_3(mix, x + (y - x) * z)
#undef MFA_FLOAT_FUNCTION_3

#define MFA_FLOAT_PREDICATE(name, expression)        \
  inline bool name(float x) { return expression; }   \
  inline bool name(half x) { return name(float(x)); }
MFA_FLOAT_PREDICATE(isnan, std::isnan(x))
MFA_FLOAT_PREDICATE(isinf, std::isinf(x))
MFA_FLOAT_PREDICATE(isfinite, std::isfinite(x))
MFA_FLOAT_PREDICATE(signbit, std::signbit(x))
#undef MFA_FLOAT_PREDICATE

// Integer overloads.
template <class I>
using if_integer = std::enable_if_t<std::is_integral_v<I>, int>;
template <class I, if_integer<I> = 0>
constexpr I min(I x, I y) { return y < x ? y : x; }
template <class I, if_integer<I> = 0>
constexpr I max(I x, I y) { return x < y ? y : x; }
template <class I, if_integer<I> = 0>
constexpr I clamp(I x, I low, I high) { return min(max(x, low), high); }
template <class I, if_integer<I> = 0>
constexpr I abs(I x) {
  if constexpr (std::is_signed_v<I>) {
    return x < 0 ? static_cast<I>(-x) : x;
  } else {
    return x;
  }
}
template <class I, if_integer<I> = 0>
constexpr I popcount(I x) {
  return static_cast<I>(__builtin_popcountll(static_cast<std::make_unsigned_t<I>>(x)));
}
// Count of trailing / leading zero bits; the bit width for 0.
template <class I, if_integer<I> = 0>
constexpr I ctz(I x) {
  const auto bits = static_cast<std::make_unsigned_t<I>>(x);
  return static_cast<I>(bits == 0 ? 8 * sizeof(I) : __builtin_ctzll(bits));
}
template <class I, if_integer<I> = 0>
constexpr I clz(I x) {
  const auto bits = static_cast<std::make_unsigned_t<I>>(x);
  return static_cast<I>(bits == 0 ? 8 * sizeof(I)
                                  : __builtin_clzll(bits) - 64 + 8 * sizeof(I));
}

inline bool all(bool x) { return x; }
inline bool any(bool x) { return x; }

template <class T, std::enable_if_t<mfa_shim::is_scalar_v<T>, int> = 0>
constexpr T select(T if_false, T if_true, bool condition) {
  return condition ? if_true : if_false;
}

// Vector overloads: elementwise through the scalar overloads above.
#define MFA_VECTOR_FUNCTION_1(name)                                                 \
  template <class A, class V = mfa_shim::common_vector_t<A>>                        \
  V name(const A& a) {                                                              \
    return mfa_shim::elementwise<V, V>([](auto x) { return name(x); }, a);         \
  }
#define MFA_VECTOR_FUNCTION_2(name)                                                 \
  template <class A, class B, class V = mfa_shim::common_vector_t<A, B>>            \
  V name(const A& a, const B& b) {                                                  \
    return mfa_shim::elementwise<V, V>([](auto x, auto y) { return name(x, y); }, a, b); \
  }
#define MFA_VECTOR_FUNCTION_3(name)                                                 \
  template <class A, class B, class C, class V = mfa_shim::common_vector_t<A, B, C>> \
  V name(const A& a, const B& b, const C& c) {                                      \
    return mfa_shim::elementwise<V, V>(                                             \
        [](auto x, auto y, auto z) { return name(x, y, z); }, a, b, c);            \
  }
#define MFA_VECTOR_PREDICATE(name)                                                  \
  template <class A, class V = mfa_shim::common_vector_t<A>>                        \
  vec<bool, mfa_shim::vec_traits<V>::size> name(const A& a) {                       \
    return mfa_shim::elementwise<vec<bool, mfa_shim::vec_traits<V>::size>, V>(      \
        [](auto x) { return name(x); }, a);                                         \
  }
MFA_VECTOR_FUNCTION_1(exp)
MFA_VECTOR_FUNCTION_1(exp2)
MFA_VECTOR_FUNCTION_1(log)
MFA_VECTOR_FUNCTION_1(log2)
MFA_VECTOR_FUNCTION_1(log10)
MFA_VECTOR_FUNCTION_1(sqrt)
MFA_VECTOR_FUNCTION_1(rsqrt)
MFA_VECTOR_FUNCTION_1(fabs)
MFA_VECTOR_FUNCTION_1(abs)
MFA_VECTOR_FUNCTION_1(floor)
MFA_VECTOR_FUNCTION_1(ceil)
MFA_VECTOR_FUNCTION_1(round)
MFA_VECTOR_FUNCTION_1(rint)
MFA_VECTOR_FUNCTION_1(trunc)
MFA_VECTOR_FUNCTION_1(fract)
MFA_VECTOR_FUNCTION_1(sin)
MFA_VECTOR_FUNCTION_1(cos)
MFA_VECTOR_FUNCTION_1(tan)
MFA_VECTOR_FUNCTION_1(asin)
MFA_VECTOR_FUNCTION_1(acos)
MFA_VECTOR_FUNCTION_1(atan)
MFA_VECTOR_FUNCTION_1(sinh)
MFA_VECTOR_FUNCTION_1(cosh)
MFA_VECTOR_FUNCTION_1(tanh)
MFA_VECTOR_FUNCTION_1(erf)
MFA_VECTOR_FUNCTION_1(sign)
MFA_VECTOR_FUNCTION_1(saturate)
MFA_VECTOR_FUNCTION_1(popcount)
MFA_VECTOR_FUNCTION_1(ctz)
MFA_VECTOR_FUNCTION_1(clz)
MFA_VECTOR_FUNCTION_2(pow)
MFA_VECTOR_FUNCTION_2(powr)
MFA_VECTOR_FUNCTION_2(fmin)
MFA_VECTOR_FUNCTION_2(fmax)
MFA_VECTOR_FUNCTION_2(min)
MFA_VECTOR_FUNCTION_2(max)
MFA_VECTOR_FUNCTION_2(copysign)
MFA_VECTOR_FUNCTION_2(fmod)
MFA_VECTOR_FUNCTION_2(atan2)
MFA_VECTOR_FUNCTION_2(step)
MFA_VECTOR_FUNCTION_2(divide)
MFA_VECTOR_FUNCTION_3(fma)
MFA_VECTOR_FUNCTION_3(clamp)
MFA_VECTOR_FUNCTION_3(mix)
MFA_VECTOR_PREDICATE(isnan)
MFA_VECTOR_PREDICATE(isinf)
MFA_VECTOR_PREDICATE(isfinite)
MFA_VECTOR_PREDICATE(signbit)
#undef MFA_VECTOR_FUNCTION_1
#undef MFA_VECTOR_FUNCTION_2
#undef MFA_VECTOR_FUNCTION_3
#undef MFA_VECTOR_PREDICATE

template <class A, class V = mfa_shim::common_vector_t<A>>
bool all(const A& a) {
  const V v = a;
  for (int i = 0; i < mfa_shim::vec_traits<V>::size; ++i)
    if (!v[i]) return false;
  return true;
}
template <class A, class V = mfa_shim::common_vector_t<A>>
bool any(const A& a) {
  const V v = a;
  for (int i = 0; i < mfa_shim::vec_traits<V>::size; ++i)
    if (v[i]) return true;
  return false;
}

// select(a, b, c): c ? b : a per component; c is a bool or a bool vector.
template <class A, class B, class C, class V = mfa_shim::common_vector_t<A, B>>
V select(const A& if_false, const B& if_true, const C& condition) {
  using Mask = vec<bool, mfa_shim::vec_traits<V>::size>;
  const V f(if_false), t(if_true);
  const Mask mask(condition);
  V result;
  for (int i = 0; i < mfa_shim::vec_traits<V>::size; ++i) result[i] = mask[i] ? t[i] : f[i];
  return result;
}

template <class A, class B, class V = mfa_shim::common_vector_t<A, B>,
          std::enable_if_t<mfa_shim::is_vector_v<A> && mfa_shim::is_vector_v<B>, int> = 0>
typename mfa_shim::vec_traits<V>::element dot(const A& a, const B& b) {
  const V x(a), y(b);
  typename mfa_shim::vec_traits<V>::element sum = x[0] * y[0];
  for (int i = 1; i < mfa_shim::vec_traits<V>::size; ++i) sum += x[i] * y[i];
  return sum;
}

// metal::fast:: and metal::precise:: name the same functions here.
namespace fast {
using namespace metal;
}
namespace precise {
using namespace metal;
}

}  // namespace metal
