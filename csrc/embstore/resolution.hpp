// File: embstore/resolution.hpp
//
// RowResolution: where a training lookup (insert=True) found or put each of its ids - shard
// and row. A trainer's backward applies gradients to exactly the ids its forward looked up,
// so the table keeps the last such resolution and the next apply_gradients of the same keys
// takes it: for each id it checks, under the shard lock, that the recorded row still holds
// that id (occupied, and its metadata names the id - the metadata line the apply reads
// anyway to sum duplicates) and uses it without hashing or probing the index (a cache miss
// per id). A row that changed hands since (evicted, erased, reused) fails the check and the
// id is probed as usual, so reuse never changes a result.
#pragma once

#include <cstdint>  // uint64_t
#include <vector>   // std::vector

namespace embstore {

struct RowResolution {
  static constexpr uint64_t kUnresolved = ~uint64_t{0};  // no row recorded: probe

  std::vector<uint64_t> keys;    // the lookup's ids, in order
  std::vector<uint64_t> places;  // per id: shard << 32 | shard-local row, or kUnresolved
  bool valid = false;

  static uint64_t place(size_t shard, uint32_t row) noexcept {
    return static_cast<uint64_t>(shard) << 32 | row;
  }
};

}  // namespace embstore
