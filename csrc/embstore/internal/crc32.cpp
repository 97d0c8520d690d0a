#include "embstore/internal/crc32.hpp"

#include <array>    // std::array
#include <cstring>  // std::memcpy

#if defined(__x86_64__)
#include <immintrin.h>  // _mm_clmulepi64_si128 and SSE2
#define EMBSTORE_CRC_PCLMUL 1
#endif

namespace embstore::internal {
namespace {

// Slicing-by-16 tables: table[k][b] is the crc of byte b followed by k zero bytes, so 16
// input bytes take 16 independent lookups instead of a 16-step dependency chain.
struct Tables {
  std::array<std::array<uint32_t, 256>, 16> t{};
  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
      t[0][b] = c;
    }
    for (size_t k = 1; k < 16; ++k) {
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
    }
  }
};

const Tables& tables() {
  static const Tables instance;
  return instance;
}

// The crc register (not inverted) over p[0, n): slicing-by-16, then byte by byte.
uint32_t crc_tables(const unsigned char* p, size_t n, uint32_t c) noexcept {
  const auto& t = tables().t;
  while (n >= 16) {
    uint32_t w[4];
    std::memcpy(w, p, 16);  // little-endian hosts only (as the whole format)
    w[0] ^= c;
    c = t[15][w[0] & 0xFF] ^ t[14][(w[0] >> 8) & 0xFF] ^ t[13][(w[0] >> 16) & 0xFF] ^
        t[12][w[0] >> 24] ^ t[11][w[1] & 0xFF] ^ t[10][(w[1] >> 8) & 0xFF] ^
        t[9][(w[1] >> 16) & 0xFF] ^ t[8][w[1] >> 24] ^ t[7][w[2] & 0xFF] ^
        t[6][(w[2] >> 8) & 0xFF] ^ t[5][(w[2] >> 16) & 0xFF] ^ t[4][w[2] >> 24] ^
        t[3][w[3] & 0xFF] ^ t[2][(w[3] >> 8) & 0xFF] ^ t[1][(w[3] >> 16) & 0xFF] ^ t[0][w[3] >> 24];
    p += 16;
    n -= 16;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

#ifdef EMBSTORE_CRC_PCLMUL
// Carry-less multiplication folding (Intel, "Fast CRC Computation for Generic Polynomials
// Using PCLMULQDQ"; the reflected constants of zlib's polynomial): four 128-bit lanes fold
// 64 bytes per step, then one lane, then a Barrett reduction to 32 bits. n >= 64 and a
// multiple of 16; returns the crc register like crc_tables. Several times faster than the
// tables, so a checkpoint's checksums cost little next to its copy and I/O.
// x.lo * k.lo ^ x.hi * k.hi ^ next: one lane folded 128 bits forward onto `next`.
__attribute__((target("pclmul,sse2"))) inline __m128i fold(__m128i x, __m128i k,
                                                           __m128i next) noexcept {
  const __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  const __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

__attribute__((target("pclmul,sse2"))) uint32_t crc_pclmul(const unsigned char* p, size_t n,
                                                           uint32_t c) noexcept {
  auto load = [](const unsigned char* q) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  };
  const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
  const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);
  const __m128i poly = _mm_set_epi64x(0x1f7011641LL, 0x1db710641LL);  // u, P'
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  p += 64;
  n -= 64;
  while (n >= 64) {
    x1 = fold(x1, k1k2, load(p));
    x2 = fold(x2, k1k2, load(p + 16));
    x3 = fold(x3, k1k2, load(p + 32));
    x4 = fold(x4, k1k2, load(p + 48));
    p += 64;
    n -= 64;
  }
  x1 = fold(x1, k3k4, x2);
  x1 = fold(x1, k3k4, x3);
  x1 = fold(x1, k3k4, x4);
  while (n >= 16) {
    x1 = fold(x1, k3k4, load(p));
    p += 16;
    n -= 16;
  }
  // 128 -> 64 bits (appending 32 zero bits), then 64 -> 32 with k5.
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(k3k4, x1, 0x01), _mm_srli_si128(x1, 8));
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00),
                     _mm_srli_si128(x1, 4));
  // Barrett reduction to the 32-bit remainder.
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), poly, 0x00);
  x1 = _mm_xor_si128(x1, t);
  return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_srli_si128(x1, 4)));
}

bool has_pclmul() noexcept {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse2");
  return yes;
}
#endif

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#ifdef EMBSTORE_CRC_PCLMUL
  if (n >= 64 && has_pclmul()) {
    const size_t head = n & ~size_t{15};
    c = crc_pclmul(p, head, c);
    p += head;
    n -= head;
  }
#endif
  return ~crc_tables(p, n, c);
}

uint32_t crc32_portable(const void* data, size_t n, uint32_t crc) noexcept {
  return ~crc_tables(static_cast<const unsigned char*>(data), n, ~crc);
}

}  // namespace embstore::internal
