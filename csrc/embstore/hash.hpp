// File: embstore/hash.hpp
//
// Id mixing for the sharded index. Feature ids arrive structured (sequential, or already
// hashed); `mix64` spreads them over all 64 bits so that the shard (high bits) and the slot
// inside a shard (low bits) are independent and evenly loaded.
#pragma once

#include <cstdint>  // uint64_t, uint32_t

namespace embstore {

// splitmix64 (Steele, Lea & Flood): a bijection on uint64, so distinct ids never collide
// before the table's own probing. The same function defines initializer streams and the
// benchmark key stream (WORKLOADS.md), so it is part of the documented contract.
inline uint64_t splitmix64(uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline uint64_t mix64(uint64_t id) noexcept { return splitmix64(id); }

// Maps the low 32 bits of a mixed hash onto [0, n) without a division (Lemire's fastrange),
// so slot counts need not be powers of two and the index wastes no memory rounding up.
inline uint32_t fast_range32(uint64_t hash, uint32_t n) noexcept {
  return static_cast<uint32_t>((static_cast<uint64_t>(static_cast<uint32_t>(hash)) * n) >> 32);
}

}  // namespace embstore
