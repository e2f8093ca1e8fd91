// The shim metal_stdlib on its own (no executor): scalar types, vectors and
// swizzles, and math, against independent references. Standard headers and
// gtest come first: after the shim, `thread`, `device`, ... are macros.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>

#include "shim/metal_stdlib"

namespace {

using namespace metal;

// Fresh random inputs each run; the seed is printed when a check fails.
class ShimTest : public ::testing::Test {
 protected:
  ShimTest() : seed_(std::random_device{}()), random_(seed_) {}
  void SetUp() override { ::testing::Test::RecordProperty("seed", std::to_string(seed_)); }

  float uniform(float low, float high) { return std::uniform_real_distribution<float>(low, high)(random_); }
  int integer(int low, int high) { return std::uniform_int_distribution<int>(low, high)(random_); }
  uint32_t bits() { return static_cast<uint32_t>(random_()); }
  std::string trace() const { return "seed " + std::to_string(seed_); }

 private:
  unsigned seed_;
  std::mt19937 random_;
};

float float_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint32_t bits_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// The bfloat16 nearest to `value` (ties to an even mantissa), found by
// comparing the two neighbours in double, not by the shim's bit trick.
uint16_t nearest_bfloat_bits(float value) {
  const uint32_t below = bits_of(value) & 0xffff0000u;
  const double low = float_from_bits(below);
  const double high = below + 0x10000u == 0x7f800000u || below + 0x10000u == 0xff800000u
                          ? std::copysign(std::ldexp(1.0, 128), value)  // rounds up to infinity
                          : double(float_from_bits(below + 0x10000u));
  const double distance_low = std::fabs(double(value) - low);
  const double distance_high = std::fabs(high - double(value));
  const bool pick_high =
      distance_high < distance_low || (distance_high == distance_low && ((below >> 16) & 1u));
  return static_cast<uint16_t>((pick_high ? below + 0x10000u : below) >> 16);
}

// --- scalar types -----------------------------------------------------------

TEST_F(ShimTest, ScalarTypesHaveMetalSizes) {
  static_assert(sizeof(half) == 2 && sizeof(bfloat) == 2);
  static_assert(sizeof(uint) == 4 && sizeof(ushort) == 2 && sizeof(uchar) == 1 && sizeof(ulong) == 8);
  static_assert(std::is_trivially_copyable_v<bfloat>);
  EXPECT_EQ(float(HALF_MAX), 65504.0f);
  EXPECT_EQ(float(HALF_EPSILON), 0x1p-10f);
  EXPECT_EQ(float(numeric_limits<bfloat>::max()), 0x1.fep127f);
  EXPECT_TRUE(std::isinf(float(numeric_limits<half>::infinity())));
  EXPECT_EQ(M_PI_F, 3.14159265f);
}

TEST_F(ShimTest, HalfRoundsToNearestEven) {
  EXPECT_EQ(float(half(1.0f + 0x1p-11f)), 1.0f);                 // tie, even below
  EXPECT_EQ(float(half(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);   // tie, even above
  EXPECT_TRUE(std::isinf(float(half(65520.0f))));
  EXPECT_EQ(float(half(0x1p-24f)), 0x1p-24f);                    // smallest subnormal
  for (int i = 0; i < 1000; ++i) {
    const float x = uniform(-70000.0f, 70000.0f);
    const float h = float(half(x));
    SCOPED_TRACE(trace() + ", x = " + std::to_string(x));
    if (std::fabs(x) < 65504.0f + 16.0f) {
      // Exact in half's grid: the error is at most half a unit in the last place.
      const float ulp = std::ldexp(1.0f, std::max(std::ilogb(x), -14) - 10);
      EXPECT_LE(std::fabs(h - x), ulp / 2);
    } else {
      EXPECT_TRUE(std::isinf(h));
    }
  }
}

TEST_F(ShimTest, BfloatRoundsToNearestEven) {
  for (int i = 0; i < 20000; ++i) {
    uint32_t raw = bits();
    if (i % 4 == 0) raw = (raw & 0xffff0000u) | 0x8000u;  // exact ties
    const float x = float_from_bits(raw);
    if (std::isnan(x)) continue;
    SCOPED_TRACE(trace() + ", bits " + std::to_string(raw));
    EXPECT_EQ(bfloat(x).bits(), nearest_bfloat_bits(x));
  }
  EXPECT_TRUE(std::isnan(float(bfloat(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(float(bfloat(float_from_bits(0x7f800001u)))));  // a NaN that would round to inf
  EXPECT_TRUE(std::isinf(float(bfloat(std::numeric_limits<float>::infinity()))));
  EXPECT_EQ(float(bfloat(-2.5f)), -2.5f);
}

TEST_F(ShimTest, BfloatArithmeticFollowsMetalTypes) {
  static_assert(std::is_same_v<decltype(bfloat() * bfloat()), bfloat>);
  static_assert(std::is_same_v<decltype(bfloat() + 1), bfloat>);
  static_assert(std::is_same_v<decltype(bfloat() * 1.0f), float>);
  static_assert(std::is_same_v<decltype(2.0f - bfloat()), float>);
  static_assert(std::is_same_v<decltype(bfloat() < 1.0f), bool>);
  for (int i = 0; i < 200; ++i) {
    const bfloat a = uniform(-100, 100), b = uniform(-100, 100);
    const float f = uniform(-100, 100);
    SCOPED_TRACE(trace());
    EXPECT_EQ((a * b).bits(), bfloat(float(a) * float(b)).bits());
    EXPECT_EQ((a / b).bits(), bfloat(float(a) / float(b)).bits());
    EXPECT_EQ(a - f, float(a) - f);  // no rounding to bfloat
    EXPECT_EQ(float(-a), -float(a));
    EXPECT_EQ(a < b, float(a) < float(b));
    bfloat c = a;
    c += f;
    EXPECT_EQ(c.bits(), bfloat(float(a) + f).bits());
  }
}

// --- vectors ----------------------------------------------------------------

TEST_F(ShimTest, VectorsHaveMetalSizesAndAlignment) {
  static_assert(sizeof(float2) == 8 && alignof(float2) == 8);
  static_assert(sizeof(float3) == 16 && alignof(float3) == 16);
  static_assert(sizeof(float4) == 16 && alignof(float4) == 16);
  static_assert(sizeof(half3) == 8 && sizeof(half4) == 8 && sizeof(bfloat4) == 8);
  static_assert(sizeof(uchar3) == 4 && sizeof(long4) == 32 && sizeof(bool2) == 2);
  static_assert(std::is_trivially_copy_constructible_v<float4>);
  // `auto s = v.xy;` would copy an empty member: swizzles cannot be copied out.
  static_assert(!std::is_copy_constructible_v<decltype(float4().xy)>);
}

TEST_F(ShimTest, VectorConstructors) {
  const float a = uniform(-9, 9), b = uniform(-9, 9), c = uniform(-9, 9), d = uniform(-9, 9);
  const float4 v(a, b, c, d);
  EXPECT_EQ(v.x, a);
  EXPECT_EQ(v.w, d);
  EXPECT_EQ(v[2], c);
  const float4 broadcast = a;  // a scalar converts implicitly, as in MSL
  EXPECT_EQ(broadcast.y, a);
  EXPECT_EQ(broadcast.z, a);
  const float4 composite(v.zw, 0.0f, 1);
  EXPECT_EQ(composite.x, c);
  EXPECT_EQ(composite.y, d);
  EXPECT_EQ(composite.z, 0.0f);
  EXPECT_EQ(composite.w, 1.0f);
  const float3 mixed(a, float2(b, c));
  EXPECT_EQ(mixed.z, c);
  const float4 halves(float2(a, b), v.xy);
  EXPECT_EQ(halves.z, a);
  const int4 truncated = int4(float4(2.7f, -2.7f, 0.5f, 9.99f));
  EXPECT_EQ(truncated.x, 2);
  EXPECT_EQ(truncated.y, -2);
  EXPECT_EQ(truncated.w, 9);
  const half4 narrowed = half4(v);
  EXPECT_EQ(float(narrowed.y), float(half(b)));
  const float2 widened = float2(narrowed.wx);
  EXPECT_EQ(widened.x, float(half(d)));
  const bfloat2 brain = bfloat2(v.xy);
  EXPECT_EQ(brain.y.bits(), bfloat(b).bits());
  const uint3 from_list = {1u, 2u, 3u};
  EXPECT_EQ(from_list.z, 3u);
  static_assert(!std::is_convertible_v<half4, float4>, "vector conversions are explicit");
}

TEST_F(ShimTest, SwizzlesReadAndWrite) {
  const float a = uniform(-9, 9), b = uniform(-9, 9), c = uniform(-9, 9), d = uniform(-9, 9);
  float4 v(a, b, c, d);
  const float3 zyx = v.zyx;
  EXPECT_EQ(zyx.x, c);
  EXPECT_EQ(zyx.z, a);
  const float4 rgba = v.bgra;
  EXPECT_EQ(rgba.x, c);
  EXPECT_EQ(rgba.w, d);
  const float4 repeated = v.xxyy;
  EXPECT_EQ(repeated.y, a);
  EXPECT_EQ(repeated.z, b);
  v.xy = v.yx;  // overlapping: goes through a temporary
  EXPECT_EQ(v.x, b);
  EXPECT_EQ(v.y, a);
  float4 w(0.0f);
  w.wz = v.xy;  // same swizzle shape on both sides
  EXPECT_EQ(w.w, b);
  EXPECT_EQ(w.z, a);
  w.xy = v.xy;
  EXPECT_EQ(w.x, b);
  w.rgb = float3(1, 2, 3);
  EXPECT_EQ(w.g, 2.0f);
  EXPECT_EQ(w.a, b);
  w.yz += float2(10, 20);
  EXPECT_EQ(w.y, 12.0f);
  EXPECT_EQ(w.z, 23.0f);
  w.x *= 2;
  EXPECT_EQ(w.x, 2.0f);
  const float2 sum = v.xy + v.zw;  // arithmetic directly on swizzles
  EXPECT_EQ(sum.x, b + c);
  float3 q(a, b, c);
  q.zx = q.xz;
  EXPECT_EQ(q.x, c);
  EXPECT_EQ(q.z, a);
}

TEST_F(ShimTest, VectorArithmeticIsElementwiseWithBroadcast) {
  for (int i = 0; i < 100; ++i) {
    const float4 x(uniform(-5, 5), uniform(-5, 5), uniform(-5, 5), uniform(-5, 5));
    const float4 y(uniform(1, 5), uniform(1, 5), uniform(1, 5), uniform(1, 5));
    const float s = uniform(-3, 3);
    const float4 r = (x + y) * s - x / y;
    const bool4 less = x < y;
    for (int k = 0; k < 4; ++k) {
      SCOPED_TRACE(trace());
      EXPECT_EQ(r[k], (x[k] + y[k]) * s - x[k] / y[k]);
      EXPECT_EQ(less[k], x[k] < y[k]);
    }
    const half4 h = half4(x) * 2.0f;  // the scalar converts to the element type
    static_assert(std::is_same_v<std::remove_const_t<decltype(h)>, half4>);
    EXPECT_EQ(float(h.z), float(half(float(half(x.z)) * 2.0f)));
  }
  const int4 a(integer(-100, 100), integer(-100, 100), integer(1, 100), integer(1, 100));
  const int4 m = ((a % 7) ^ (a << 2)) | -a;
  for (int k = 0; k < 4; ++k) EXPECT_EQ(m[k], ((a[k] % 7) ^ (a[k] << 2)) | -a[k]);
  const uint2 u = uint2(0xf0u, 0x0fu) >> 2u;
  EXPECT_EQ(u.x, 0x3cu);
  EXPECT_EQ(u.y, 0x03u);
  const bool4 flags = !(int4(1, 0, 3, 0) == 0);
  EXPECT_TRUE(flags.x && !flags.y && flags.z && !flags.w);
  EXPECT_TRUE(all(bool2(true, true)) && any(flags) && !all(flags));
  const short2 s2 = short2(30000, -30000) + short2(1, -1);  // element type kept
  static_assert(std::is_same_v<std::remove_const_t<decltype(s2)>, short2>);
  EXPECT_EQ(s2.y, -30001);
  float4 acc(1.0f);
  acc += float4(1, 2, 3, 4);
  acc *= 2;
  EXPECT_EQ(acc.w, 10.0f);
}

TEST_F(ShimTest, AsTypeReinterpretsBits) {
  const float f = uniform(-1000, 1000);
  EXPECT_EQ(as_type<uint>(f), bits_of(f));
  EXPECT_EQ(as_type<float>(as_type<uint>(f)), f);
  const half2 pair(half(1.5f), half(-2.0f));
  const uint packed = as_type<uint>(pair);
  EXPECT_EQ(packed & 0xffffu, 0x3e00u);
  EXPECT_EQ(packed >> 16, 0xc000u);
  const float4 v(f, 1.0f, 2.0f, 3.0f);
  EXPECT_EQ(as_type<uint4>(v).x, bits_of(f));
  EXPECT_EQ(as_type<ushort>(bfloat(1.0f)), 0x3f80u);
}

// --- math -------------------------------------------------------------------

TEST_F(ShimTest, FloatMathMatchesReferences) {
  for (int i = 0; i < 500; ++i) {
    const float x = uniform(-20, 20), p = uniform(0.01f, 20), y = uniform(-20, 20);
    SCOPED_TRACE(trace() + ", x = " + std::to_string(x));
    EXPECT_NEAR(exp(x), std::exp(double(x)), 1e-6 * std::exp(double(x)));
    EXPECT_NEAR(fast::exp2(x), std::exp2(double(x)), 1e-6 * std::exp2(double(x)));
    EXPECT_NEAR(precise::log(p), std::log(double(p)), 1e-6);
    EXPECT_NEAR(log2(p), std::log2(double(p)), 1e-6);
    EXPECT_NEAR(sqrt(p), std::sqrt(double(p)), 1e-6 * std::sqrt(double(p)));
    EXPECT_NEAR(rsqrt(p), 1.0 / std::sqrt(double(p)), 1e-6 / std::sqrt(double(p)));
    EXPECT_NEAR(pow(p, y / 10), std::pow(double(p), double(y / 10)), 1e-5 * std::pow(double(p), double(y / 10)));
    EXPECT_NEAR(tanh(x), std::tanh(double(x)), 1e-6);
    EXPECT_NEAR(erf(x / 4), std::erf(double(x / 4)), 1e-6);
    EXPECT_NEAR(sin(x) + cos(x), std::sin(double(x)) + std::cos(double(x)), 1e-5);
    EXPECT_EQ(fma(x, y, p), float(double(x) * double(y) + double(p)));  // one rounding
    EXPECT_EQ(metal::abs(x), std::fabs(x));  // qualified: gtest brings std::abs(float) to ::
    EXPECT_EQ(max(x, y), x < y ? y : x);
    EXPECT_EQ(min(x, y), y < x ? y : x);
    EXPECT_EQ(clamp(x, -1.0f, 1.0f), x < -1 ? -1.0f : x > 1 ? 1.0f : x);
    EXPECT_NEAR(mix(x, y, 0.25f), x + (y - x) * 0.25, 1e-5);
    EXPECT_GE(fract(x), 0.0f);
    EXPECT_LT(fract(x), 1.0f);
    EXPECT_NEAR(fract(x), x - std::floor(double(x)), 1e-5);
    EXPECT_EQ(saturate(x), std::fmin(std::fmax(x, 0.0f), 1.0f));
    EXPECT_EQ(divide(x, p), x / p);
    EXPECT_EQ(copysign(p, x), std::copysign(p, x));
  }
}

TEST_F(ShimTest, MathEdgeCasesFollowMsl) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(rint(2.5f), 2.0f);  // halfway to even
  EXPECT_EQ(round(2.5f), 3.0f);  // halfway away from zero
  EXPECT_EQ(round(-2.5f), -3.0f);
  EXPECT_EQ(trunc(-2.7f), -2.0f);
  EXPECT_EQ(floor(-2.5f), -3.0f);
  EXPECT_EQ(ceil(-2.5f), -2.0f);
  EXPECT_EQ(sign(-3.0f), -1.0f);
  EXPECT_TRUE(std::signbit(sign(-0.0f)));
  EXPECT_EQ(sign(nan), 0.0f);
  EXPECT_EQ(saturate(nan), 0.0f);
  EXPECT_LT(fract(-1e-9f), 1.0f);  // never rounds up to 1
  EXPECT_EQ(fmax(nan, 2.0f), 2.0f);
  EXPECT_TRUE(isnan(nan) && !isnan(1.0f));
  EXPECT_TRUE(isinf(INFINITY) && !isfinite(-INFINITY) && isfinite(FLT_MAX));
  EXPECT_EQ(step(1.0f, 0.5f), 0.0f);
  EXPECT_EQ(step(1.0f, 1.0f), 1.0f);
  EXPECT_EQ(exp(-INFINITY), 0.0f);
}

TEST_F(ShimTest, HalfAndBfloatMathRoundsFloatResults) {
  for (int i = 0; i < 200; ++i) {
    const half h = half(uniform(-4, 4));
    const bfloat b = uniform(-4, 4);
    SCOPED_TRACE(trace());
    static_assert(std::is_same_v<decltype(exp(h)), half>);
    EXPECT_EQ(float(exp(h)), float(half(std::exp(float(h)))));
    EXPECT_EQ(float(max(h, half(0.5f))), std::max(float(h), 0.5f));
    EXPECT_EQ(exp2(b), std::exp2(float(b)));  // bfloat math runs in float
    EXPECT_EQ(float(fma(h, h, h)), float(half(float(h) * float(h) + float(h))));
  }
}

TEST_F(ShimTest, IntegerMath) {
  for (int i = 0; i < 200; ++i) {
    const int a = integer(-1000, 1000), b = integer(-1000, 1000);
    const uint u = bits();
    SCOPED_TRACE(trace());
    EXPECT_EQ(min(a, b), std::min(a, b));
    EXPECT_EQ(max(u, 7u), std::max(u, 7u));
    EXPECT_EQ(clamp(a, -10, 10), std::min(std::max(a, -10), 10));
    EXPECT_EQ(abs(a), std::abs(a));
    int expected_popcount = 0, expected_ctz = 32, expected_clz = 32;
    for (int bit = 0; bit < 32; ++bit) {
      if ((u >> bit) & 1u) {
        ++expected_popcount;
        expected_ctz = std::min(expected_ctz, bit);
        expected_clz = 31 - bit;
      }
    }
    EXPECT_EQ(popcount(u), uint(expected_popcount));
    EXPECT_EQ(ctz(u), uint(expected_ctz));
    EXPECT_EQ(clz(u), uint(expected_clz));
  }
  EXPECT_EQ(ctz(0u), 32u);
  EXPECT_EQ(clz(ushort(1)), 15);
}

TEST_F(ShimTest, VectorMathIsElementwiseAndBroadcastsScalars) {
  const float4 x(uniform(-3, 3), uniform(-3, 3), uniform(-3, 3), uniform(-3, 3));
  const float4 y(uniform(-3, 3), uniform(-3, 3), uniform(-3, 3), uniform(-3, 3));
  const float4 e = fast::exp(x);
  const float4 clamped = clamp(x, -1.0f, 1.0f);
  const float4 mixed = mix(x, y, 0.5f);
  const float4 biggest = max(x, y);
  const float4 chosen = select(x, y, x < y);
  const bool4 nans = isnan(float4(x.x, NAN, x.z, NAN));
  for (int k = 0; k < 4; ++k) {
    SCOPED_TRACE(trace());
    EXPECT_EQ(e[k], exp(x[k]));
    EXPECT_EQ(clamped[k], clamp(x[k], -1.0f, 1.0f));
    EXPECT_EQ(mixed[k], mix(x[k], y[k], 0.5f));
    EXPECT_EQ(biggest[k], max(x[k], y[k]));
    EXPECT_EQ(chosen[k], x[k] < y[k] ? y[k] : x[k]);
    EXPECT_EQ(nans[k], k % 2 == 1);
  }
  EXPECT_NEAR(dot(x, y), double(x.x) * y.x + double(x.y) * y.y + double(x.z) * y.z + double(x.w) * y.w, 1e-5);
  const float2 from_swizzle = exp2(x.zy);  // swizzles are accepted directly
  EXPECT_EQ(from_swizzle.x, exp2(x.z));
  const int3 limited = clamp(int3(-5, 0, 50), 0, 10);
  EXPECT_EQ(limited.x, 0);
  EXPECT_EQ(limited.z, 10);
  const half2 hs = sqrt(half2(half(4.0f), half(2.0f)));
  EXPECT_EQ(float(hs.x), 2.0f);
  EXPECT_EQ(float(hs.y), float(half(std::sqrt(2.0f))));
  const float4 picked = select(x, y, true);
  EXPECT_EQ(picked.w, y.w);
}

}  // namespace
