// File: embstore/internal/tuning.hpp
//
// The batch kernels' pipeline distances and task sizes, each with the reason for its value.
// The measurements behind them (what was tried, kept or dropped) are in docs/tuning.md.
#pragma once

#include <cstddef>  // size_t
#include <cstdint>  // uint32_t

namespace embstore::detail {

constexpr size_t kMaxShards = 4096;       // shard ids are kept in uint16 scratch
constexpr size_t kIdsPerWorker = 1024;    // below this a helper thread costs more than it saves
constexpr size_t kIdsPerReadTask = 4096;  // optimistic lookup task size (whole bags)
constexpr size_t kBagsPerPoolTask = 256;  // locked path's pooling task: ~32-256 KiB of output

// Lock-free read kernel: index slots 32 ids ahead and rows 16 ahead keep ~4 lines per id in
// flight, enough to cover DRAM latency without evicting prefetched lines before their use.
constexpr uint32_t kReadSlotAhead = 32;
constexpr uint32_t kReadRowAhead = 16;
// Locked kernels (lookups that insert, the apply) resolve ids in order under a shard's lock,
// where the longer distances gained nothing.
constexpr uint32_t kSlotAhead = 16;
constexpr uint32_t kRowAhead = 8;
// Ids per shard from which a read task notes every shard's version once, up front.
constexpr size_t kIdsPerNoteAll = 8;
// Ring of ids prefetched or probed and awaiting their read; longer than every distance.
constexpr uint32_t kRing = 64;
static_assert(kSlotAhead < kRing && kRowAhead < kSlotAhead);
static_assert(kReadSlotAhead < kRing && kReadRowAhead < kReadSlotAhead);
// Rows whose places are already known (no slot to wait for) are prefetched further ahead.
constexpr uint32_t kPlacedRowAhead = 24;
static_assert(kPlacedRowAhead < kRing);
// A shard's ids are scattered over its request: fetch each id's key, place and bag line
// before it is hashed (or its place read) kSlotAhead ids ahead.
constexpr uint32_t kInputAhead = 2 * kSlotAhead;
// An apply's update pass over at least kLongUpdate rows, or over rows wider than
// kWideRowBytes, prefetches into L2: into L1 it would wait on its own prefetches.
constexpr uint32_t kLongUpdate = 64;
constexpr size_t kWideRowBytes = 256;
// Locality hint of a prefetch into L2 only (prefetcht2); 3 (the default) is into L1.
constexpr int kToL2 = 1;

}  // namespace embstore::detail
