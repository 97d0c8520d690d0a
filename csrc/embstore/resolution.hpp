// File: embstore/resolution.hpp
//
// RowResolution: where a training lookup (insert=True) found or put each of its ids - shard
// and row. A trainer's backward applies gradients to exactly the ids its forward looked up,
// so the table keeps the last such resolution and the next apply_gradients of the same keys
// takes it: for each id it checks, under the shard lock, that the recorded row still holds
// that id (occupied, and the index slot its link names holds the id) and uses it without
// hashing or probing the index from the id's home. A row that changed hands since (evicted,
// erased, reused) fails the check and the id is probed as usual, so reuse never changes a
// result.
//
// A lookup also records each shard's seqlock version its reads were validated at (the
// lock-free kernel), or that its locked pass left (when no row it recorded was evicted).
// If the shard's version is still that one when the apply takes its lock, nothing has
// written to the shard since, so every recorded row of the shard still holds its id: the
// apply skips the check, and with it two loads per id (the row's link and its slot).
#pragma once

#include <cstdint>  // uint64_t
#include <vector>   // std::vector

namespace embstore {

struct RowResolution {
  static constexpr uint64_t kUnresolved = ~uint64_t{0};  // no row recorded: probe

  std::vector<uint64_t> keys;    // the lookup's ids, in order
  std::vector<uint64_t> places;  // per id: shard << 32 | shard-local row, or kUnresolved
  // Per shard: the version its places were read at, or an odd value when not known (the
  // lookup raced a writer or saw two versions, or its inserts' CLOCK sweeps came round to a
  // row twice, so a row it recorded may since hold an id it inserted).
  std::vector<uint64_t> versions;
  bool valid = false;
  // The lookup set none of its rows' CLOCK reference bits (a lock-free training lookup):
  // whoever consumes the resolution sets them - the apply that takes it (it references
  // every row it updates), or Table::settle_references before a CLOCK sweep or when
  // another resolution replaces this one.
  bool refs_pending = false;
  // The lookup's ids grouped by shard (stable), when its locked pass planned them: the apply
  // of the same ids takes this plan instead of grouping them again.
  std::vector<uint32_t> order;        // (n) positions, shard by shard
  std::vector<uint32_t> shard_begin;  // (S + 1) each shard's first position in `order`
  bool planned = false;

  // A table keeps its last lookup's resolution, in buffers that cycle between the tables
  // and the callers' workspaces: after a large batch (a 64K-id warm-up chunk) they would hold
  // that batch's capacity for good. Buffers over twice what this resolution needs (and over
  // kShrinkAbove ids) are reallocated to fit. A
  // resolution without a plan drops its stale one. (Batches alternating between sizes more
  // than 2x apart reallocate at each keep: a copy of what the batch wrote anyway.)
  static constexpr size_t kShrinkAbove = 16384;
  void shrink_if_oversized() {
    if (!planned) order.clear();
    const auto fit = [n = keys.size()](auto& v) {
      if (v.capacity() > kShrinkAbove && v.capacity() > 2 * n) v.shrink_to_fit();
    };
    fit(keys);
    fit(places);
    fit(order);
  }

  static constexpr uint64_t kUnknownVersion = 1;
  // Whether shard s's places are certainly current for a shard now at version `now`.
  bool exact(size_t s, uint64_t now) const noexcept {
    return s < versions.size() && (versions[s] & 1) == 0 && versions[s] == now;
  }

  static uint64_t place(size_t shard, uint32_t row) noexcept {
    return static_cast<uint64_t>(shard) << 32 | row;
  }
};

}  // namespace embstore
