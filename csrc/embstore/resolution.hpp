// File: embstore/resolution.hpp
//
// RowResolution: where a training lookup (insert=True, lock-free path) found each of its ids -
// shard and row - and the shard versions its reads saw. A trainer's backward applies
// gradients to exactly the ids its forward looked up, so the table keeps the last such
// resolution and the next apply_gradients of the same keys reuses it, for every shard whose
// version has not moved since: no hashing and no index probe (a cache miss per id) in the
// backward. A shard whose version moved (any write to its index or rows) is probed as usual,
// so reuse never changes a result.
#pragma once

#include <cstdint>  // uint64_t
#include <vector>   // std::vector

namespace embstore {

struct RowResolution {
  // Version markers that never equal a stable (even) shard version.
  static constexpr uint64_t kUnread = ~uint64_t{0};        // no read of the shard
  static constexpr uint64_t kConflict = ~uint64_t{0} - 2;  // reads saw different versions

  std::vector<uint64_t> keys;      // the lookup's ids, in order
  std::vector<uint64_t> places;    // per id: shard << 32 | shard-local row
  std::vector<uint64_t> versions;  // per shard: the version every read of it saw
  bool valid = false;

  // Merges `version`, seen by a read of a shard, into that shard's entry.
  static void note(uint64_t& entry, uint64_t version) noexcept {
    if (entry != version) entry = entry == kUnread ? version : kConflict;
  }
  // Whether the rows of shard s may be reused now that its version is `current` (even:
  // read under the shard lock).
  bool reusable(size_t s, uint64_t current) const noexcept { return versions[s] == current; }
};

}  // namespace embstore
