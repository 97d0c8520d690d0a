// File: read_kernel.cpp
//
// The lock-free read path of lookups: tasks of whole bags read rows without locks, validated
// by each shard's seqlock version, and pool them straight into the output. A task that races
// a writer is redone row by row (read_bags_careful); an id to insert sends the whole request
// to the locked path (insert_kernel.cpp).
#include <algorithm>  // std::min
#include <atomic>     // std::atomic
#include <cstdint>    // uint64_t
#include <vector>     // std::vector

#include "embstore/hash.hpp"                   // mix64
#include "embstore/internal/batch_runner.hpp"  // BatchRunner
#include "embstore/internal/tuning.hpp"        // kReadSlotAhead, kReadRowAhead, kRing

namespace embstore {

using detail::kReadRowAhead;
using detail::kReadSlotAhead;
using detail::kRing;
using detail::kSlotAhead;
using detail::prefetch_lines;

// The task's bags: the fast kernel, or (careful) the row-by-row retry of a raced task.
void BatchRunner::read_bags(Table& t, const LookupSumRequest& r, size_t bag_lo, size_t bag_hi,
                            std::atomic<bool>& abort, ReadTask& task, uint64_t* places,
                            bool careful) {
  if (careful) return read_bags_careful(t, r, bag_lo, bag_hi, abort, task, places);
  const bool all_noted = notes_all_up_front(t, r, bag_lo, bag_hi);
  by_width(t.dim(), [&](auto width) {
    constexpr size_t kDim = decltype(width)::value;
    if (all_noted) return read_bags_impl<kDim, true>(t, r, bag_lo, bag_hi, abort, task, places);
    read_bags_impl<kDim, false>(t, r, bag_lo, bag_hi, abort, task, places);
  });
}

// Optimistic pooled lookup of bags [bag_lo, bag_hi) of one request, summed straight into
// r.out in bag order (no gather buffer, no lock); `lookup` (offsets == nullptr) copies rows.
// Writes each id's place to places[j].
//
// A software pipeline hashes id j+kReadSlotAhead and prefetches its index slot, probes id
// j+kReadRowAhead and prefetches its row, and adds id j's row to its bag's sum (kept in
// registers for common widths; stored once per bag). The seqlock is validated once per
// shard per task. A task that raced a writer stops and sets task.raced: the caller redoes
// it with read_bags_careful. An id to insert sets `abort`: the caller then runs the whole
// request again on the locked path (gather_shard), which inserts in a deterministic
// order. Each bag is summed by one thread in id order, so results do not depend on thread
// count. The kernel is instruction-bound with rows in cache: each id's shard and home slot
// are computed once (at its prefetch), with one bounds check per id, one compare per probe
// step and version notes chosen at compile time.
template <size_t kDim, bool kAllNoted>
void BatchRunner::read_bags_impl(Table& t, const LookupSumRequest& r, size_t bag_lo, size_t bag_hi,
                                 std::atomic<bool>& abort, ReadTask& task, uint64_t* places) {
  const size_t dim = kDim != 0 ? kDim : t.dim();
  const auto [lo, hi] = start_task(r, bag_lo, bag_hi, task);
  const float* zeros = zero_row(dim);
  ShardVersions versions(t);
  if (kAllNoted && !versions.note_all()) {
    task.raced = true;  // a writer is inside a shard: the careful kernel redoes the task
    return;
  }
  uint32_t shards[kRing];  // id j's shard at j % kRing, from its slot prefetch
  uint32_t homes[kRing];   // ... and the index slot its probe starts at
  const float* rows[kRing];  // id j's row (zeros if absent) at j % kRing, from its probe
  const Table::ShardView* views = t.views_.data();
  const size_t stride = t.arena_.stride();
  const auto prefetch_slot = [&](size_t j) {
    const uint64_t hash = mix64(r.keys[j]);
    const size_t s = t.shard_of(hash);
    const IndexView& index = views[s].index;
    const uint32_t home = index.home(hash);
    shards[j % kRing] = static_cast<uint32_t>(s);
    homes[j % kRing] = home;
    index.prefetch_at(home);
  };
  static_assert(kNoRow > kRetry, "one compare tells a hit from kRetry and kNoRow");
  const auto probe = [&](size_t j) -> bool {
    const size_t s = shards[j % kRing];
    if (!kAllNoted && !versions.note(s)) return false;
    const Table::ShardView& view = views[s];
    // A lookup that cannot insert read-marks its rows' slots (see kReadMark).
    const uint64_t id = r.keys[j];
    const uint32_t home = homes[j % kRing];
    const uint32_t row = r.insert ? view.index.find_optimistic_at(id, home)
                                  : view.index.find_optimistic_at<true>(id, home);
    if (__builtin_expect(row >= kRetry, 0)) {
      if (row == kRetry) return false;
      if (r.insert) {
        abort.store(true, std::memory_order_relaxed);  // an id to insert: the locked path
        return false;
      }
      rows[j % kRing] = zeros;
      places[j] = RowResolution::kUnresolved;
      ++task.misses;
      return true;
    }
    const float* src = view.rows + row * stride;
    prefetch_lines(src, dim * sizeof(float));
    rows[j % kRing] = src;
    places[j] = RowResolution::place(s, row);
    return true;
  };
  // Advances the pipeline to id j: returns id j's row, or nullptr to abort. Ids below
  // `steady` have both pipeline partners in the task (one bounds check per id).
  const size_t steady = hi > kReadSlotAhead ? hi - kReadSlotAhead : 0;
  static_assert(kReadRowAhead < kReadSlotAhead,
                "j < hi - kReadSlotAhead implies j + kReadRowAhead < hi");
  const auto row_of = [&](size_t j) -> const float* {
    if (j < steady) {
      prefetch_slot(j + kReadSlotAhead);
      if (!probe(j + kReadRowAhead)) return nullptr;
    } else if (j + kReadRowAhead < hi && !probe(j + kReadRowAhead)) {
      return nullptr;
    }
    return rows[j % kRing];
  };
  for (size_t j = lo; j < std::min(hi, lo + kReadSlotAhead); ++j) prefetch_slot(j);
  const auto stop = [&] { task.raced = true; };  // (or abort is set: an id to insert)
  for (size_t j = lo; j < std::min(hi, lo + kReadRowAhead); ++j) {
    if (!probe(j)) return stop();
  }
  if (!write_bags<kDim>(r, bag_lo, bag_hi, dim, abort, row_of) || !versions.valid()) {
    return stop();
  }
  if (r.insert) versions.copy_to(task.versions);
}

// The careful redo of a task the fast kernel raced (a task spans every shard of its table,
// so under concurrent applies many do; without this the whole request would go to the
// locked path). Each id's row is copied to a scratch buffer and that
// copy alone validated, re-read on a race; when a writer is inside the shard, or keeps
// getting in the way, the row is read under the shard lock (which waits for the writer's
// critical section). Ids are prefetched kSlotAhead ahead; sums as in pool_bag. An id to
// insert sets `abort`. Not dimension-specialised: it runs only under write contention.
void BatchRunner::read_bags_careful(Table& t, const LookupSumRequest& r, size_t bag_lo,
                                    size_t bag_hi, std::atomic<bool>& abort, ReadTask& task,
                                    uint64_t* places) {
  constexpr int kAttempts = 4;  // lock-free tries per id, then the lock
  const size_t dim = t.dim();
  const auto [lo, hi] = start_task(r, bag_lo, bag_hi, task);
  const float* zeros = zero_row(dim);
  thread_local std::vector<float> scratch;
  if (scratch.size() < dim) scratch.resize(dim);
  uint64_t hashes[kRing];  // id j's hash at j % kRing, from its slot prefetch
  const auto prefetch_slot = [&](size_t j) {
    const uint64_t hash = mix64(r.keys[j]);
    hashes[j % kRing] = hash;
    t.shards_[t.shard_of(hash)]->prefetch(hash);
  };
  for (size_t j = lo; j < std::min(hi, lo + kSlotAhead); ++j) prefetch_slot(j);
  // id j's row (scratch or zeros), or nullptr for an id to insert. Called once per id, in
  // id order (write_bags), so each id is hashed once, at its prefetch.
  const auto validated_row = [&](size_t j) -> const float* {
    if (j + kSlotAhead < hi) prefetch_slot(j + kSlotAhead);
    const uint64_t id = r.keys[j], hash = hashes[j % kRing];
    const size_t s = t.shard_of(hash);
    Shard& sh = *t.shards_[s];
    const auto found = [&](uint32_t row) -> const float* {
      if (row == kNoRow) {
        if (r.insert) return nullptr;
        places[j] = RowResolution::kUnresolved;
        ++task.misses;
        return zeros;
      }
      places[j] = RowResolution::place(s, row);
      return scratch.data();
    };
    for (int attempt = 0; attempt < kAttempts; ++attempt) {
      const uint64_t v = sh.read_begin();
      if ((v & 1) != 0) break;  // a writer is inside: wait for it on the lock
      const uint32_t row = r.insert ? sh.find_optimistic(id, hash)
                                    : sh.find_optimistic<true>(id, hash);  // see probe
      if (row == kRetry) continue;
      if (row != kNoRow) copy_row<0>(scratch.data(), t.row_ptr(sh, row), dim);
      if (sh.read_valid(v)) return found(row);
    }
    const auto lock = sh.lock();
    const uint32_t row = r.insert ? sh.find(id, hash) : sh.find_and_mark(id, hash);
    if (row != kNoRow) copy_row<0>(scratch.data(), t.row_ptr(sh, row), dim);
    return found(row);
  };
  if (!write_bags<0>(r, bag_lo, bag_hi, dim, abort, validated_row)) {
    abort.store(true, std::memory_order_relaxed);
  }
}

// Ends the optimistic pass of request r, read by tasks[0, count), if it completed: counts
// its hits and misses and (a training lookup) keeps its rows for the apply (every id was a
// hit: each has its place). A lookup that cannot insert read-marked its rows' slots as it
// read them (see kReadMark). One that may insert set no bit: it stops at its first missing
// id, and bits its parallel tasks had set by then would depend on the thread count, and
// with them which rows the locked path's inserts evict. Its kept resolution owes them instead
// (RowResolution::refs_pending): the apply that takes it sets them as it updates the rows,
// which spares the forward a bitmap load per id.
void BatchRunner::finish_reads(Table& t, const LookupSumRequest& r, const ReadTask* tasks,
                               size_t count, bool aborted, RowResolution& resolution) {
  if (aborted) return;
  uint64_t ids = 0, misses = 0;
  for (size_t k = 0; k < count; ++k) {
    ids += tasks[k].count;
    misses += tasks[k].misses;
  }
  t.read_hits_.fetch_add(ids - misses, std::memory_order_relaxed);
  t.read_misses_.fetch_add(misses, std::memory_order_relaxed);
  if (!r.insert) return;
  // A shard's version is known if every task that read it was validated at the same one.
  constexpr uint64_t kUnset = ~uint64_t{0};  // odd: unknown unless a task sets it
  resolution.versions.assign(t.num_shards(), kUnset);
  for (size_t k = 0; k < count; ++k) {
    if (tasks[k].versions.empty() && tasks[k].count != 0) {  // the careful kernel ran
      resolution.versions.assign(t.num_shards(), RowResolution::kUnknownVersion);
      break;
    }
    for (const auto& [s, v] : tasks[k].versions) {
      uint64_t& known = resolution.versions[s];
      known = known == kUnset || known == v ? v : RowResolution::kUnknownVersion;
    }
  }
  resolution.refs_pending = true;
  resolution.planned = false;
  t.keep_resolution(r.keys, r.n, resolution);
}

}  // namespace embstore
