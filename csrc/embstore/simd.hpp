// File: embstore/simd.hpp
//
// Runtime choice of the instruction set for the hot batch kernels (the forward read kernel
// and the fused apply). Wheels are built for baseline x86-64 (never -march=native), so the
// kernels are compiled twice: as is, and inside a wrapper carrying
// EMBSTORE_KERNEL_TARGET_AVX2, whose `flatten` inlines the whole kernel (row loops, hashing,
// probing) into it so all of it gets AVX2 (8 floats per instruction) and BMI2 (shifts by a
// register without the flags dance). The wrapper runs only when the CPU has those features.
//
// Results are identical bit for bit at either level: the kernels do the same float
// operations in the same order, and FMA stays off (no contraction: -ffp-contract=off, and the
// target list leaves out "fma"), so only the vector width changes.
//
// The level is fixed at first use from the CPU, or from the environment variable
// EMBSTORE_SIMD=baseline|avx2 (an unsupported request falls back to baseline); tests switch
// it with set_simd_level to check that both levels agree.
#pragma once

namespace embstore {

enum class SimdLevel { kBaseline = 0, kAvx2 = 1 };

// The level the kernels use now.
SimdLevel simd_level() noexcept;
// Whether this CPU (and build) can run `level`.
bool simd_supported(SimdLevel level) noexcept;
// Switches the kernels to `level`; returns false (and changes nothing) if unsupported.
// Safe to call at any time: a batch reads the level once, when its kernel starts.
bool set_simd_level(SimdLevel level) noexcept;
const char* simd_level_name(SimdLevel level) noexcept;

}  // namespace embstore

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#define EMBSTORE_HAS_AVX2_KERNELS 1
#define EMBSTORE_KERNEL_TARGET_AVX2 __attribute__((target("avx2,bmi,bmi2,lzcnt,popcnt"), flatten))
#else
#define EMBSTORE_HAS_AVX2_KERNELS 0
#endif
