// File: insert_kernel.cpp
//
// The locked path of lookups: requests the lock-free read could not finish (an id to insert,
// a table that tracks steps, a race it could not recover from). Each shard's ids are
// resolved under its lock in id order, inserting missing ids, so which rows are evicted does
// not depend on the thread count; rows are then pooled in bag order.
#include <algorithm>  // std::min
#include <atomic>     // std::atomic
#include <cstdint>    // uint32_t, uint64_t
#include <cstring>    // std::memcpy, std::memset
#include <optional>   // std::optional

#include "embstore/errors.hpp"                 // CapacityError
#include "embstore/hash.hpp"                   // mix64
#include "embstore/internal/batch_runner.hpp"  // BatchRunner
#include "embstore/internal/tuning.hpp"        // kSlotAhead, kRowAhead, kPlacedRowAhead, kRing

namespace embstore {

using detail::kPlacedRowAhead;
using detail::kRing;
using detail::kRowAhead;
using detail::kSlotAhead;
using detail::prefetch_lines;

namespace {

// Writes one gathered id's row to out: zeros for a miss (src == nullptr), w * row as the
// pooling spec sums it (0 + w * row) when weighted, 0 + row when `pooled`, else a copy.
inline void write_gathered(float* __restrict out, const float* __restrict src, const float* weight,
                           bool pooled, size_t dim) noexcept {
  if (src == nullptr) {
    std::memset(out, 0, dim * sizeof(float));
  } else if (weight != nullptr) {
    const float w = *weight;
    for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + w * src[k];
  } else if (pooled) {
    for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + src[k];
  } else {
    std::memcpy(out, src, dim * sizeof(float));
  }
}

}  // namespace

// Copies the rows of shard s's ids to dst[i] (scaled by weights[i] when given), inserting
// missing ids when `insert`; misses read zeros otherwise.
//
// Software pipeline (random gathers are latency-bound): the index slot of id j+16 is
// prefetched, id j is resolved to its row (which is prefetched), and the copy of id j-8
// completes. Resolution (find, reference bit, insert) stays in id order; before an insert
// the pending copies are drained, so an eviction can never take a row still to be copied.
// `pooled`: dst is a one-id-per-bag pooled output, so each value is 0 + w * row exactly as
// the pooling spec sums (this turns a -0 row element into +0, like a numpy sum would).
// `places`: where to record each id's row (RowResolution), or nullptr; then versions[s]
// gets the shard's version after the pass if every recorded row still holds its id
// (RowResolution::versions), else RowResolution::kUnknownVersion.
//
// `pass` (with places): copy nothing while no recorded row can have been evicted - the
// caller pools straight from the recorded rows (pool_places), which spares a copy of every
// row into a buffer and a second pass over it. Inserts then
// sweep at most as far as keeps every row visited once (sweep_budget); an insert that
// needs more first copies the rows recorded so far, and the pass goes on copying.
// pass[s] gets the shard's version after the pass, or kCopiedShard if it copied.
// `count_reads`: add the hits and misses to the counters (false for a redo).
void BatchRunner::gather_shard(Table& t, size_t s, const uint64_t* keys, const Workspace& ws,
                               bool insert, const float* weights, bool pooled, float* dst,
                               uint64_t* places, uint64_t* versions, uint64_t* pass,
                               bool count_reads) {
  const uint32_t b = ws.shard_begin[s], e = ws.shard_begin[s + 1];
  if (b == e) {
    if (pass != nullptr) pass[s] = kCopiedShard;  // (no id reads from it)
    return;
  }
  const size_t dim = t.dim();
  Shard& sh = *t.shards_[s];
  const bool track = t.track_steps_.load(std::memory_order_relaxed);
  const uint32_t step = t.step();
  CountMinSketch* sketch = t.sketches_.empty() ? nullptr : &t.sketches_[s];
  const uint32_t min_count = t.config_.admission.min_count;
  uint64_t hits = 0, misses = 0, inserts = 0, evictions = 0, rejected = 0;
  uint32_t ring[kRing];
  uint32_t done = b;  // ids [b, done) are copied
  bool copying = pass == nullptr;
  auto finish = [&](uint32_t jj, uint32_t row) {
    const uint32_t i = ws.order[jj];
    write_gathered(dst + static_cast<size_t>(i) * dim, row == kNoRow ? nullptr : t.row_ptr(sh, row),
                   weights != nullptr ? weights + i : nullptr, pooled, dim);
  };
  const auto lock = sh.lock();
  const uint64_t swept_before = sh.sweep_steps();
  const uint32_t ring_rows = sh.claimed_rows();
  // How far the next sweep may go with no row passed twice in this pass.
  const auto sweep_budget = [&]() -> uint64_t {
    const uint64_t swept = sh.sweep_steps() - swept_before;
    return swept + 1 < ring_rows ? ring_rows - 1 - swept : 0;
  };
  std::optional<Shard::WriteScope> writing;  // inserts change the shard
  if (insert) writing.emplace(sh);
  const bool cow = t.snapshot_join(sh);  // checkpoint in progress: preserve before writing
  for (uint32_t j = b; j < e; ++j) {
    prefetch_inputs(ws, j, e, keys, places, nullptr);
    if (j + kSlotAhead < e) sh.prefetch(mix64(keys[ws.order[j + kSlotAhead]]));
    const uint64_t id = keys[ws.order[j]];
    const uint64_t hash = mix64(id);
    // A lookup that cannot insert read-marks its rows' slots (see kReadMark).
    uint32_t row = insert ? sh.find(id, hash) : sh.find_and_mark(id, hash);
    if (row != kNoRow) {
      ++hits;
      if (insert) sh.reference(row);
      if (track) t.touch_step(s, row, step, cow);
    } else {
      ++misses;
      if (insert && sketch != nullptr && sketch->add(hash) < min_count) {
        ++rejected;  // not admitted yet: reads zeros, gets no row
      } else if (insert) {
        if (copying)
          while (done < j) finish(done, ring[done % kRing]), ++done;
        row = copying ? t.insert_locked(s, id, hash, step, evictions)
                      : t.insert_locked(s, id, hash, step, evictions, sweep_budget());
        if (row == kRetry) {  // from here on a recorded row may be evicted: copy them
          for (; done < j; ++done) {
            const uint64_t place = places[ws.order[done]];
            finish(done,
                   place == RowResolution::kUnresolved ? kNoRow : static_cast<uint32_t>(place));
          }
          copying = true;
          row = t.insert_locked(s, id, hash, step, evictions);
        }
        if (row == kNoRow) {
          add_counters(sh, count_reads ? hits : 0, count_reads ? misses : 0, inserts, evictions,
                       rejected);
          throw CapacityError(t.no_row_message(id, s));
        }
        ++inserts;
      }
    }
    ring[j % kRing] = row;
    if (places != nullptr) {
      places[ws.order[j]] =
          row == kNoRow ? RowResolution::kUnresolved : RowResolution::place(s, row);
    }
    if (copying) {
      if (row != kNoRow) prefetch_lines(t.row_ptr(sh, row), dim * sizeof(float));
      if (j - done >= kRowAhead) finish(done, ring[done % kRing]), ++done;
    }
  }
  if (copying)
    while (done < e) finish(done, ring[done % kRing]), ++done;
  add_counters(sh, count_reads ? hits : 0, count_reads ? misses : 0, inserts, evictions, rejected);
  if (places != nullptr) {
    // A row recorded earlier in this pass can have been evicted by a later insert only if
    // the hand came round to it twice (a recorded row's bit is set when recorded).
    const bool exact = sh.sweep_steps() - swept_before < ring_rows;
    writing.reset();
    const uint64_t now = sh.version_locked();
    versions[s] = exact ? now : RowResolution::kUnknownVersion;
    if (pass != nullptr) pass[s] = copying ? kCopiedShard : now;
  }
}

// Pools bags [bag_lo, bag_hi) of r from the rows a record-only locked pass left in
// `places` (see gather_shard's `pass`), reading rows of copied shards from `copies`. Reads
// without the lock, validated against the pass's versions: false if a writer came since
// (the caller then redoes the request).
bool BatchRunner::pool_places(Table& t, const LookupSumRequest& r, const uint64_t* places,
                              const uint64_t* pass, const float* copies, size_t bag_lo,
                              size_t bag_hi) {
  const bool all_noted = notes_all_up_front(t, r, bag_lo, bag_hi);
  return by_width(t.dim(), [&](auto width) {
    constexpr size_t kDim = decltype(width)::value;
    if (all_noted) {
      return pool_places_impl<kDim, true>(t, r, places, pass, copies, bag_lo, bag_hi);
    }
    return pool_places_impl<kDim, false>(t, r, places, pass, copies, bag_lo, bag_hi);
  });
}
template <size_t kDim, bool kAllNoted>
bool BatchRunner::pool_places_impl(Table& t, const LookupSumRequest& r, const uint64_t* places,
                                   const uint64_t* pass, const float* copies, size_t bag_lo,
                                   size_t bag_hi) {
  const size_t dim = kDim != 0 ? kDim : t.dim();
  const float* zeros = zero_row(dim);
  const Table::ShardView* views = t.views_.data();
  const size_t stride = t.arena_.stride();
  const size_t lo = static_cast<size_t>(r.offsets[bag_lo]);
  const size_t hi = static_cast<size_t>(r.offsets[bag_hi]);
  ShardVersions versions(t);
  if (kAllNoted && !versions.note_all_at(pass)) return false;
  // Id j's row, or nullptr if its shard changed since the pass.
  const auto row_at = [&](size_t j) -> const float* {
    const uint64_t place = places[j];
    if (place == RowResolution::kUnresolved) return zeros;
    const size_t s = place >> 32;
    if (pass[s] == kCopiedShard) return copies + j * dim;
    if (!kAllNoted && !versions.note_at(s, pass[s])) return nullptr;
    return views[s].rows + static_cast<uint32_t>(place) * stride;
  };
  const float* rows[kRing];  // id j's row at j % kRing, from its prefetch
  const auto fetch = [&](size_t j) -> bool {
    const float* row = row_at(j);
    if (row == nullptr) return false;
    prefetch_lines(row, dim * sizeof(float));
    rows[j % kRing] = row;
    return true;
  };
  for (size_t j = lo; j < std::min(hi, lo + kPlacedRowAhead); ++j) {
    if (!fetch(j)) return false;
  }
  const auto row_of = [&](size_t j) -> const float* {
    if (j + kPlacedRowAhead < hi && !fetch(j + kPlacedRowAhead)) return nullptr;
    return rows[j % kRing];
  };
  const std::atomic<bool> never{false};
  return write_bags<kDim>(r, bag_lo, bag_hi, dim, never, row_of) && versions.valid();
}

// out[b] = rows[offsets[b]] (+ ...) in order, optionally weighted; mean divides by count.
void BatchRunner::pool_bags(const LookupSumRequest& r, size_t dim, const float* rows, size_t bag_lo,
                            size_t bag_hi) {
  for (size_t bag = bag_lo; bag < bag_hi; ++bag) {
    float* __restrict out = r.out + bag * dim;
    const size_t lo = static_cast<size_t>(r.offsets[bag]);
    const size_t hi = static_cast<size_t>(r.offsets[bag + 1]);
    if (lo == hi) {
      std::memset(out, 0, dim * sizeof(float));
      continue;
    }
    // s = 0; s = s + row_i ... (docs/semantics.md): the leading 0 + is not a no-op for -0.
    const float* __restrict first = rows + lo * dim;
    if (r.weights == nullptr) {
      for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + first[k];
      for (size_t i = lo + 1; i < hi; ++i) {
        const float* __restrict src = rows + i * dim;
        for (size_t k = 0; k < dim; ++k) out[k] = out[k] + src[k];
      }
    } else {
      const float w0 = r.weights[lo];
      for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + w0 * first[k];
      for (size_t i = lo + 1; i < hi; ++i) {
        const float* __restrict src = rows + i * dim;
        const float w = r.weights[i];
        for (size_t k = 0; k < dim; ++k) out[k] = out[k] + w * src[k];
      }
    }
    if (r.mode == PoolMode::kMean) {
      const float count = static_cast<float>(hi - lo);
      for (size_t k = 0; k < dim; ++k) out[k] = out[k] / count;
    }
  }
}

}  // namespace embstore
