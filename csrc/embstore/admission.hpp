// File: embstore/admission.hpp
//
// CountMinSketch: the admission filter's fixed-size counter of how often ids were seen.
// An id is admitted (gets a row) once its estimated count reaches `min_count`.
//
// Count-min with conservative update: `add` raises only the counters that equal the current
// minimum, which never lowers an estimate below the true count and reduces over-estimation
// (hence over-admission) compared to raising all `depth` counters. Counters are uint16 and
// saturate. The table keeps one sketch per shard (width / num_shards columns each), guarded
// by that shard's lock: ids never cross shards, so this is statistically the same filter as
// one global sketch of `width` columns, with no shared counter on the hot path.
#pragma once

#include <algorithm>  // std::min
#include <cstddef>    // size_t
#include <cstdint>    // uint16_t, uint32_t, uint64_t
#include <vector>     // std::vector

#include "embstore/hash.hpp"  // mix64, fast_range32

namespace embstore {

class CountMinSketch {
 public:
  static constexpr uint32_t kMaxCount = 0xFFFF;

  CountMinSketch(size_t width, size_t depth)
      : width_(static_cast<uint32_t>(width)), depth_(depth), counters_(width * depth, 0) {}

  // Counts one more sighting of the id whose mix64 is `hash`; returns its new estimate.
  uint32_t add(uint64_t hash) noexcept {
    uint32_t cols[kMaxDepth];
    const uint32_t current = estimate(hash, cols);
    if (current >= kMaxCount) return current;
    for (size_t d = 0; d < depth_; ++d) {
      uint16_t& c = counters_[d * width_ + cols[d]];
      if (c == current) c = static_cast<uint16_t>(current + 1);
    }
    return current + 1;
  }

  // Estimated sightings of the id whose mix64 is `hash` (never below the true count).
  uint32_t estimate(uint64_t hash) const noexcept {
    uint32_t cols[kMaxDepth];
    return estimate(hash, cols);
  }

  size_t bytes() const noexcept { return counters_.size() * sizeof(uint16_t); }
  // The raw counters (depth rows of width columns), for checkpoints.
  const std::vector<uint16_t>& counters() const noexcept { return counters_; }
  std::vector<uint16_t>& counters() noexcept { return counters_; }

  static constexpr size_t kMaxDepth = 16;

 private:
  // Column of each row: double hashing over a second mix of the id's hash (the table uses
  // the top bits of `hash` for the shard and the index, so the sketch rehashes).
  uint32_t estimate(uint64_t hash, uint32_t* cols) const noexcept {
    const uint64_t h = mix64(hash ^ 0x9E3779B97F4A7C15ULL);
    const uint32_t h1 = static_cast<uint32_t>(h);
    const uint32_t h2 = static_cast<uint32_t>(h >> 32) | 1u;
    uint32_t least = kMaxCount;
    for (size_t d = 0; d < depth_; ++d) {
      const uint32_t mixed = h1 + static_cast<uint32_t>(d) * h2;
      cols[d] = fast_range32(mixed, width_);
      least = std::min<uint32_t>(least, counters_[d * width_ + cols[d]]);
    }
    return least;
  }

  uint32_t width_;
  size_t depth_;
  std::vector<uint16_t> counters_;
};

}  // namespace embstore
