// File: embstore/simd.cpp — see simd.hpp.
#include "embstore/simd.hpp"

#include <atomic>   // std::atomic
#include <cstdlib>  // std::getenv
#include <cstring>  // std::strcmp

namespace embstore {
namespace {

bool cpu_has_avx2() noexcept {
#if EMBSTORE_HAS_AVX2_KERNELS
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
#else
  return false;
#endif
}

SimdLevel initial_level() noexcept {
  const char* env = std::getenv("EMBSTORE_SIMD");
  if (env != nullptr && std::strcmp(env, "baseline") == 0) return SimdLevel::kBaseline;
  return cpu_has_avx2() ? SimdLevel::kAvx2 : SimdLevel::kBaseline;
}

std::atomic<int>& level() noexcept {
  static std::atomic<int> current{static_cast<int>(initial_level())};
  return current;
}

}  // namespace

SimdLevel simd_level() noexcept {
  return static_cast<SimdLevel>(level().load(std::memory_order_relaxed));
}

bool simd_supported(SimdLevel l) noexcept {
  return l == SimdLevel::kBaseline || (l == SimdLevel::kAvx2 && cpu_has_avx2());
}

bool set_simd_level(SimdLevel l) noexcept {
  if (!simd_supported(l)) return false;
  level().store(static_cast<int>(l), std::memory_order_relaxed);
  return true;
}

const char* simd_level_name(SimdLevel l) noexcept {
  return l == SimdLevel::kAvx2 ? "avx2" : "baseline";
}

}  // namespace embstore
