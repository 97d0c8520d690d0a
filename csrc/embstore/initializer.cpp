#include "embstore/initializer.hpp"

#include <cmath>  // std::log, std::sqrt, std::cos, std::sin

#include "embstore/hash.hpp"  // splitmix64

namespace embstore {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr double kInv2Pow53 = 1.0 / 9007199254740992.0;  // 2^-53: 53 random mantissa bits
constexpr uint64_t kAttemptStride = uint64_t{1} << 32;   // TruncatedNormal redraws

inline double unit(uint64_t row_seed, uint64_t j) noexcept {  // uniform in [0, 1)
  return static_cast<double>(splitmix64(row_seed + j) >> 11) * kInv2Pow53;
}

// Box-Muller over the pair (2p, 2p+1) of stream positions offset by `base`: both elements
// from one log, one sqrt and one sin/cos of the same angle (GCC computes the two with one
// sincos call). Evaluating element by element paid the log and sqrt twice per pair (a
// third of an insert-heavy W2 step went to the initializer); same expressions, same bits.
inline void gaussian_pair(uint64_t row_seed, uint64_t base, size_t p, double& even,
                          double& odd) noexcept {
  const double u1 = 1.0 - unit(row_seed, base + 2 * p);  // (0, 1]: log is finite
  const double u2 = unit(row_seed, base + 2 * p + 1);
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double angle = kTwoPi * u2;
  even = r * std::cos(angle);
  odd = r * std::sin(angle);
}

// Element j of the attempt starting at stream position `base`.
inline double gaussian(uint64_t row_seed, uint64_t base, size_t j) noexcept {
  double even, odd;
  gaussian_pair(row_seed, base, j / 2, even, odd);
  return j % 2 == 0 ? even : odd;
}

}  // namespace

void initial_row(const InitializerConfig& init, uint64_t id, float* out, size_t dim) noexcept {
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
    case InitializerKind::kTruncatedNormal:
      for (size_t j = 0; j < dim; j += 2) {
        double z[2];
        gaussian_pair(row_seed, 0, j / 2, z[0], z[1]);
        for (size_t e = 0; e < 2 && j + e < dim; ++e) {
          // TruncatedNormal redraws beyond two standard deviations; P(|z| > 2) ~ 4.6%, so
          // this ends quickly.
          for (uint64_t attempt = 1;
               init.kind == InitializerKind::kTruncatedNormal && std::fabs(z[e]) > 2.0;
               ++attempt) {
            z[e] = gaussian(row_seed, attempt * kAttemptStride, j + e);
          }
          out[j + e] = static_cast<float>(init.a + init.b * z[e]);
        }
      }
      return;
  }
}

}  // namespace embstore
