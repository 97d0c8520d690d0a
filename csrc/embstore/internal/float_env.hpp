// File: embstore/internal/float_env.hpp (internal: not installed)
//
// IEEE denormal handling for the core's float arithmetic, whatever the process set. Linking
// with -ffast-math (GCC's crtfastmath.o) sets the x86 MXCSR flush-to-zero (FTZ) and
// denormals-are-zero (DAZ) modes at startup for every thread; with them a denormal weight,
// gradient or optimizer state gives other bits than the Python package (docs/semantics.md).
//
// DenormalScope clears both modes on the calling thread for the scope of a public call and
// sets back exactly the ones it cleared (exception flags the call raised stay raised, as
// without the scope). Cost: one stmxcsr per call; ldmxcsr only when a mode was set.
// clear_denormal_modes() is for threads the core owns (the pool's helpers), once at start.
// On other architectures both are no-ops.
#pragma once

#if defined(__x86_64__) || (defined(__i386__) && defined(__SSE__))
#include <xmmintrin.h>  // _mm_getcsr, _mm_setcsr
#define EMBSTORE_HAS_MXCSR 1
#else
#define EMBSTORE_HAS_MXCSR 0
#endif

namespace embstore {
namespace detail {

#if EMBSTORE_HAS_MXCSR
constexpr unsigned kMxcsrFlushToZero = 1u << 15;
constexpr unsigned kMxcsrDenormalsAreZero = 1u << 6;
constexpr unsigned kMxcsrDenormalModes = kMxcsrFlushToZero | kMxcsrDenormalsAreZero;

inline void clear_denormal_modes() noexcept {
  const unsigned csr = _mm_getcsr();
  if ((csr & kMxcsrDenormalModes) != 0) _mm_setcsr(csr & ~kMxcsrDenormalModes);
}

class DenormalScope {
 public:
  DenormalScope() noexcept : cleared_(_mm_getcsr() & kMxcsrDenormalModes) {
    if (cleared_ != 0) _mm_setcsr(_mm_getcsr() & ~cleared_);
  }
  ~DenormalScope() {
    if (cleared_ != 0) _mm_setcsr(_mm_getcsr() | cleared_);
  }
  DenormalScope(const DenormalScope&) = delete;
  DenormalScope& operator=(const DenormalScope&) = delete;

 private:
  const unsigned cleared_;  // the modes the caller had set
};
#else
inline void clear_denormal_modes() noexcept {}

class DenormalScope {
 public:
  DenormalScope() noexcept {}
  DenormalScope(const DenormalScope&) = delete;
  DenormalScope& operator=(const DenormalScope&) = delete;
};
#endif

}  // namespace detail
}  // namespace embstore
