#include "embstore/initializer.hpp"

#include <algorithm>  // std::min
#include <cmath>      // std::sqrt, std::fabs, std::nearbyint
#include <cstring>    // std::memcpy

#include "embstore/hash.hpp"  // splitmix64
#include "embstore/simd.hpp"  // simd_level, EMBSTORE_KERNEL_TARGET_AVX2

namespace embstore {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr double kInv2Pow53 = 1.0 / 9007199254740992.0;  // 2^-53: 53 random mantissa bits
constexpr uint64_t kAttemptStride = uint64_t{1} << 32;   // TruncatedNormal redraws

// x (< 2^53) as a double, exactly, from integer operations that vectorise: AVX2 has no
// uint64 -> double conversion, so the scalar one kept the uniforms' loop (splitmix64's
// 64-bit multiplies included) scalar; with this GCC vectorises it (vpmuludq). The halves
// are placed in the mantissas of 2^84 and 2^52 (bit patterns, no rounding); subtracting
// 2^84 + 2^52 leaves hi * 2^32 - 2^52 and adding the low half's 2^52 + lo gives
// hi * 2^32 + lo: each result is a multiple of its operands' ulp below 2^53, so exact.
inline double exact_double(uint64_t x) noexcept {
  constexpr double kTwo84Plus52 = 19342813118337666422669312.0;  // 2^84 + 2^52, exact
  const uint64_t hi_bits = (x >> 32) | 0x4530000000000000ULL;  // 2^84 + hi * 2^32
  const uint64_t lo_bits = (x & 0xFFFFFFFFULL) | 0x4330000000000000ULL;  // 2^52 + lo
  double hi, lo;
  std::memcpy(&hi, &hi_bits, sizeof hi);
  std::memcpy(&lo, &lo_bits, sizeof lo);
  return (hi - kTwo84Plus52) + lo;
}

inline double unit(uint64_t row_seed, uint64_t j) noexcept {  // uniform in [0, 1)
  return exact_double(splitmix64(row_seed + j) >> 11) * kInv2Pow53;
}

// ln(x) for x in [2^-53, 1] (every u1 of Box-Muller): x = m * 2^k with m in [sqrt(2)/2,
// sqrt(2)), then fdlibm's __ieee754_log kernel (Sun's public-domain minimax polynomial in
// s = f / (2 + f), f = m - 1; error < 1 ulp). Branch-free and call-free, so a loop over a
// row's pairs vectorises (libm's log, sin and cos were two thirds of an insert).
inline double log_unit(double x) noexcept {
  constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kLg1 = 6.666666666666735130e-01, kLg2 = 3.999999999940941908e-01,
                   kLg3 = 2.857142874366239149e-01, kLg4 = 2.222219843214978396e-01,
                   kLg5 = 1.818357216161805012e-01, kLg6 = 1.531383769920937332e-01,
                   kLg7 = 1.479819860511658591e-01;
  constexpr double kSqrt2 = 1.41421356237309504880;
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint64_t mantissa = (bits & 0x000FFFFFFFFFFFFFULL) | 0x3FF0000000000000ULL;
  const uint64_t exponent = (bits >> 52) | 0x4330000000000000ULL;  // the double 2^52 + e
  double m, biased;  // m in [1, 2); integer arithmetic only, so the loop vectorises
  std::memcpy(&m, &mantissa, sizeof m);
  std::memcpy(&biased, &exponent, sizeof biased);
  double k = (biased - 4503599627370496.0) - 1023.0;  // exact
  // Both arms are computed, then selected: GCC does not if-convert (vectorise) a select
  // whose arm is floating-point arithmetic that could trap.
  const bool high = m >= kSqrt2;
  const double m_half = m * 0.5, k_next = k + 1.0;  // exact
  m = high ? m_half : m;
  k = high ? k_next : k;
  const double f = m - 1.0;  // exact
  const double s = f / (2.0 + f);
  const double z = s * s, w = z * z;
  const double t1 = w * (kLg2 + w * (kLg4 + w * kLg6));
  const double t2 = z * (kLg1 + w * (kLg3 + w * (kLg5 + w * kLg7)));
  const double r = t2 + t1;
  const double hfsq = 0.5 * f * f;
  return k * kLn2Hi - ((hfsq - (s * (hfsq + r) + k * kLn2Lo)) - f);
}

// sin and cos of an angle in [0, 2 pi]: reduced by q = nearest multiple of pi/2 (Cody-Waite,
// pi/2 in two parts: q <= 4, so q * kPio2Hi is exact and so is the first subtraction), then
// fdlibm's __kernel_sin/__kernel_cos polynomials on [-pi/4, pi/4] (< 1 ulp), swapped and
// negated by quadrant without branches.
inline void sincos_angle(double angle, double& sin_out, double& cos_out) noexcept {
  constexpr double kTwoOverPi = 6.36619772367581382433e-01;
  constexpr double kPio2Hi = 1.57079632673412561417e+00;  // first 33 bits of pi/2
  constexpr double kPio2Lo = 6.07710050650619224932e-11;  // pi/2 - kPio2Hi
  constexpr double kS1 = -1.66666666666666324348e-01, kS2 = 8.33333333332248946124e-03,
                   kS3 = -1.98412698298579493134e-04, kS4 = 2.75573137070700676789e-06,
                   kS5 = -2.50507602534068634195e-08, kS6 = 1.58969099521155010221e-10;
  constexpr double kC1 = 4.16666666666666019037e-02, kC2 = -1.38888888888741095749e-03,
                   kC3 = 2.48015872894767294178e-05, kC4 = -2.75573143513906633035e-07,
                   kC5 = 2.08757232129817482790e-09, kC6 = -1.13596475577881948265e-11;
  const double q = std::nearbyint(angle * kTwoOverPi);  // 0..4
  const double x = (angle - q * kPio2Hi) - q * kPio2Lo;
  const double z = x * x;
  const double ks = x + z * x * (kS1 + z * (kS2 + z * (kS3 + z * (kS4 + z * (kS5 + z * kS6)))));
  const double r = z * (kC1 + z * (kC2 + z * (kC3 + z * (kC4 + z * (kC5 + z * kC6)))));
  const double hz = 0.5 * z, w = 1.0 - hz;
  const double kc = w + (((1.0 - w) - hz) + z * r);
  // Quadrant n = q mod 4, tested on q itself (0..4) so everything stays in doubles.
  const bool odd = (q == 1.0) | (q == 3.0);
  const double s = odd ? kc : ks;  // sin(x + n pi/2), up to sign
  const double c = odd ? ks : kc;
  const double minus_s = -s, minus_c = -c;
  sin_out = (q == 2.0) | (q == 3.0) ? minus_s : s;
  cos_out = (q == 1.0) | (q == 2.0) ? minus_c : c;
}

// Box-Muller for one pair of uniforms: both elements from one log, one sqrt and one sin/cos
// of the same angle (docs/semantics.md, "Initializers").
inline void gaussian_pair(double u1, double u2, double& even, double& odd) noexcept {
  const double r = std::sqrt(-2.0 * log_unit(u1));
  double s, c;
  sincos_angle(kTwoPi * u2, s, c);
  even = r * c;
  odd = r * s;
}

// Element j of the attempt starting at stream position `base` (TruncatedNormal redraws).
inline double gaussian(uint64_t row_seed, uint64_t base, size_t j) noexcept {
  double even, odd;
  const size_t p = j / 2;
  gaussian_pair(1.0 - unit(row_seed, base + 2 * p), unit(row_seed, base + 2 * p + 1), even, odd);
  return j % 2 == 0 ? even : odd;
}

// A Normal or TruncatedNormal row, kChunk pairs at a time: the uniforms first, then
// Box-Muller over the arrays, then the float32 values (and, for TruncatedNormal, the rare
// redraws); each of the three loops vectorises.
inline void gaussian_row(const InitializerConfig& init, uint64_t row_seed, float* out,
                         size_t dim) noexcept {
  constexpr size_t kChunk = 32;
  double u1[kChunk], u2[kChunk], even[kChunk], odd[kChunk];
  const size_t pairs = (dim + 1) / 2;
  for (size_t p0 = 0; p0 < pairs; p0 += kChunk) {
    const size_t count = std::min(kChunk, pairs - p0);
    for (size_t p = 0; p < count; ++p) {
      u1[p] = 1.0 - unit(row_seed, 2 * (p0 + p));  // (0, 1]: log is finite
      u2[p] = unit(row_seed, 2 * (p0 + p) + 1);
    }
    for (size_t p = 0; p < count; ++p) gaussian_pair(u1[p], u2[p], even[p], odd[p]);
    if (init.kind == InitializerKind::kNormal) {
      // No redraws: a loop over whole pairs that vectorises (the per-element loop below,
      // with its redraw test, was 20% of a Normal row's time, perf).
      float* o = out + 2 * p0;
      const size_t whole = std::min(count, (dim - 2 * p0) / 2);
      for (size_t p = 0; p < whole; ++p) {
        o[2 * p] = static_cast<float>(init.a + init.b * even[p]);
        o[2 * p + 1] = static_cast<float>(init.a + init.b * odd[p]);
      }
      if (whole < count) o[2 * whole] = static_cast<float>(init.a + init.b * even[whole]);
      continue;
    }
    for (size_t p = 0; p < count; ++p) {
      for (size_t e = 0; e < 2 && 2 * (p0 + p) + e < dim; ++e) {
        const size_t j = 2 * (p0 + p) + e;
        double z = e == 0 ? even[p] : odd[p];
        // TruncatedNormal redraws beyond two standard deviations; P(|z| > 2) ~ 4.6%, so
        // this ends quickly.
        for (uint64_t attempt = 1;
             init.kind == InitializerKind::kTruncatedNormal && std::fabs(z) > 2.0; ++attempt) {
          z = gaussian(row_seed, attempt * kAttemptStride, j);
        }
        out[j] = static_cast<float>(init.a + init.b * z);
      }
    }
  }
}

inline void initial_row_kernel(const InitializerConfig& init, uint64_t id, float* out,
                               size_t dim) noexcept {
  const uint64_t row_seed = splitmix64(id ^ splitmix64(init.seed));
  switch (init.kind) {
    case InitializerKind::kZeros:
      for (size_t j = 0; j < dim; ++j) out[j] = 0.0f;
      return;
    case InitializerKind::kUniform:
      for (size_t j = 0; j < dim; ++j) {
        out[j] = static_cast<float>(init.a + (init.b - init.a) * unit(row_seed, j));
      }
      return;
    case InitializerKind::kNormal:
    case InitializerKind::kTruncatedNormal: gaussian_row(init, row_seed, out, dim); return;
  }
}

#if EMBSTORE_HAS_AVX2_KERNELS
EMBSTORE_KERNEL_TARGET_AVX2 void initial_row_avx2(const InitializerConfig& init, uint64_t id,
                                                  float* out, size_t dim) noexcept {
  initial_row_kernel(init, id, out, dim);
}
#endif

}  // namespace

void initial_row(const InitializerConfig& init, uint64_t id, float* out, size_t dim) noexcept {
#if EMBSTORE_HAS_AVX2_KERNELS
  if (simd_level() == SimdLevel::kAvx2) return initial_row_avx2(init, id, out, dim);
#endif
  initial_row_kernel(init, id, out, dim);
}

}  // namespace embstore
