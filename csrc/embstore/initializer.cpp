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

// Box-Muller over the pair (2p, 2p+1) of stream positions offset by `base`.
inline double gaussian(uint64_t row_seed, uint64_t base, size_t j) noexcept {
  const uint64_t p = j / 2;
  const double u1 = 1.0 - unit(row_seed, base + 2 * p);  // (0, 1]: log is finite
  const double u2 = unit(row_seed, base + 2 * p + 1);
  const double r = std::sqrt(-2.0 * std::log(u1));
  return (j % 2 == 0) ? r * std::cos(kTwoPi * u2) : r * std::sin(kTwoPi * u2);
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
      for (size_t j = 0; j < dim; ++j) {
        out[j] = static_cast<float>(init.a + init.b * gaussian(row_seed, 0, j));
      }
      return;
    case InitializerKind::kTruncatedNormal:
      for (size_t j = 0; j < dim; ++j) {
        double z = gaussian(row_seed, 0, j);
        // Redraw beyond two standard deviations; P(|z| > 2) ~ 4.6%, so this ends quickly.
        for (uint64_t attempt = 1; std::fabs(z) > 2.0; ++attempt) {
          z = gaussian(row_seed, attempt * kAttemptStride, j);
        }
        out[j] = static_cast<float>(init.a + init.b * z);
      }
      return;
  }
}

}  // namespace embstore
