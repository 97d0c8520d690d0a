// File: embstore/validate.cpp
//
// The argument checks every batch call runs before anything changes (validate.hpp).
#include "embstore/validate.hpp"

#include <algorithm>  // std::max
#include <cmath>      // std::isfinite
#include <cstring>    // std::memcpy
#include <stdexcept>  // std::invalid_argument
#include <string>     // std::to_string

#include "embstore/internal/batch_common.hpp"  // prefix
#include "embstore/simd.hpp"                   // simd_level, EMBSTORE_KERNEL_TARGET_AVX2

namespace embstore {
namespace {

using detail::prefix;

// Whether every float is finite: an exponent of all ones is Inf or NaN. Integer bit tests,
// max-reduced without an early exit, so the loop vectorises (a per-element isfinite loop
// with a throw in it does not).
inline bool all_finite_kernel(const float* x, size_t count) noexcept {
  constexpr uint32_t kExponent = 0x7F800000u;
  uint32_t top = 0;  // the largest exponent field seen; kExponent only for Inf or NaN
  for (size_t k = 0; k < count; ++k) {
    uint32_t bits;
    std::memcpy(&bits, x + k, sizeof(bits));
    top = std::max(top, bits & kExponent);
  }
  return top != kExponent;
}
#if EMBSTORE_HAS_AVX2_KERNELS
EMBSTORE_KERNEL_TARGET_AVX2 bool all_finite_avx2(const float* x, size_t count) noexcept {
  return all_finite_kernel(x, count);
}
#endif
bool all_finite(const float* x, size_t count) noexcept {
#if EMBSTORE_HAS_AVX2_KERNELS
  if (simd_level() == SimdLevel::kAvx2) return all_finite_avx2(x, count);
#endif
  return all_finite_kernel(x, count);
}

// Whether offsets[0..num_bags] never decrease, and the longest bag. Branch-free so that the
// loop vectorises (with the throw inside it did not, and one-id bags made it a visible part
// of a small-batch step). Unsigned differences: a decreasing pair may wrap, but then
// `ordered` is false and `longest` is not used.
struct OffsetScan {
  bool ordered;
  uint64_t longest;
};
inline OffsetScan scan_offsets_kernel(const int64_t* offsets, size_t num_bags) noexcept {
  uint64_t decreasing = 0, longest = 0;
  for (size_t b = 0; b < num_bags; ++b) {
    decreasing |= static_cast<uint64_t>(offsets[b + 1] < offsets[b]);
    longest = std::max(longest,
                       static_cast<uint64_t>(offsets[b + 1]) - static_cast<uint64_t>(offsets[b]));
  }
  return {decreasing == 0, longest};
}
#if EMBSTORE_HAS_AVX2_KERNELS
EMBSTORE_KERNEL_TARGET_AVX2 OffsetScan scan_offsets_avx2(const int64_t* offsets,
                                                         size_t num_bags) noexcept {
  return scan_offsets_kernel(offsets, num_bags);
}
#endif
OffsetScan scan_offsets(const int64_t* offsets, size_t num_bags) noexcept {
#if EMBSTORE_HAS_AVX2_KERNELS
  if (simd_level() == SimdLevel::kAvx2) return scan_offsets_avx2(offsets, num_bags);
#endif
  return scan_offsets_kernel(offsets, num_bags);
}

}  // namespace

// Checks CSR offsets; returns the longest bag. Throws std::invalid_argument.
size_t validate_offsets(const int64_t* offsets, size_t num_bags, size_t n,
                        const std::string& label) {
  if (offsets[0] != 0) {
    throw std::invalid_argument(prefix(label) + "offsets[0] must be 0, got " +
                                std::to_string(offsets[0]));
  }
  const OffsetScan scan = scan_offsets(offsets, num_bags);
  for (size_t b = 0; !scan.ordered && b < num_bags; ++b) {  // name the first decrease
    if (offsets[b + 1] < offsets[b]) {
      throw std::invalid_argument(prefix(label) + "offsets must be non-decreasing: offsets[" +
                                  std::to_string(b) + "]=" + std::to_string(offsets[b]) +
                                  " > offsets[" + std::to_string(b + 1) +
                                  "]=" + std::to_string(offsets[b + 1]));
    }
  }
  if (offsets[num_bags] != static_cast<int64_t>(n)) {
    throw std::invalid_argument(prefix(label) + "offsets[-1] must equal len(keys)=" +
                                std::to_string(n) + ", got " + std::to_string(offsets[num_bags]));
  }
  return static_cast<size_t>(scan.longest);
}

void validate_finite(const float* x, size_t count, const char* name, const std::string& label) {
  if (all_finite(x, count)) return;
  for (size_t k = 0; k < count; ++k) {
    if (!std::isfinite(x[k])) {
      throw std::invalid_argument(prefix(label) + name + " must be finite: element " +
                                  std::to_string(k) + " is " + std::to_string(x[k]));
    }
  }
}

}  // namespace embstore
