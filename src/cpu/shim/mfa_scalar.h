// MSL scalar types: half, bfloat, the unsigned shorthands, numeric limits and
// the MSL constants (HALF_MAX, M_PI_F, ...). Part of the shim metal_stdlib.
#pragma once

// MSL's builtin type names live in the global namespace, as in Metal.
using half = _Float16;
using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = unsigned long;
static_assert(sizeof(ulong) == 8, "MSL ulong is 64 bits");

namespace metal {
struct bfloat;
}  // namespace metal
using bfloat = metal::bfloat;

namespace mfa_shim {

// Scalars MSL converts between implicitly (and broadcasts into vectors).
template <class T>
inline constexpr bool is_scalar_v =
    std::is_arithmetic_v<T> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>;

}  // namespace mfa_shim

namespace metal {

// bfloat16 as MSL 3.1 has it: a 16-bit storage type (the top half of a float)
// whose arithmetic runs in float. Conversions from float round to nearest even.
// bfloat op bfloat and bfloat op integer give bfloat; bfloat op float/half give
// float, so no precision is lost where MSL would compute in float.
struct bfloat {
  bfloat() = default;
  template <class S, std::enable_if_t<mfa_shim::is_scalar_v<S>, int> = 0>
  constexpr bfloat(S value) : bits_(round_from(static_cast<float>(value))) {}
  constexpr operator float() const {
    return __builtin_bit_cast(float, static_cast<uint32_t>(bits_) << 16);
  }

  static constexpr bfloat from_bits(uint16_t raw) {
    bfloat b{};
    b.bits_ = raw;
    return b;
  }
  constexpr uint16_t bits() const { return bits_; }

 private:
  static constexpr uint16_t round_from(float value) {
    const uint32_t f = __builtin_bit_cast(uint32_t, value);
    if ((f & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((f >> 16) | 0x40u);  // quiet NaN
    const uint32_t round_to_even = 0x7fffu + ((f >> 16) & 1u);
    return static_cast<uint16_t>((f + round_to_even) >> 16);
  }

  uint16_t bits_;
};
static_assert(sizeof(bfloat) == 2, "bfloat is 16 bits");

constexpr bfloat operator-(bfloat x) { return bfloat::from_bits(static_cast<uint16_t>(x.bits() ^ 0x8000u)); }
constexpr bfloat operator+(bfloat x) { return x; }

namespace bfloat_ops {
// The type of `bfloat op S`: integers convert to bfloat, floating types win.
template <class S>
using mixed_t = std::conditional_t<std::is_integral_v<S>, bfloat, float>;
template <class S>
using if_scalar = std::enable_if_t<mfa_shim::is_scalar_v<S> && !std::is_same_v<S, bfloat>, int>;
}  // namespace bfloat_ops

// Exact-match overloads so that no call is ambiguous with the built-in
// operators reachable through operator float().
#define MFA_BFLOAT_ARITHMETIC(op)                                                          \
  constexpr bfloat operator op(bfloat x, bfloat y) { return bfloat(float(x) op float(y)); } \
  template <class S, bfloat_ops::if_scalar<S> = 0>                                         \
  constexpr bfloat_ops::mixed_t<S> operator op(bfloat x, S y) {                            \
    return bfloat_ops::mixed_t<S>(float(x) op static_cast<float>(y));                      \
  }                                                                                        \
  template <class S, bfloat_ops::if_scalar<S> = 0>                                         \
  constexpr bfloat_ops::mixed_t<S> operator op(S x, bfloat y) {                            \
    return bfloat_ops::mixed_t<S>(static_cast<float>(x) op float(y));                      \
  }                                                                                        \
  template <class S, std::enable_if_t<mfa_shim::is_scalar_v<S>, int> = 0>                  \
  constexpr bfloat& operator op##=(bfloat & x, S y) {                                      \
    return x = bfloat(float(x) op static_cast<float>(y));                                  \
  }
MFA_BFLOAT_ARITHMETIC(+)
MFA_BFLOAT_ARITHMETIC(-)
MFA_BFLOAT_ARITHMETIC(*)
MFA_BFLOAT_ARITHMETIC(/)
#undef MFA_BFLOAT_ARITHMETIC

#define MFA_BFLOAT_COMPARE(op)                                                       \
  constexpr bool operator op(bfloat x, bfloat y) { return float(x) op float(y); }   \
  template <class S, bfloat_ops::if_scalar<S> = 0>                                   \
  constexpr bool operator op(bfloat x, S y) { return float(x) op static_cast<float>(y); } \
  template <class S, bfloat_ops::if_scalar<S> = 0>                                   \
  constexpr bool operator op(S x, bfloat y) { return static_cast<float>(x) op float(y); }
MFA_BFLOAT_COMPARE(==)
MFA_BFLOAT_COMPARE(!=)
MFA_BFLOAT_COMPARE(<)
MFA_BFLOAT_COMPARE(<=)
MFA_BFLOAT_COMPARE(>)
MFA_BFLOAT_COMPARE(>=)
#undef MFA_BFLOAT_COMPARE

// metal::numeric_limits: std's for the standard types, MSL's for half and bfloat.
template <class T>
struct numeric_limits : std::numeric_limits<T> {};

template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr int digits = 11;
  static constexpr half min() { return half(0x1p-14f); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0x1p-10f); }
  static constexpr half denorm_min() { return half(0x1p-24f); }
  static constexpr half infinity() { return half(__builtin_inff()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
};

template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr int digits = 8;
  static constexpr bfloat min() { return bfloat::from_bits(0x0080); }
  static constexpr bfloat max() { return bfloat::from_bits(0x7f7f); }
  static constexpr bfloat lowest() { return bfloat::from_bits(0xff7f); }
  static constexpr bfloat epsilon() { return bfloat::from_bits(0x3c00); }
  static constexpr bfloat denorm_min() { return bfloat::from_bits(0x0001); }
  static constexpr bfloat infinity() { return bfloat::from_bits(0x7f80); }
  static constexpr bfloat quiet_NaN() { return bfloat::from_bits(0x7fc0); }
};

}  // namespace metal

// MSL's half constants (FLT_*, INFINITY and NAN come from <cfloat>/<cmath>).
#define HALF_MAX (metal::numeric_limits<half>::max())
#define HALF_MIN (metal::numeric_limits<half>::min())
#define HALF_EPSILON (metal::numeric_limits<half>::epsilon())
#define MAXHALF HALF_MAX

// MSL's float and half math constants.
#define M_E_F 2.71828182845904523536028747135266250f
#define M_LOG2E_F 1.44269504088896340735992468100189214f
#define M_LOG10E_F 0.434294481903251827651128918916605082f
#define M_LN2_F 0.693147180559945309417232121458176568f
#define M_LN10_F 2.30258509299404568401799145468436421f
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_PI_2_F 1.57079632679489661923132169163975144f
#define M_PI_4_F 0.785398163397448309615660845819875721f
#define M_1_PI_F 0.318309886183790671537767526745028724f
#define M_2_PI_F 0.636619772367581343075535053490057448f
#define M_2_SQRTPI_F 1.12837916709551257389615890312154517f
#define M_SQRT2_F 1.41421356237309504880168872420969808f
#define M_SQRT1_2_F 0.707106781186547524400844362104849039f
#define M_E_H half(M_E_F)
#define M_LOG2E_H half(M_LOG2E_F)
#define M_LN2_H half(M_LN2_F)
#define M_PI_H half(M_PI_F)
#define M_SQRT2_H half(M_SQRT2_F)
