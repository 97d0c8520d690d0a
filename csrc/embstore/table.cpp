#include "embstore/table.hpp"

#include <algorithm>  // std::min, std::max, std::upper_bound
#include <array>      // std::array
#include <chrono>     // std::chrono::steady_clock
#include <cmath>      // std::isfinite, std::sqrt, std::ceil
#include <cstring>    // std::memcpy, std::memset
#include <exception>  // std::exception_ptr, std::rethrow_exception
#include <numeric>    // std::iota
#include <optional>   // std::optional

#include <pthread.h>  // pthread_atfork
#include <stdexcept>  // std::invalid_argument
#include <string>     // std::to_string
#include <type_traits>  // std::integral_constant
#include <utility>    // std::pair

#include "embstore/errors.hpp"       // CapacityError
#include "embstore/hash.hpp"         // mix64
#include "embstore/initializer.hpp"  // initial_row
#include "embstore/optimizer.hpp"    // state_width, init_state, apply_update
#include "embstore/simd.hpp"         // simd_level, EMBSTORE_KERNEL_TARGET_AVX2
#include "embstore/thread_pool.hpp"  // ThreadPool

namespace embstore {
namespace {

constexpr size_t kMaxShards = 4096;       // shard ids are kept in uint16 scratch
constexpr size_t kIdsPerWorker = 2048;    // below this a helper thread costs more than it saves
constexpr size_t kIdsPerReadTask = 4096;  // optimistic lookup task size (whole bags)
constexpr size_t kBagsPerPoolTask = 256;  // locked path's pooling task: ~32-256 KiB of output
// Pipeline distances (ids ahead) of the lock-free read kernel: index slots 32 ahead, rows 16
// ahead — enough misses in flight to cover DRAM latency without evicting prefetched lines
// before use. The best pair depends on the machine's memory latency. On the 2-core Intel Xeon
// VM (where bench/README's figures are taken), against 16/8, 2 threads, separate builds in
// six alternated rounds: W1 D=32 forward 0.82-0.89x at L=8 and 0.87-0.90x at L=1, W4
// 0.89-1.00x (24/12: forward 0.85-0.93x; 32/20 and 40/20 as 32/16; 48/24 and 64/32:
// 0.84-0.89x; 12/6 and 16/12: 1.10-1.23x). On the AMD EPYC VM of the earlier runs, 32/16 had
// measured 10-20% slower than 16/8 on the forward. On the AMD EPYC (Zen 4) VM of 2026-11-26,
// W4 at 1 thread, separate builds alternated: 32/16 0.74-0.81 ms, 16/8 0.78-0.96 ms; 48/24
// and 64/32 no better than 32/16. There the kernel waits on its own prefetches (cpu-clock:
// 57% of its samples on the row's second-line prefetch): it keeps about 4 lines per id in
// flight (2 of index, 2 of row), and prefetching one index line, or (D=32) the rows into L2,
// measured slower or the same.
constexpr uint32_t kReadSlotAhead = 32;
constexpr uint32_t kReadRowAhead = 16;
// The locked kernels (lookups that insert, the apply) keep 16/8: 32/16 there gained nothing
// measurable on the W1 step and W2 ran 1.51-1.58x W1 in three runs (5-7% slower than with
// 16/8), where the apply resolves and updates ids in order under each shard's lock.
constexpr uint32_t kSlotAhead = 16;
constexpr uint32_t kRowAhead = 8;
constexpr size_t kIdsPerNoteAll = 8;  // see notes_all_up_front
// Ring of ids prefetched or probed and awaiting their read; longer than every slot distance.
constexpr uint32_t kRing = 64;
static_assert(kSlotAhead < kRing && kRowAhead < kSlotAhead);
static_assert(kReadSlotAhead < kRing && kReadRowAhead < kReadSlotAhead);
// Rows whose places are already known (pool_places: no slot to wait for) are prefetched
// further ahead. On the AMD VM, 16 ahead: W2 forward 0.97x against kRowAhead (12: 0.98x, 20:
// 0.97x, 4: 1.05x). On the Xeon VM, 24 ahead: W2 step 0.973-0.975x against 16 in four
// alternated rounds of separate builds (32: 0.95x and 1.01x; the locked kernels at 24/12
// with it: 1.01x and 1.07x).
constexpr uint32_t kPlacedRowAhead = 24;
static_assert(kPlacedRowAhead < kRing);
// A shard's ids are scattered over its request (every 64th id on average), so the key, place
// and bag of each is a cache line of its own: the locked kernels prefetch them this far
// ahead, before the id is hashed (or its place read) kSlotAhead ids ahead. (W1 backward
// 0.88x at L=8 with the occupied-bit prefetch, W2 step 0.97x: in-process A/B; 16 and 32
// measured the same on the backward.)
constexpr uint32_t kInputAhead = 2 * kSlotAhead;
// An apply's update pass over at least kLongUpdate rows of a shard, or over rows wider than
// kWideRowBytes (weights + state), prefetches its rows into L2, a shorter one into L1 (see
// apply_shard).
constexpr uint32_t kLongUpdate = 64;
constexpr size_t kWideRowBytes = 256;

bool is_power_of_two(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

size_t default_shards(size_t capacity) {
  // One shard per ~2048 rows, at most 64: enough shards that concurrent callers rarely
  // meet on a lock, few enough that small tables keep a single exact CLOCK ring.
  size_t s = 1;
  while (s < 64 && s * 2 * 2048 <= capacity) s *= 2;
  return s;
}

// Capacity is split into per-shard quotas (share - share/16) and a pool of the rest. A shard
// below its quota can always take a row; beyond it, it borrows from the pool, and once the
// pool is empty it evicts one of its own rows. No shard ever needs another shard's rows, so
// there is no cross-shard locking, and a 1M-id table with capacity 1M still never evicts:
// hashed ids spread within ~1% of the mean, far inside the 6.25% pool.
uint32_t shard_quota(size_t share, size_t num_shards) {
  if (num_shards == 1) return static_cast<uint32_t>(share);
  return static_cast<uint32_t>(std::max<size_t>(1, share - share / 16));
}

// Rows a shard may own: its share of the capacity plus slack for hash imbalance. A shard's
// load is binomial (sigma = sqrt(share)); the fullest of 64 shards of W1's 1M ids was +3.5
// sigma, so 4 sigma + 32 rarely binds, and when it does the shard just evicts early (quotas
// keep len <= capacity either way). The slack is kept small because its pages become
// resident once neighbouring shards touch their huge pages (6 sigma cost ~13 B/row of RSS).
size_t shard_rows(size_t share, size_t num_shards, size_t capacity) {
  size_t rows = share;
  if (num_shards > 1) rows += static_cast<size_t>(4.0 * std::sqrt(static_cast<double>(share))) + 32;
  return std::min(rows, capacity);
}

std::string prefix(const std::string& label) {
  return label.empty() ? std::string() : "table '" + label + "': ";
}

// Scratch reused across calls by each calling thread (no allocation per batch once warm).
struct Workspace {
  std::vector<uint32_t> order;        // (n) positions grouped by shard, stable
  std::vector<uint32_t> shard_begin;  // (S + 1)
  std::vector<uint32_t> cursor;       // (S)
  std::vector<uint16_t> shard_ids;    // (n)
  std::vector<uint32_t> bag_of;       // (n) apply with offsets
  std::vector<float> rows;            // (n, dim) gathered rows (lookups)
  bool one_hot = false;               // every bag holds exactly one id
  RowResolution resolution;           // a lookup's, to keep; or the one an apply took
  std::vector<uint64_t> pass;         // (S) a record-only locked pass's versions (gather_shard)
};

std::vector<Workspace>& thread_workspaces(size_t count) {
  thread_local std::vector<Workspace> spaces;
  if (spaces.size() < count) spaces.resize(count);
  return spaces;
}

Workspace& workspace(size_t k) { return thread_workspaces(k + 1)[k]; }

// An apply task's per-row gradient sums and the rows they belong to, for one shard's ids of
// one request at a time, in scratch the worker thread reuses from task to task: it stays in
// cache. (A region per request, n rows long, was cold at every call: each row's first
// gradient write missed. W1 D=32 backward 0.95-0.97x at L=8, 0.89-0.94x at L=1, W2 step
// 0.97x: in-process A/B, 2 threads.)
struct ApplyScratch {
  float* acc;        // (ids, dim)
  uint32_t* unique;  // (ids)
};
ApplyScratch apply_scratch(size_t ids, size_t dim) {
  thread_local std::vector<float> acc;
  thread_local std::vector<uint32_t> unique;
  if (acc.size() < ids * dim) acc.resize(ids * dim);
  if (unique.size() < ids) unique.resize(ids);
  return {acc.data(), unique.data()};
}

// The calling thread's workspaces for R requests, resolved before tasks run on helpers
// (whose own thread_local scratch is not the caller's).
std::vector<Workspace*> caller_workspaces(size_t count) {
  std::vector<Workspace>& spaces = thread_workspaces(count);
  std::vector<Workspace*> out(count);
  for (size_t k = 0; k < count; ++k) out[k] = &spaces[k];
  return out;
}

// Whether offsets[0..num_bags] never decrease, and the longest bag. Branch-free so that the
// loop vectorises (with the throw inside it did not, and one-id bags made it a visible part
// of a small-batch step). Unsigned differences: a decreasing pair may wrap, but then
// `ordered` is false and `longest` is not used.
struct OffsetScan {
  bool ordered;
  uint64_t longest;
};
inline OffsetScan scan_offsets_kernel(const int64_t* offsets, size_t num_bags) noexcept {
  uint64_t decreasing = 0, longest = 0;
  for (size_t b = 0; b < num_bags; ++b) {
    decreasing |= static_cast<uint64_t>(offsets[b + 1] < offsets[b]);
    longest = std::max(longest, static_cast<uint64_t>(offsets[b + 1]) -
                                    static_cast<uint64_t>(offsets[b]));
  }
  return {decreasing == 0, longest};
}
#if EMBSTORE_HAS_AVX2_KERNELS
EMBSTORE_KERNEL_TARGET_AVX2 OffsetScan scan_offsets_avx2(const int64_t* offsets,
                                                         size_t num_bags) noexcept {
  return scan_offsets_kernel(offsets, num_bags);
}
#endif
OffsetScan scan_offsets(const int64_t* offsets, size_t num_bags) noexcept {
#if EMBSTORE_HAS_AVX2_KERNELS
  if (simd_level() == SimdLevel::kAvx2) return scan_offsets_avx2(offsets, num_bags);
#endif
  return scan_offsets_kernel(offsets, num_bags);
}

// Checks CSR offsets; returns the longest bag. Throws std::invalid_argument.
size_t validate_offsets(const int64_t* offsets, size_t num_bags, size_t n,
                        const std::string& label) {
  if (offsets[0] != 0) {
    throw std::invalid_argument(prefix(label) + "offsets[0] must be 0, got " +
                                std::to_string(offsets[0]));
  }
  const OffsetScan scan = scan_offsets(offsets, num_bags);
  for (size_t b = 0; !scan.ordered && b < num_bags; ++b) {  // name the first decrease
    if (offsets[b + 1] < offsets[b]) {
      throw std::invalid_argument(prefix(label) + "offsets must be non-decreasing: offsets[" +
                                  std::to_string(b) + "]=" + std::to_string(offsets[b]) +
                                  " > offsets[" + std::to_string(b + 1) +
                                  "]=" + std::to_string(offsets[b + 1]));
    }
  }
  if (offsets[num_bags] != static_cast<int64_t>(n)) {
    throw std::invalid_argument(prefix(label) + "offsets[-1] must equal len(keys)=" +
                                std::to_string(n) + ", got " + std::to_string(offsets[num_bags]));
  }
  return static_cast<size_t>(scan.longest);
}

// Whether every float is finite: an exponent of all ones is Inf or NaN. Integer bit tests,
// reduced without an early exit, so the loop vectorises (the per-element isfinite loop with a
// throw in it did not, and cost ~10% of a one-hot W1 step). The exponent bits are
// max-reduced (two vector operations per 8 floats with AVX2; callgrind, W1 D=32 L=8: the
// gradients' check fell from 2.0 to 0.6 instructions per float).
inline bool all_finite_kernel(const float* x, size_t count) noexcept {
  constexpr uint32_t kExponent = 0x7F800000u;
  uint32_t top = 0;  // the largest exponent field seen; kExponent only for Inf or NaN
  for (size_t k = 0; k < count; ++k) {
    uint32_t bits;
    std::memcpy(&bits, x + k, sizeof(bits));
    top = std::max(top, bits & kExponent);
  }
  return top != kExponent;
}
#if EMBSTORE_HAS_AVX2_KERNELS
EMBSTORE_KERNEL_TARGET_AVX2 bool all_finite_avx2(const float* x, size_t count) noexcept {
  return all_finite_kernel(x, count);
}
#endif
bool all_finite(const float* x, size_t count) noexcept {
#if EMBSTORE_HAS_AVX2_KERNELS
  if (simd_level() == SimdLevel::kAvx2) return all_finite_avx2(x, count);
#endif
  return all_finite_kernel(x, count);
}

void validate_finite(const float* x, size_t count, const char* name, const std::string& label) {
  if (all_finite(x, count)) return;
  for (size_t k = 0; k < count; ++k) {
    if (!std::isfinite(x[k])) {
      throw std::invalid_argument(prefix(label) + name + " must be finite: element " +
                                  std::to_string(k) + " is " + std::to_string(x[k]));
    }
  }
}

// Locality hint of a prefetch into L2 only (prefetcht2), for a loop that would otherwise
// stall on its own prefetches (apply_shard's update pass); 3 (the default) is into L1.
constexpr int kToL2 = 1;

// Prefetches every cache line of [p, p + bytes), for reading or (kForWrite) for writing.
template <int kForWrite = 0, int kLocality = 3>
inline void prefetch_lines(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t off = 0; off < bytes; off += kCacheLine) {
    __builtin_prefetch(c + off, kForWrite, kLocality);
  }
}

size_t choose_workers(size_t total_ids, size_t max_threads) {
  return std::max<size_t>(1, std::min(max_threads, total_ids / kIdsPerWorker));
}

// The workers a batch of several requests gets: by its ids, up to its tables' most threads.
// With more than one, the pool's helpers are woken now, so that they are polling for the job
// by the time validation ends (ThreadPool::prewake; W1 D=32 L=1 forward 0.9x with calls
// ~1 ms apart, in-process A/B).
template <typename Request>
size_t workers_for(const std::vector<Request>& requests) {
  size_t total_ids = 0, max_threads = 1;
  for (const Request& r : requests) {
    total_ids += r.n;
    max_threads = std::max(max_threads, r.table->num_threads());
  }
  const size_t workers = choose_workers(total_ids, max_threads);
  if (workers > 1) ThreadPool::global().prewake();
  return workers;
}

// Runs validate(k) for every request k on the pool (a W1 apply reads 2 MB of gradients to
// check them), then rethrows the error of the first request, in request order, that failed:
// the error a call raises does not depend on thread timing.
template <typename Validate>
void validate_each(size_t num_requests, size_t workers, const Validate& validate) {
  std::vector<std::exception_ptr> errors(num_requests);
  ThreadPool::global().run(num_requests, workers, [&](size_t k) {
    try {
      validate(k);
    } catch (...) {
      errors[k] = std::current_exception();
    }
  });
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// Rotates each call's first shard so concurrent callers start on different locks.
size_t rotation() {
  static std::atomic<size_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed);
}

// Maps a flat task number over several requests to (request, task within it).
struct TaskSpace {
  std::vector<size_t> begin{0};
  void add(size_t tasks) { begin.push_back(begin.back() + tasks); }
  size_t total() const { return begin.back(); }
  size_t request_of(size_t task) const {
    return static_cast<size_t>(std::upper_bound(begin.begin(), begin.end(), task) -
                               begin.begin()) - 1;
  }
};

// Times the consecutive stages of one batch call (one clock read per stage, none when
// metrics are off) and records them, and the whole call, into every table of the call.
class StageClock {
 public:
  StageClock() : on_(metrics_enabled()) {
    if (!on_) return;
    start_ = last_ = std::chrono::steady_clock::now();
    ThreadPool::set_wait_sink(&ns_[static_cast<size_t>(Timer::kStageWait)]);
  }
  ~StageClock() {
    if (on_) ThreadPool::set_wait_sink(nullptr);
  }
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;
  void lap(Timer stage) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    ns_[static_cast<size_t>(stage)] += to_ns(now - last_);
    last_ = now;
  }
  template <typename Requests>
  void record(const Requests& requests, Timer op) const {
    if (!on_) return;
    const uint64_t total = to_ns(std::chrono::steady_clock::now() - start_);
    for (const auto& r : requests) {
      r.table->timer(op).record(total);
      for (size_t k = 0; k < ns_.size(); ++k) {
        if (ns_[k] != 0) r.table->timer(static_cast<Timer>(k)).record(ns_[k]);
      }
    }
  }

 private:
  template <typename D>
  static uint64_t to_ns(D d) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  }
  bool on_;
  std::chrono::steady_clock::time_point start_, last_;
  std::array<uint64_t, static_cast<size_t>(Timer::kCount)> ns_{};
};

}  // namespace

// Internal batch kernels; a friend of Table.
struct BatchRunner {
  // Groups keys by shard (stable counting sort).
  // `places`: the ids' shard << 32 | row from a reused resolution (no hashing), or nullptr.
  static void plan(const Table& t, const uint64_t* keys, size_t n, Workspace& ws,
                   const uint64_t* places = nullptr) {
    const size_t S = t.num_shards();
    ws.order.resize(n);
    ws.shard_begin.assign(S + 1, 0);
    if (S == 1) {
      std::iota(ws.order.begin(), ws.order.end(), 0u);
      ws.shard_begin[1] = static_cast<uint32_t>(n);
      return;
    }
    ws.shard_ids.resize(n);
    ws.cursor.assign(S, 0);
    for (size_t i = 0; i < n; ++i) {
      const size_t s = places != nullptr && places[i] != RowResolution::kUnresolved
                           ? places[i] >> 32
                           : t.shard_of(mix64(keys[i]));
      ws.shard_ids[i] = static_cast<uint16_t>(s);
      ++ws.cursor[s];
    }
    for (size_t s = 0; s < S; ++s) {
      ws.shard_begin[s + 1] = ws.shard_begin[s] + ws.cursor[s];
      ws.cursor[s] = ws.shard_begin[s];
    }
    for (size_t i = 0; i < n; ++i) ws.order[ws.cursor[ws.shard_ids[i]]++] = static_cast<uint32_t>(i);
  }

  // Prefetches what the locked kernels read of the id kInputAhead ids after position j of a
  // shard's ids [.., e) in ws.order: its key and, when given, its place and bag.
  static void prefetch_inputs(const Workspace& ws, uint32_t j, uint32_t e, const uint64_t* keys,
                              const uint64_t* places, const uint32_t* bags) {
    if (j + kInputAhead >= e) return;
    const uint32_t i = ws.order[j + kInputAhead];
    __builtin_prefetch(keys + i);
    if (places != nullptr) __builtin_prefetch(places + i);
    if (bags != nullptr) __builtin_prefetch(bags + i);
  }

  static void add_counters(Shard& sh, uint64_t hits, uint64_t misses, uint64_t inserts,
                           uint64_t evictions, uint64_t rejected) {
    ShardCounters::add(sh.counters.hits, hits);
    ShardCounters::add(sh.counters.misses, misses);
    ShardCounters::add(sh.counters.inserts, inserts);
    ShardCounters::add(sh.counters.evictions, evictions);
    ShardCounters::add(sh.counters.rejected, rejected);
  }

  // out = 0 + w * src (first id of a bag) or out = out + w * src, in the spec's float order
  // (docs/semantics.md: s = 0; s = s + w_i * row_i; the leading 0 + is not a no-op for -0).
  // Unweighted sums skip the multiply (w * x == x exactly for w == 1). Reads rows without the
  // lock: the caller validates the shard version afterwards.
  template <size_t kDim>
  EMBSTORE_NO_SANITIZE_THREAD static void accumulate_row(float* __restrict out,
                                                         const float* __restrict src,
                                                         const float* weight, bool first,
                                                         size_t dim_runtime) noexcept {
    const size_t dim = kDim != 0 ? kDim : dim_runtime;
    if (weight == nullptr) {
      if (first) {
        for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + src[k];
      } else {
        for (size_t k = 0; k < dim; ++k) out[k] = out[k] + src[k];
      }
    } else {
      const float w = *weight;
      if (first) {
        for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + w * src[k];
      } else {
        for (size_t k = 0; k < dim; ++k) out[k] = out[k] + w * src[k];
      }
    }
  }

  template <size_t kDim>
  EMBSTORE_NO_SANITIZE_THREAD static void copy_row(float* __restrict out,
                                                   const float* __restrict src,
                                                   size_t dim_runtime) noexcept {
    const size_t dim = kDim != 0 ? kDim : dim_runtime;
    for (size_t k = 0; k < dim; ++k) out[k] = src[k];
  }

  // What one optimistic read task saw: ids [first_id, first_id + count) of its request, whose
  // places (shard << 32 | row, kUnresolved for a miss) it wrote to the request's places
  // array. Its hit counts are committed only when the whole request completed without the
  // lock (see finish_reads).
  struct ReadTask {
    size_t first_id = 0;
    size_t count = 0;
    uint64_t misses = 0;
    bool raced = false;  // a writer got in the way: the caller redoes the task carefully
    // (shard, version) of every shard the fast kernel's reads were validated at; empty when
    // the task ran the careful kernel (RowResolution::versions).
    std::vector<std::pair<uint32_t, uint64_t>> versions;
  };

  // Seqlock validation for one read task, deferred to its end: each shard's version is noted
  // at the task's first probe of that shard (or every shard's at the task's start: note_all);
  // a later probe that sees another version, or an odd one, fails at once, and `valid()`
  // checks that no version moved since. Every read of a shard lies between a note that saw
  // version v and the final check that still sees v, so no writer overlapped any of them.
  // (At most one check per id, at the probe; none per copy.)
  class ShardVersions {
   public:
    explicit ShardVersions(const Table& t) : t_(t) {
      thread_local std::vector<uint64_t> seen;  // kUnseen between tasks
      thread_local std::vector<uint32_t> touched;
      if (seen.size() < t.num_shards()) seen.resize(t.num_shards(), kUnseen);
      seen_ = seen.data();
      touched_ = &touched;
      touched_->clear();
    }
    ~ShardVersions() {
      for (const uint32_t s : *touched_) seen_[s] = kUnseen;
    }
    ShardVersions(const ShardVersions&) = delete;
    ShardVersions& operator=(const ShardVersions&) = delete;
    // Notes shard s's version before a probe; false if the read must be redone under the lock.
    bool note(size_t s) noexcept {
      const uint64_t v = t_.shards_[s]->read_begin();
      if ((v & 1) != 0) return false;  // a writer is inside
      if (seen_[s] == v) return true;
      if (seen_[s] != kUnseen) return false;  // a writer came and went since the first probe
      seen_[s] = v;
      touched_->push_back(static_cast<uint32_t>(s));
      return true;
    }
    // Notes every shard's version at once (false if a writer is inside one): then no probe
    // needs note().
    bool note_all() noexcept {
      for (size_t s = 0; s < t_.num_shards(); ++s) {
        if (!note(s)) return false;
      }
      return true;
    }
    // note(s), and the version noted is `expected` (rows recorded at that version are read).
    bool note_at(size_t s, uint64_t expected) noexcept { return note(s) && seen_[s] == expected; }
    // note_at(s, pass[s]) for every shard a locked pass left in place (pass[s] a version, not
    // kCopiedShard; see gather_shard): then no read needs note_at().
    bool note_all_at(const uint64_t* pass) noexcept {
      for (size_t s = 0; s < t_.num_shards(); ++s) {
        if (pass[s] != kCopiedShard && !note_at(s, pass[s])) return false;
      }
      return true;
    }
    bool valid() const noexcept {
      for (const uint32_t s : *touched_) {
        if (!t_.shards_[s]->read_valid(seen_[s])) return false;
      }
      return true;
    }
    // Appends (shard, version) for every shard noted.
    void copy_to(std::vector<std::pair<uint32_t, uint64_t>>& out) const {
      for (const uint32_t s : *touched_) out.emplace_back(s, seen_[s]);
    }

   private:
    static constexpr uint64_t kUnseen = 1;  // odd: never a version a probe accepts
    const Table& t_;
    uint64_t* seen_;
    std::vector<uint32_t>* touched_;  // the shards noted, in first-probe order
  };

  // The first id of bag b of r (without offsets every id is its own bag).
  static size_t bag_begin(const LookupSumRequest& r, size_t b) noexcept {
    return r.offsets == nullptr ? b : static_cast<size_t>(r.offsets[b]);
  }

  // Whether a task over bags [bag_lo, bag_hi) of r notes every shard's version up front
  // (ShardVersions::note_all, note_all_at): with 8 or more ids per shard, that spares each
  // id a version load and check (W1 D=32 L=8 forward 0.93-0.94x; W2's pooling 0.98x).
  static bool notes_all_up_front(const Table& t, const LookupSumRequest& r, size_t bag_lo,
                                 size_t bag_hi) noexcept {
    return t.num_shards() * kIdsPerNoteAll <= bag_begin(r, bag_hi) - bag_begin(r, bag_lo);
  }

  // Resets `task` to bags [bag_lo, bag_hi) of r and returns their ids [lo, hi).
  static std::pair<size_t, size_t> start_task(const LookupSumRequest& r, size_t bag_lo,
                                              size_t bag_hi, ReadTask& task) noexcept {
    const size_t lo = bag_begin(r, bag_lo), hi = bag_begin(r, bag_hi);
    task.first_id = lo;
    task.count = hi - lo;
    task.misses = 0;
    task.raced = false;
    task.versions.clear();
    return {lo, hi};
  }

  // A row of `dim` zeros (what a missing id reads), one buffer per thread.
  static const float* zero_row(size_t dim) {
    thread_local std::vector<float> zeros;
    if (zeros.size() < dim) zeros.assign(dim, 0.0f);
    return zeros.data();
  }

  // Runs kernel(std::integral_constant<size_t, W>{}): W is the table's width when the row
  // kernels have a fully unrolled version for it (16, 32, 64, 128), else 0 (any width).
  // Inside the AVX2 wrapper when the CPU has it (the wrapper's `flatten` inlines the whole
  // kernel into it, so all of it is compiled for AVX2).
  template <class Kernel>
  static auto by_width(size_t dim, const Kernel& kernel) {
#if EMBSTORE_HAS_AVX2_KERNELS
    if (simd_level() == SimdLevel::kAvx2) return by_width_avx2(dim, kernel);
#endif
    return by_width_portable(dim, kernel);
  }
#if EMBSTORE_HAS_AVX2_KERNELS
  template <class Kernel>
  EMBSTORE_KERNEL_TARGET_AVX2 static auto by_width_avx2(size_t dim, const Kernel& kernel) {
    return by_width_portable(dim, kernel);
  }
#endif
  template <class Kernel>
  static inline auto by_width_portable(size_t dim, const Kernel& kernel) {
    switch (dim) {
      case 16: return kernel(std::integral_constant<size_t, 16>{});
      case 32: return kernel(std::integral_constant<size_t, 32>{});
      case 64: return kernel(std::integral_constant<size_t, 64>{});
      case 128: return kernel(std::integral_constant<size_t, 128>{});
      default: return kernel(std::integral_constant<size_t, 0>{});
    }
  }

  // The task's bags: the fast kernel, or (careful) the row-by-row retry of a raced task.
  static void read_bags(Table& t, const LookupSumRequest& r, size_t bag_lo, size_t bag_hi,
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
  // count. (Profile, W1 D=32 L=8: this kernel is instruction-bound with rows in cache. It ran
  // ~200 instructions per id - a push_back, two hashes and a seqlock check per id - then 138
  // (callgrind); now 118: each id's shard and home slot are computed once, at its prefetch,
  // one bounds check per id, one compare per probe step, one branch for kNoRow/kRetry,
  // version notes chosen at compile time. Forward 0.83-0.84x the previous kernel's time,
  // in-process A/B.)
  template <size_t kDim, bool kAllNoted>
  static void read_bags_impl(Table& t, const LookupSumRequest& r, size_t bag_lo, size_t bag_hi,
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

  // The careful redo of a task the fast kernel raced (W3: with applies running, 70% of
  // lookups at K=2 did, since a task spans every shard of its table, and then the whole
  // request went to the locked path). Each id's row is copied to a scratch buffer and that
  // copy alone validated, re-read on a race; when a writer is inside the shard, or keeps
  // getting in the way, the row is read under the shard lock (which waits for the writer's
  // critical section). Ids are prefetched kSlotAhead ahead; sums as in pool_bag. An id to
  // insert sets `abort`. Not dimension-specialised: it runs only under write contention.
  static void read_bags_careful(Table& t, const LookupSumRequest& r, size_t bag_lo,
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

  // Writes bags [bag_lo, bag_hi) of r.out from row_of(j) (id j's row, or nullptr to stop):
  // with offsets, each bag's pooled sum (zeros for an empty bag); without, each id's row
  // copied exactly. False if row_of stopped; true otherwise, also when it returned early
  // because another task of the request set `abort` (checked every 64 bags).
  template <size_t kDim, typename RowOf>
  static bool write_bags(const LookupSumRequest& r, size_t bag_lo, size_t bag_hi, size_t dim,
                         const std::atomic<bool>& abort, const RowOf& row_of) {
    for (size_t bag = bag_lo; bag < bag_hi; ++bag) {
      if ((bag & 63) == 0 && abort.load(std::memory_order_relaxed)) return true;
      float* out = r.out + bag * dim;
      if (r.offsets == nullptr) {  // lookup: the row, copied exactly
        const float* src = row_of(bag);
        if (src == nullptr) return false;
        copy_row<kDim>(out, src, dim);
        continue;
      }
      const size_t begin = static_cast<size_t>(r.offsets[bag]);
      const size_t end = static_cast<size_t>(r.offsets[bag + 1]);
      if (begin == end) {  // an empty bag reads zeros
        std::memset(out, 0, dim * sizeof(float));
      } else if (!pool_bag<kDim>(out, begin, end, r.weights, r.mode, dim, row_of)) {
        return false;
      }
    }
    return true;
  }

  // Sums (or averages) the rows of ids [begin, end) into out, in id order (docs/semantics.md:
  // s = 0; s = s + w_i * row_i; the leading 0 + is not a no-op for -0). Fixed widths of up to
  // 32 floats sum in a local array the compiler keeps in registers. The bag is not empty
  // (begin < end). False if row_of aborted.
  template <size_t kDim, typename RowOf>
  EMBSTORE_NO_SANITIZE_THREAD static bool pool_bag(float* __restrict out, size_t begin,
                                                   size_t end, const float* weights,
                                                   PoolMode mode, size_t dim,
                                                   const RowOf& row_of) noexcept {
    constexpr bool kLocal = kDim != 0 && kDim <= 32;
    float local[kLocal ? kDim : 1];
    float* __restrict acc = kLocal ? local : out;
    // The first row and the weights test are hoisted out of the per-id loop. (Two loops on
    // purpose: folding them into one generic lambda cost ~2 instructions per id, callgrind.)
    const float* __restrict first = row_of(begin);
    if (first == nullptr) return false;
    if (weights == nullptr) {
      accumulate_row<kDim>(acc, first, nullptr, true, dim);
      for (size_t j = begin + 1; j < end; ++j) {
        const float* __restrict src = row_of(j);
        if (src == nullptr) return false;
        accumulate_row<kDim>(acc, src, nullptr, false, dim);
      }
    } else {
      accumulate_row<kDim>(acc, first, weights + begin, true, dim);
      for (size_t j = begin + 1; j < end; ++j) {
        const float* __restrict src = row_of(j);
        if (src == nullptr) return false;
        accumulate_row<kDim>(acc, src, weights + j, false, dim);
      }
    }
    if (mode == PoolMode::kMean) {
      const float count = static_cast<float>(end - begin);
      for (size_t k = 0; k < dim; ++k) acc[k] = acc[k] / count;
    }
    if (kLocal) std::memcpy(out, acc, dim * sizeof(float));
    return true;
  }

  // Ends the optimistic pass of request r, read by tasks[0, count), if it completed: counts
  // its hits and misses and (a training lookup) keeps its rows for the apply (every id was a
  // hit: each has its place). A lookup that cannot insert read-marked its rows' slots as it
  // read them (see kReadMark). One that may insert set no bit: it stops at its first missing
  // id, and bits its parallel tasks had set by then would depend on the thread count, and
  // with them which rows the locked path's inserts evict. Its kept resolution owes them instead
  // (RowResolution::refs_pending): the apply that takes it sets them as it updates the rows,
  // which spares the forward a bitmap load per id (W1 D=32 forward 0.91-0.96x).
  static void finish_reads(Table& t, const LookupSumRequest& r, const ReadTask* tasks,
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
  // caller pools straight from the recorded rows (pool_places), which spares W2 a copy of
  // every row into a 16 MB buffer and a second pass over it (W2 step 0.84x). Inserts then
  // sweep at most as far as keeps every row visited once (sweep_budget); an insert that
  // needs more first copies the rows recorded so far, and the pass goes on copying.
  // pass[s] gets the shard's version after the pass, or kCopiedShard if it copied.
  // `count_reads`: add the hits and misses to the counters (false for a redo).
  static constexpr uint64_t kCopiedShard = 1;  // odd: never a version
  static void gather_shard(Table& t, size_t s, const uint64_t* keys, const Workspace& ws,
                           bool insert, const float* weights, bool pooled, float* dst,
                           uint64_t* places, uint64_t* versions, uint64_t* pass = nullptr,
                           bool count_reads = true) {
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
      float* __restrict out = dst + static_cast<size_t>(i) * dim;
      if (row == kNoRow) {
        std::memset(out, 0, dim * sizeof(float));
        return;
      }
      const float* __restrict src = t.row_ptr(sh, row);
      if (weights != nullptr) {
        const float w = weights[i];
        for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + w * src[k];
      } else if (pooled) {
        for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + src[k];
      } else {
        std::memcpy(out, src, dim * sizeof(float));
      }
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
          if (copying) while (done < j) finish(done, ring[done % kRing]), ++done;
          row = copying ? t.insert_locked(s, id, hash, step, evictions)
                        : t.insert_locked(s, id, hash, step, evictions, sweep_budget());
          if (row == kRetry) {  // from here on a recorded row may be evicted: copy them
            for (; done < j; ++done) {
              const uint64_t place = places[ws.order[done]];
              finish(done, place == RowResolution::kUnresolved ? kNoRow
                                                               : static_cast<uint32_t>(place));
            }
            copying = true;
            row = t.insert_locked(s, id, hash, step, evictions);
          }
          if (row == kNoRow) {
            add_counters(sh, count_reads ? hits : 0, count_reads ? misses : 0, inserts,
                         evictions, rejected);
            throw CapacityError(t.no_row_message(id, s));
          }
          ++inserts;
        }
      }
      ring[j % kRing] = row;
      if (places != nullptr) {
        places[ws.order[j]] = row == kNoRow ? RowResolution::kUnresolved : RowResolution::place(s, row);
      }
      if (copying) {
        if (row != kNoRow) prefetch_lines(t.row_ptr(sh, row), dim * sizeof(float));
        if (j - done >= kRowAhead) finish(done, ring[done % kRing]), ++done;
      }
    }
    if (copying) while (done < e) finish(done, ring[done % kRing]), ++done;
    add_counters(sh, count_reads ? hits : 0, count_reads ? misses : 0, inserts, evictions,
                 rejected);
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
  static bool pool_places(Table& t, const LookupSumRequest& r, const uint64_t* places,
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
  static bool pool_places_impl(Table& t, const LookupSumRequest& r, const uint64_t* places,
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
  static void pool_bags(const LookupSumRequest& r, size_t dim, const float* rows, size_t bag_lo,
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


  // Sums shard s's per-id gradients per distinct row (in order), then applies one optimizer
  // update per row. Rows of this batch are pinned (aux) so inserts cannot evict them.
  // Pipelined like gather_shard: resolve id j (prefetching its metadata), accumulate id j-16.
  // Ids resolve by probing the index, or from the training lookup's resolution when the
  // call took one (ws.resolution) and the recorded row still holds the id.
  // Note: pass 1 overwrites this shard's part of ws.order with the missing ids.
  // Specialised by width like the read kernel: the gradient sums and the optimizer's row
  // update then run fixed-length loops.
  static void apply_shard(Table& t, size_t s, const ApplyRequest& r, float lr, Workspace& ws) {
    by_width(t.dim(), [&](auto width) {
      apply_shard_kernel<decltype(width)::value>(t, s, r, lr, ws);
    });
  }
  template <size_t kDim>
  static inline void apply_shard_kernel(Table& t, size_t s, const ApplyRequest& r, float lr,
                                        Workspace& ws) {
    const uint32_t b = ws.shard_begin[s], e = ws.shard_begin[s + 1];
    if (b == e) return;
    const size_t dim = kDim != 0 ? kDim : t.dim();
    Shard& sh = *t.shards_[s];
    const ApplyScratch scratch = apply_scratch(e - b, dim);
    float* acc_base = scratch.acc;
    uint32_t* unique = scratch.unique;
    uint32_t num_unique = 0;
    uint64_t inserts = 0, evictions = 0, rejected = 0;
    const bool track = t.track_steps_.load(std::memory_order_relaxed);
    const uint32_t step = t.step();
    const CountMinSketch* sketch = t.sketches_.empty() ? nullptr : &t.sketches_[s];
    const uint32_t min_count = t.config_.admission.min_count;
    const size_t row_bytes = t.arena_.stride() * sizeof(float);
    // Where each row's accumulator index lives: in its metadata `aux` (which also pins the
    // row against eviction), or, when the lookup's places are exact (no metadata read
    // needed), in slot_of: a per-thread array over the shard's rows, all kNoRow between
    // calls. Rows are then pinned in the metadata only if an insert comes (pass 2).
    uint32_t* slot_of = nullptr;
    bool pin_in_meta = true;
    // Queue of resolved (position, row) pairs awaiting accumulation: entries
    // [done, resolved) are pending, at most kRowAhead of them.
    uint32_t ring[kRing];
    uint32_t pending[kRing];
    uint32_t resolved = 0, done = 0;
    // `fast` (std::true_type): the lookup's places are exact (slot_of in use, no metadata
    // pins) and the gradients are plain pooled sums (offsets, no weights, mode sum): W1's
    // training step, with those tests hoisted out of the per-id path (callgrind: the apply's
    // instructions per id -14%; backward 0.92-0.98x, in-process A/B).
    auto accumulate = [&](uint32_t i, uint32_t row, auto fast) {
      constexpr bool kFast = decltype(fast)::value;
      // This occurrence's gradient: g = c * grads[bag] (pooled) or grads[i].
      const float* __restrict g;
      float c = 1.0f;
      bool scaled = false;
      if constexpr (kFast) {
        g = r.grads + static_cast<size_t>(ws.bag_of[i]) * dim;
      } else if (r.offsets == nullptr) {
        g = r.grads + static_cast<size_t>(i) * dim;
      } else {
        const uint32_t bag = ws.bag_of[i];
        g = r.grads + static_cast<size_t>(bag) * dim;
        if (r.weights != nullptr) {
          c = r.weights[i];
          scaled = true;
        }
        if (r.mode == PoolMode::kMean) {
          c = c / static_cast<float>(r.offsets[bag + 1] - r.offsets[bag]);
          scaled = true;
        }
      }
      uint32_t& slot = kFast || slot_of != nullptr ? slot_of[row] : sh.meta(row).aux;
      float* __restrict acc;
      if (slot == kNoRow) {  // first occurrence: acc = 0 + g
        slot = num_unique;
        if (!kFast && pin_in_meta) sh.meta(row).aux = num_unique;
        unique[num_unique] = row;
        acc = acc_base + static_cast<size_t>(num_unique) * dim;
        // The update pass prefetches rows kRowAhead ahead, so its first ones would arrive late
        // (a shard holds ~32 ids of a one-hot W1 batch): fetch them now (L=1 backward 0.90x).
        if (num_unique < kRowAhead) prefetch_lines<1>(t.row_ptr(sh, row), row_bytes);
        ++num_unique;
        if (!kFast && scaled) {
          for (size_t k = 0; k < dim; ++k) acc[k] = 0.0f + c * g[k];
        } else {
          for (size_t k = 0; k < dim; ++k) acc[k] = 0.0f + g[k];
        }
      } else {
        acc = acc_base + static_cast<size_t>(slot) * dim;
        if (!kFast && scaled) {
          for (size_t k = 0; k < dim; ++k) acc[k] = acc[k] + c * g[k];
        } else {
          for (size_t k = 0; k < dim; ++k) acc[k] = acc[k] + g[k];
        }
      }
    };
    auto finish = [&](uint32_t q, auto fast) {
      accumulate(pending[q % kRing], ring[q % kRing], fast);
    };
    const auto lock = sh.lock();
    const uint64_t* places = ws.resolution.valid ? ws.resolution.places.data() : nullptr;
    const bool exact = places != nullptr && ws.resolution.exact(s, sh.version_locked());
    if (exact) {
      thread_local std::vector<uint32_t> slots;
      if (slots.size() < sh.num_rows()) slots.resize(sh.num_rows(), kNoRow);
      slot_of = slots.data();
      pin_in_meta = false;
    }
    uint64_t reused = 0;
    // Pass 1 changes nothing a lock-free reader sees (it reads the index and rows; pins live
    // in the metadata), so the shard's version turns odd only when pass 2 or the update
    // begins: readers racing this apply fall back to their careful kernel for half as long.
    std::optional<Shard::WriteScope> writing;
    const bool cow = t.snapshot_join(sh);  // checkpoint in progress: preserve before writing
    struct Unpin {  // runs on success and on CapacityError alike
      Shard& sh;
      const uint32_t* rows;
      const uint32_t& count;
      uint32_t* slot_of;
      const bool& pinned;
      ~Unpin() {
        for (uint32_t k = 0; k < count; ++k) {
          if (slot_of != nullptr) slot_of[rows[k]] = kNoRow;
          if (pinned) sh.meta(rows[k]).aux = kNoRow;
        }
      }
    } unpin{sh, unique, num_unique, slot_of, pin_in_meta};
    // Pass 1: every id already present is resolved, pinned and accumulated, so no insert of
    // this call can evict a row the call is about to update. Missing ids wait for pass 2
    // (all occurrences of a missing id do, so each row's sum keeps the id order).
    uint32_t* missing = ws.order.data() + b;  // reused in place: slots [b, j) are done
    uint32_t num_missing = 0;
    const uint32_t* bags = r.offsets != nullptr ? ws.bag_of.data() : nullptr;
    const auto pass1 = [&](auto fast) {
      constexpr bool kFast = decltype(fast)::value;
      for (uint32_t j = b; j < e; ++j) {
        const uint32_t i = ws.order[j];
        prefetch_inputs(ws, j, e, r.keys, places, bags);
        uint32_t row = kNoRow;
        if (kFast || exact) {
          const uint64_t place = places[i];
          if (place != RowResolution::kUnresolved) {
            row = static_cast<uint32_t>(place);
            ++reused;
          }
        } else if (places != nullptr) {
          // The lookup's row, if it still holds the id (its metadata line and occupied bit
          // are prefetched kRowAhead ids ahead; accumulate reads the metadata anyway).
          if (j + kRowAhead < e) {
            const uint64_t ahead = places[ws.order[j + kRowAhead]];
            if (ahead != RowResolution::kUnresolved) {
              __builtin_prefetch(&sh.meta(static_cast<uint32_t>(ahead)));
              sh.prefetch_occupied(static_cast<uint32_t>(ahead));
            }
          }
          const uint64_t place = places[i];
          if (place != RowResolution::kUnresolved) {
            const uint32_t recorded = static_cast<uint32_t>(place);
            if (sh.occupied(recorded) && sh.meta(recorded).id == r.keys[i]) {
              row = recorded;
              ++reused;
            }
          }
        } else if (j + kSlotAhead < e) {
          sh.prefetch(mix64(r.keys[ws.order[j + kSlotAhead]]));
        }
        if (row == kNoRow) row = sh.find(r.keys[i], mix64(r.keys[i]));
        if (row == kNoRow) {
          // order[b + num_missing] is never ahead of order[j]: safe to overwrite.
          missing[num_missing++] = i;
          continue;
        }
        if (!kFast && !exact) __builtin_prefetch(&sh.meta(row));
        ring[resolved % kRing] = row;
        pending[resolved % kRing] = i;
        if (++resolved - done > kRowAhead) finish(done++, fast);
      }
      while (done < resolved) finish(done++, fast);
    };
    const bool plain = r.offsets != nullptr && r.weights == nullptr && r.mode == PoolMode::kSum;
    if (exact && plain) {
      pass1(std::true_type{});
    } else {
      pass1(std::false_type{});
    }
    ShardCounters::add(sh.counters.reused, reused);
    writing.emplace(sh);
    if (num_missing != 0 && !pin_in_meta) {  // inserts come: pin the rows summed so far
      for (uint32_t k = 0; k < num_unique; ++k) sh.meta(unique[k]).aux = k;
      pin_in_meta = true;
    }
    // Pass 2: insert the missing ids in order (an id may recur: find again first). With an
    // admission filter, an id it has not admitted (by lookups) is not inserted and its
    // gradient is dropped; applies do not count sightings (a training step would count twice).
    for (uint32_t k = 0; k < num_missing; ++k) {
      const uint32_t i = missing[k];
      const uint64_t id = r.keys[i];
      const uint64_t hash = mix64(id);
      uint32_t row = sh.find(id, hash);
      if (row == kNoRow) {
        if (sketch != nullptr && sketch->estimate(hash) < min_count) {
          ++rejected;
          continue;
        }
        row = t.insert_locked(s, id, hash, step, evictions);
        if (row == kNoRow) {
          add_counters(sh, 0, 0, inserts, evictions, rejected);
          throw CapacityError(t.no_row_message(id, s));
        }
        ++inserts;
      }
      accumulate(i, row, std::false_type{});
    }
    const OptimizerConfig opt = t.config_.optimizer;
    // The update pass prefetches rows kRowAhead ahead. On the AMD EPYC (Zen 4) VM, perf put
    // 32% of the W1 D=32 L=8 apply's samples on those prefetches (into L1): with 8 rows of
    // 4-16 lines in flight the loop waits on its own prefetches, likely for L1 miss buffers.
    // A long pass (W1 L=8: ~100 rows per shard) or wide rows (D >= 64 with Adagrad) prefetch
    // into L2 instead. In-process A/B, 2 threads, backward time: D=32 L=8 0.95x, D=64 L=8
    // 0.95x, D=128 L=8 0.81x, D=64 L=1 0.89x, D=128 L=1 0.88x. A short pass of narrow rows
    // (W1 D=32 L=1: ~18 rows per shard) keeps L1 prefetches: into L2 it measured 1.02-1.12x
    // there. Either way the words of each row's reference and dirty bits are prefetched too:
    // in the short pass their loads had 14% of W1 D=32 L=1's step samples (backward with the
    // prefetch, in-process A/Bs: 0.89-0.93x in five of seven at 2 threads, 0.99x and 1.01x in
    // two disturbed passes; 1 thread 0.92x; L=2 0.88x).
    const bool to_l2 = num_unique >= kLongUpdate || row_bytes > kWideRowBytes;
    for (uint32_t k = 0; k < num_unique; ++k) {
      if (k + kRowAhead < num_unique) {
        const uint32_t ahead = unique[k + kRowAhead];
        if (to_l2) {
          prefetch_lines<0, kToL2>(t.row_ptr(sh, ahead), row_bytes);
        } else {
          prefetch_lines(t.row_ptr(sh, ahead), row_bytes);
        }
        sh.prefetch_update_bits(ahead);
      }
      const uint32_t row = unique[k];
      if (cow) t.preserve(s, row);
      apply_update(opt, lr, t.row_ptr(sh, row), acc_base + static_cast<size_t>(k) * dim, dim);
      sh.reference(row);
      sh.mark_dirty(row);
      if (track) sh.touch(row, step);  // its line is cached: the pin wrote aux
    }
    add_counters(sh, 0, 0, inserts, evictions, rejected);
  }
};

// ---------------------------------------------------------------------------------------
// Fork safety: fork() copies memory, not threads. A worker holding a shard lock (maybe in
// the middle of an update) at that moment would leave the child with a locked, half-written
// shard. So the process quiesces every table around fork(): `prepare` takes every shard lock
// of every live table, in registry then shard order, and both sides release them after.
// Workers hold one shard lock at a time and never wait for another while holding it, so the
// ordered acquisition cannot deadlock. The thread pool handles its own lock (thread_pool.cpp).

struct ForkGuard {
  static std::mutex& registry_mutex() {
    static std::mutex* m = new std::mutex();  // leaked: used by fork handlers until exit
    return *m;
  }
  static std::vector<Table*>& registry() {
    static std::vector<Table*>* tables = new std::vector<Table*>();
    return *tables;
  }
  static void add(Table* t) {
    static const bool installed = [] {
      pthread_atfork(&ForkGuard::prepare, &ForkGuard::release, &ForkGuard::release_child);
      return true;
    }();
    (void)installed;
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().push_back(t);
  }
  static void remove(Table* t) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto& r = registry();
    r.erase(std::remove(r.begin(), r.end(), t), r.end());
  }
  // A table's snapshot and resolution mutexes are only ever held briefly and never while
  // waiting for another lock, so taking them first keeps the order deadlock-free.
  static void prepare() {
    registry_mutex().lock();
    for (Table* t : registry()) {
      t->snapshot_mutex_.lock();
      t->resolution_mutex_.lock();
      for (auto& sh : t->shards_) sh->mutex().lock();
    }
  }
  static void release() {
    for (Table* t : registry()) {
      for (auto& sh : t->shards_) sh->mutex().unlock();
      t->resolution_mutex_.unlock();
      t->snapshot_mutex_.unlock();
    }
    registry_mutex().unlock();
  }
  // The child has only the forking thread: a snapshot another thread was writing will never
  // finish there, so the child forgets it (the parent's goes on untouched).
  static void release_child() {
    for (Table* t : registry()) t->reset_snapshot_after_fork();
    release();
  }
};

// ---------------------------------------------------------------------------------------
// Table

Table::Table(const TableConfig& config)
    : config_(config),
      shard_shift_(64),
      arena_(0, 1),
      lr_(config.optimizer.lr) {
  if (config_.dim == 0) throw std::invalid_argument("dim must be positive");
  if (config_.capacity == 0) throw std::invalid_argument("capacity must be positive");
  if (config_.num_shards == 0) config_.num_shards = default_shards(config_.capacity);
  const size_t S = config_.num_shards;
  if (!is_power_of_two(S) || S > kMaxShards) {
    throw std::invalid_argument("num_shards must be a power of two <= " +
                                std::to_string(kMaxShards) + ", got " + std::to_string(S));
  }
  if (S > config_.capacity) {
    throw std::invalid_argument("num_shards (" + std::to_string(S) +
                                ") must not exceed capacity (" +
                                std::to_string(config_.capacity) + ")");
  }
  if (shard_rows(config_.capacity / S + 1, S, config_.capacity) > kMaxShardRows) {
    throw std::invalid_argument(
        "capacity per shard (with its slack) must be < 2^31 - 1; use more shards");
  }
  if (config_.num_threads == 0) config_.num_threads = ThreadPool::hardware_threads();
  unsigned bits = 0;
  while ((size_t{1} << bits) < S) ++bits;
  shard_shift_ = 64 - bits;

  std::vector<uint32_t> rows(S), quotas(S);
  size_t total_rows = 0, total_quota = 0;
  for (size_t s = 0; s < S; ++s) {
    const size_t share = config_.capacity / S + (s < config_.capacity % S ? 1 : 0);
    rows[s] = static_cast<uint32_t>(shard_rows(share, S, config_.capacity));
    quotas[s] = shard_quota(share, S);
    total_rows += rows[s];
    total_quota += quotas[s];
  }
  if (total_rows >= kNoRow) {  // a shard's first row is a uint32
    throw std::invalid_argument("capacity (with its per-shard slack) must be < 2^32 rows");
  }
  pool_.store(config_.capacity - total_quota, std::memory_order_relaxed);
  const AdmissionConfig& adm = config_.admission;
  if (adm.enabled()) {
    if (adm.min_count > CountMinSketch::kMaxCount) {
      throw std::invalid_argument("admission min_count must be <= " +
                                  std::to_string(CountMinSketch::kMaxCount));
    }
    if (adm.depth == 0 || adm.depth > CountMinSketch::kMaxDepth) {
      throw std::invalid_argument("admission depth must be in [1, " +
                                  std::to_string(CountMinSketch::kMaxDepth) + "]");
    }
    if (adm.width < S || adm.width / S >= kNoRow) {
      throw std::invalid_argument("admission width must be in [num_shards, 2^32 * num_shards)");
    }
    sketches_.reserve(S);
    for (size_t s = 0; s < S; ++s) sketches_.emplace_back((adm.width + S - 1) / S, adm.depth);
  }
  staged_rows_.resize(S);
  preimages_.resize(S);
  for (PreImages& p : preimages_) p.width = row_width();
  const size_t stride = row_stride(config_.dim, embstore::state_width(config_.optimizer, config_.dim));
  arena_ = RowArena(total_rows, stride);
  size_t index_bytes = 0;
  for (size_t s = 0; s < S; ++s) index_bytes += Shard::index_bytes(rows[s]);
  shard_index_ = LargeBuffer(index_bytes);  // one huge-page mapping for every shard's index
  shards_.reserve(S);
  size_t first = 0;
  char* memory = static_cast<char*>(shard_index_.data());
  for (size_t s = 0; s < S; ++s) {
    shards_.push_back(
        std::make_unique<Shard>(static_cast<uint32_t>(first), rows[s], quotas[s], memory));
    first += rows[s];
    memory += Shard::index_bytes(rows[s]);
  }
  views_.reserve(S);
  for (const auto& sh : shards_) {
    views_.push_back({sh->index_view(), row_ptr(*sh, 0), sh->reference_words()});
  }
  ThreadPool::global().ensure_helpers(config_.num_threads - 1);
  ForkGuard::add(this);
}

Table::~Table() { ForkGuard::remove(this); }

void Table::keep_resolution(const uint64_t* keys, size_t n, RowResolution& r) {
  r.keys.assign(keys, keys + n);
  r.valid = true;
  r.shrink_if_oversized();
  std::lock_guard<std::mutex> lock(resolution_mutex_);
  pay_references(resolution_);
  std::swap(resolution_, r);
  references_owed_.store(resolution_.refs_pending, std::memory_order_release);
}

bool Table::take_resolution(const uint64_t* keys, size_t n, RowResolution& r) {
  std::lock_guard<std::mutex> lock(resolution_mutex_);  // once per call: compares n ids
  r.valid = resolution_.valid && resolution_.keys.size() == n &&
            (n == 0 || std::memcmp(resolution_.keys.data(), keys, n * sizeof(uint64_t)) == 0);
  if (!r.valid) return false;
  std::swap(resolution_, r);
  resolution_.valid = false;
  references_owed_.store(false, std::memory_order_release);
  return true;
}

void Table::settle_references() {
  if (!references_owed_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(resolution_mutex_);
  pay_references(resolution_);
  references_owed_.store(false, std::memory_order_release);
}

void Table::pay_references(RowResolution& r) noexcept {
  if (!r.valid || !r.refs_pending) return;
  for (const uint64_t place : r.places) {
    if (place != RowResolution::kUnresolved) {
      AtomicBitmap::set(views_[place >> 32].reference_words, static_cast<uint32_t>(place));
    }
  }
  r.refs_pending = false;
}

void Table::set_step(uint64_t step) {
  if (step > 0xFFFFFFFFull) {
    throw std::invalid_argument("step must be < 2^32, got " + std::to_string(step));
  }
  step_.store(static_cast<uint32_t>(step), std::memory_order_relaxed);
  track_steps_.store(true, std::memory_order_relaxed);
}

size_t Table::state_width() const noexcept {
  return embstore::state_width(config_.optimizer, config_.dim);
}

void Table::set_lr(float lr) {
  if (!(lr > 0.0f) || !std::isfinite(lr)) {
    throw std::invalid_argument("lr must be a positive finite number, got " + std::to_string(lr));
  }
  lr_.store(lr, std::memory_order_relaxed);
}

bool Table::try_borrow() noexcept {
  size_t cur = pool_.load(std::memory_order_relaxed);
  while (cur > 0) {
    if (pool_.compare_exchange_weak(cur, cur - 1, std::memory_order_relaxed)) return true;
  }
  return false;
}

size_t Table::size() const noexcept {
  // Shard sizes are read one after another, without their locks: while other threads erase
  // in one shard and borrow the freed pool row in another, the sum can count that row twice.
  // The table itself never holds more than capacity rows (per shard, borrowed rows always
  // equal max(0, size - quota) under its lock), so the snapshot is clamped to it.
  size_t total = 0;
  for (const auto& sh : shards_) total += sh->size();
  return std::min(total, config_.capacity);
}

// A shard only ever evicts its own rows: taking a row from another shard would need that
// shard's lock while holding ours (a deadlock risk, and a try_lock fails under contention),
// and could evict a row that the same call is about to update there. With quotas a shard
// that must evict holds at least one row, so with CLOCK only a shard whose rows are all
// pinned by the current apply reports kNoRow.
uint32_t Table::claim_row_locked(size_t shard_index, uint64_t& evictions, uint64_t max_sweep) {
  Shard& sh = *shards_[shard_index];
  if (sh.has_unclaimed_row() && (sh.size() < sh.quota() || try_borrow())) {
    return sh.claim_unused_row();
  }
  if (config_.eviction != Eviction::kClock) return kNoRow;
  settle_references();
  const uint32_t victim = sh.clock_victim(max_sweep);
  if (victim == kNoRow || victim == kRetry) return victim;
  // The victim's row is rewritten by the caller once its slot is unlinked: fetch its lines
  // for writing now, so they arrive while evict() probes the slot (W2 step 0.96x, in-process
  // A/B).
  prefetch_lines<1>(row_ptr(sh, victim), arena_.stride() * sizeof(float));
  if (sh.snapshot_pending()) preserve(shard_index, victim);  // the caller joined
  if (config_.stage_evicted) {
    RemovedRows& staged = staged_rows_[shard_index];
    const float* values = row_ptr(sh, victim);
    staged.ids.push_back(sh.meta(victim).id);
    staged.rows.insert(staged.rows.end(), values, values + config_.dim);
    staged_.fetch_add(1, std::memory_order_relaxed);
  }
  sh.evict(victim);
  ++evictions;
  // The next insert most likely takes the next clear row past the hand: fetch its id's
  // index slot (which evict() probes) and its row, while the caller does other work (W2
  // step 0.96x, in-process A/B).
  const uint32_t next = sh.likely_victim(64);
  if (next != kNoRow) {
    sh.prefetch(mix64(sh.meta(next).id));
    prefetch_lines<1>(row_ptr(sh, next), arena_.stride() * sizeof(float));
  }
  return victim;
}

uint32_t Table::insert_locked(size_t shard_index, uint64_t id, uint64_t hash, uint32_t step,
                              uint64_t& evictions, uint64_t max_sweep) {
  Shard& sh = *shards_[shard_index];
  const uint32_t row = claim_row_locked(shard_index, evictions, max_sweep);
  if (row == kNoRow || row == kRetry) return row;
  float* values = row_ptr(sh, row);
  initial_row(config_.initializer, id, values, config_.dim);
  init_state(config_.optimizer, values + config_.dim, config_.dim);
  sh.link(id, hash, row, step);
  return row;
}

std::string Table::no_row_message(uint64_t id, size_t shard_index) const {
  std::string msg = "no row for id " + std::to_string(id) + ": the table is full (capacity " +
                    std::to_string(config_.capacity) + ")";
  if (config_.eviction == Eviction::kNone) return msg + " and eviction is 'none'";
  return msg + " and shard " + std::to_string(shard_index) +
         " has no row it may evict (every row it holds is updated by this call)";
}

TableStats Table::stats() const {
  TableStats st;
  st.size = size();
  st.capacity = config_.capacity;
  st.dim = config_.dim;
  st.num_shards = shards_.size();
  st.row_stride = arena_.stride();
  size_t meta_and_index = 0;
  st.hits = read_hits_.load(std::memory_order_relaxed);
  st.misses = read_misses_.load(std::memory_order_relaxed);
  st.read_retries = read_retries_.load(std::memory_order_relaxed);
  for (const auto& sh : shards_) {
    st.hits += sh->counters.hits.load(std::memory_order_relaxed);
    st.misses += sh->counters.misses.load(std::memory_order_relaxed);
    st.inserts += sh->counters.inserts.load(std::memory_order_relaxed);
    st.evictions += sh->counters.evictions.load(std::memory_order_relaxed);
    st.erased += sh->counters.erased.load(std::memory_order_relaxed);
    st.rejected += sh->counters.rejected.load(std::memory_order_relaxed);
    st.lock_waits += sh->counters.lock_waits.load(std::memory_order_relaxed);
    st.lock_wait_ns += sh->counters.lock_wait_ns.load(std::memory_order_relaxed);
    st.reused_rows += sh->counters.reused.load(std::memory_order_relaxed);
    st.arena_bytes_in_use += static_cast<uint64_t>(sh->used_rows()) * arena_.stride() * sizeof(float);
    meta_and_index += sh->footprint_bytes();
  }
  if (config_.admission.enabled()) st.admitted = st.inserts;
  for (const auto& sketch : sketches_) meta_and_index += sketch.bytes();
  const double arena_bytes = static_cast<double>(arena_.rows() * arena_.stride() * sizeof(float));
  st.bytes_per_row = (arena_bytes + static_cast<double>(meta_and_index)) /
                     static_cast<double>(arena_.rows());
  return st;
}

void Table::lookup(const uint64_t* keys, size_t n, bool insert, float* out) {
  std::vector<LookupSumRequest> one{
      LookupSumRequest{this, keys, n, nullptr, n, nullptr, PoolMode::kSum, insert, out, {}}};
  lookup_sum_many(one, Timer::kLookup);
}

void Table::lookup_sum(const uint64_t* keys, size_t n, const int64_t* offsets, size_t num_bags,
                       const float* weights, PoolMode mode, bool insert, float* out) {
  if (offsets == nullptr && (weights != nullptr || mode != PoolMode::kSum)) {
    throw std::invalid_argument("lookup_sum: weights and mean pooling need offsets");
  }
  std::vector<LookupSumRequest> one{
      LookupSumRequest{this, keys, n, offsets, num_bags, weights, mode, insert, out, {}}};
  lookup_sum_many(one);
}

void Table::apply_gradients(const uint64_t* keys, size_t n, const float* grads,
                            const int64_t* offsets, size_t num_bags, const float* weights,
                            PoolMode mode) {
  std::vector<ApplyRequest> one{
      ApplyRequest{this, keys, n, grads, offsets, num_bags, weights, mode, {}}};
  apply_gradients_many(one);
}

void Table::contains(const uint64_t* keys, size_t n, bool* out) {
  ScopedTimer timed(&timer(Timer::kContains));
  Workspace& ws = workspace(0);
  BatchRunner::plan(*this, keys, n, ws);
  const size_t rot = rotation();
  ThreadPool::global().run(shards_.size(), choose_workers(n, config_.num_threads),
                           [&](size_t task) {
    const size_t s = (task + rot) % shards_.size();
    Shard& sh = *shards_[s];
    const auto lock = sh.lock();
    for (uint32_t j = ws.shard_begin[s]; j < ws.shard_begin[s + 1]; ++j) {
      const uint32_t i = ws.order[j];
      out[i] = sh.find(keys[i], mix64(keys[i])) != kNoRow;
    }
  });
}

size_t Table::erase(const uint64_t* keys, size_t n) {
  ScopedTimer timed(&timer(Timer::kErase));
  Workspace& ws = workspace(0);
  BatchRunner::plan(*this, keys, n, ws);
  std::atomic<size_t> removed{0};
  const size_t rot = rotation();
  ThreadPool::global().run(shards_.size(), choose_workers(n, config_.num_threads),
                           [&](size_t task) {
    const size_t s = (task + rot) % shards_.size();
    Shard& sh = *shards_[s];
    size_t count = 0;
    const auto lock = sh.lock();
    const Shard::WriteScope writing(sh);
    const bool cow = snapshot_join(sh);
    size_t returned = 0;
    for (uint32_t j = ws.shard_begin[s]; j < ws.shard_begin[s + 1]; ++j) {
      const uint64_t id = keys[ws.order[j]];
      if (cow) {
        const uint32_t row = sh.find(id, mix64(id));
        if (row != kNoRow) preserve(s, row);
      }
      const bool over_quota = sh.size() > sh.quota();
      if (sh.unlink_and_free(id, mix64(id)) != kNoRow) {
        ++count;
        if (over_quota) ++returned;  // that row was borrowed from the pool
      }
    }
    ShardCounters::add(sh.counters.erased, count);
    if (returned != 0) give_back(returned);
    removed.fetch_add(count, std::memory_order_relaxed);
  });
  return removed.load();
}

size_t Table::evict_older_than(uint64_t step, bool with_state, RemovedRows& out) {
  const size_t width = with_state ? config_.dim + state_width() : config_.dim;
  if (out.width != 0 && out.width != width) throw std::invalid_argument("row width mismatch");
  out.width = width;
  size_t removed = 0;
  for (size_t s = 0; s < shards_.size(); ++s) {
    Shard& sh = *shards_[s];
    const auto lock = sh.lock();
    const Shard::WriteScope writing(sh);
    const bool cow = snapshot_join(sh);
    size_t returned = 0, count = 0;
    for (uint32_t row = 0; row < sh.claimed_rows(); ++row) {
      if (!sh.occupied(row) || sh.last_step(row) >= step) continue;
      if (cow) preserve(s, row);
      const float* values = row_ptr(sh, row);
      out.ids.push_back(sh.meta(row).id);
      out.rows.insert(out.rows.end(), values, values + width);
      if (sh.size() > sh.quota()) ++returned;  // that row was borrowed from the pool
      sh.free_row(row);
      ++count;
    }
    ShardCounters::add(sh.counters.evictions, count);
    removed += count;
    if (returned != 0) give_back(returned);
  }
  return removed;
}

size_t Table::drain_evicted(RemovedRows& out) {
  if (out.width != 0 && out.width != config_.dim) throw std::invalid_argument("row width mismatch");
  out.width = config_.dim;
  size_t moved = 0;
  for (size_t s = 0; s < shards_.size(); ++s) {
    RemovedRows& staged = staged_rows_[s];
    const auto lock = shards_[s]->lock();
    if (staged.ids.empty()) continue;
    out.ids.insert(out.ids.end(), staged.ids.begin(), staged.ids.end());
    out.rows.insert(out.rows.end(), staged.rows.begin(), staged.rows.end());
    moved += staged.ids.size();
    staged.ids.clear();  // keeps capacity: no allocation once warm
    staged.rows.clear();
  }
  staged_.fetch_sub(moved, std::memory_order_relaxed);
  return moved;
}

void Table::initial_values(const uint64_t* keys, size_t n, float* out) const {
  const size_t chunk = 1024;
  ThreadPool::global().run((n + chunk - 1) / chunk, choose_workers(n, config_.num_threads),
                           [&](size_t task) {
    for (size_t i = task * chunk; i < std::min(n, (task + 1) * chunk); ++i) {
      initial_row(config_.initializer, keys[i], out + i * config_.dim, config_.dim);
    }
  });
}

// ---------------------------------------------------------------------------------------
// Checkpoint support: pre-images, imports, sketches

void PreImages::add(uint64_t id, uint32_t step, bool was_dirty, const float* row) {
  const size_t k = ids.size();
  if (k / kChunkRows == chunks.size()) chunks.emplace_back(new float[kChunkRows * width]);
  std::memcpy(chunks[k / kChunkRows].get() + (k % kChunkRows) * width, row,
              width * sizeof(float));
  ids.push_back(id);
  steps.push_back(step);
  dirty.push_back(was_dirty ? 1 : 0);
}

void PreImages::clear() noexcept {
  std::vector<uint64_t>().swap(ids);
  std::vector<uint32_t>().swap(steps);
  std::vector<uint8_t>().swap(dirty);
  std::vector<std::unique_ptr<float[]>>().swap(chunks);
  emitted = 0;
}

void Table::preserve(size_t s, uint32_t row) {
  Shard& sh = *shards_[s];
  if (!sh.needs_preimage(row)) return;
  const RowMeta& m = sh.meta(row);
  preimages_[s].add(m.id, m.last_step, sh.dirty(row), row_ptr(sh, row));
  sh.set_captured(row);
}

void Table::touch_step(size_t s, uint32_t row, uint32_t step, bool cow) {
  Shard& sh = *shards_[s];
  if (sh.meta(row).last_step == step) return;
  if (cow) preserve(s, row);
  sh.meta(row).last_step = step;
  sh.mark_dirty(row);
}

void Table::abandon_snapshot_locked(size_t s, uint64_t gen) {
  Shard& sh = *shards_[s];
  if (sh.snapshot_gen() != gen) sh.open_snapshot(gen, false);  // so no writer joins it later
  sh.close_snapshot();
  preimages_[s].clear();
}

void Table::reset_snapshot_after_fork() {
  // Runs in the fork child with every lock of the table held by this (the only) thread.
  new (&snapshot_cv_) std::condition_variable();  // no thread of the child waits on it
  if (!snapshot_busy_) return;
  const uint64_t gen = snapshot_gen_.load(std::memory_order_relaxed);
  for (size_t s = 0; s < shards_.size(); ++s) {
    abandon_snapshot_locked(s, gen);
    shards_[s]->restore_dirty();
  }
  snapshot_busy_ = false;
  active_gen_ = 0;
}

size_t Table::import_rows(const uint64_t* ids, size_t n, const float* rows,
                          const uint32_t* steps, ImportMode mode, uint8_t* placed) {
  const size_t width = row_width();
  const bool restore = mode == ImportMode::kRestore;
  const bool track = track_steps_.load(std::memory_order_relaxed);
  const uint32_t now = track ? step() : 0;
  Workspace& ws = workspace(0);
  BatchRunner::plan(*this, ids, n, ws);
  std::atomic<size_t> stored{0};
  const size_t rot = rotation();
  ThreadPool::global().run(shards_.size(), choose_workers(n, config_.num_threads),
                           [&](size_t task) {
    const size_t s = (task + rot) % shards_.size();
    const uint32_t b = ws.shard_begin[s], e = ws.shard_begin[s + 1];
    if (b == e) return;
    Shard& sh = *shards_[s];
    uint64_t inserts = 0, evictions = 0;
    size_t count = 0;
    const auto lock = sh.lock();
    const Shard::WriteScope writing(sh);
    const bool cow = snapshot_join(sh);
    for (uint32_t j = b; j < e; ++j) {
      const uint32_t i = ws.order[j];
      const uint64_t id = ids[i];
      const uint64_t hash = mix64(id);
      const uint32_t last = steps != nullptr ? steps[i] : now;
      uint32_t row = sh.find(id, hash);
      if (row == kNoRow) {
        if (restore) {  // never evicts: a fresh table has room unless it is too small
          if (sh.has_unclaimed_row() && (sh.size() < sh.quota() || try_borrow())) {
            row = sh.claim_unused_row();
          }
        } else {
          row = claim_row_locked(s, evictions);
        }
        if (row == kNoRow) {
          if (restore) {
            if (placed != nullptr) placed[i] = 0;
            continue;
          }
          ShardCounters::add(sh.counters.inserts, inserts);
          ShardCounters::add(sh.counters.evictions, evictions);
          throw CapacityError(no_row_message(id, s));
        }
        std::memcpy(row_ptr(sh, row), rows + static_cast<size_t>(i) * width,
                    width * sizeof(float));
        sh.link(id, hash, row, last);
        ++inserts;
      } else {
        if (cow) preserve(s, row);
        std::memcpy(row_ptr(sh, row), rows + static_cast<size_t>(i) * width,
                    width * sizeof(float));
        sh.meta(row).last_step = last;
        sh.reference(row);
      }
      if (restore) {
        sh.clear_dirty(row);  // equal to the checkpoint it came from
        sh.set_saved(row);
      } else {
        sh.mark_dirty(row);
      }
      if (placed != nullptr) placed[i] = 1;
      ++count;
    }
    if (!restore) {
      ShardCounters::add(sh.counters.inserts, inserts);
      ShardCounters::add(sh.counters.evictions, evictions);
    }
    stored.fetch_add(count, std::memory_order_relaxed);
  });
  return stored.load();
}

std::vector<uint16_t> Table::sketch_counters(size_t s) {
  if (sketches_.empty()) return {};
  const auto lock = shards_[s]->lock();
  return sketches_[s].counters();
}

bool Table::restore_sketch(size_t s, const uint16_t* counters, size_t count) {
  if (sketches_.empty() || s >= sketches_.size()) return false;
  const auto lock = shards_[s]->lock();
  std::vector<uint16_t>& mine = sketches_[s].counters();
  if (mine.size() != count) return false;
  std::memcpy(mine.data(), counters, count * sizeof(uint16_t));
  return true;
}

// ---------------------------------------------------------------------------------------
// Multi-table batches

void lookup_sum_many(std::vector<LookupSumRequest>& requests, Timer op) {
  StageClock clock;
  const size_t R = requests.size();
  std::vector<Workspace*> spaces = caller_workspaces(R);
  const size_t workers = workers_for(requests);
  // 1. Validate everything before any table changes.
  validate_each(R, workers, [&](size_t k) {
    const LookupSumRequest& r = requests[k];
    Workspace& ws = *spaces[k];
    ws.one_hot = true;
    if (r.offsets != nullptr) {
      const size_t longest = validate_offsets(r.offsets, r.num_bags, r.n, r.label);
      ws.one_hot = longest <= 1 && r.num_bags == r.n;
    } else if (r.num_bags != r.n) {  // without offsets every id is its own bag
      throw std::invalid_argument(prefix(r.label) + "without offsets, num_bags must equal n");
    }
    if (r.weights != nullptr) validate_finite(r.weights, r.n, "weights", r.label);
  });
  ThreadPool& pool = ThreadPool::global();
  clock.lap(Timer::kStageValidate);

  // 2. Optimistic pass: tasks of ~kIdsPerReadTask ids (whole bags) read rows without locks
  //    and pool them in bag order. A request that needs an insert or races with a writer is
  //    aborted and redone on the locked path below.
  std::vector<size_t> bags_per_task(R);
  TaskSpace tasks;
  for (size_t k = 0; k < R; ++k) {
    const LookupSumRequest& r = requests[k];
    const size_t count = std::max<size_t>(1, (r.n + kIdsPerReadTask - 1) / kIdsPerReadTask);
    bags_per_task[k] = std::max<size_t>(1, (r.num_bags + count - 1) / count);
    tasks.add(r.num_bags == 0 ? 0 : (r.num_bags + bags_per_task[k] - 1) / bags_per_task[k]);
  }
  thread_local std::vector<BatchRunner::ReadTask> read_tasks;  // reused: no allocation warm
  if (read_tasks.size() < tasks.total()) read_tasks.resize(tasks.total());
  std::unique_ptr<std::atomic<bool>[]> aborted(new std::atomic<bool>[R]);
  for (size_t k = 0; k < R; ++k) {
    // Step tracking writes each row's last step (and its dirty bit, with copy-on-write while
    // a checkpoint runs): that needs the shard lock, so such tables take the locked path.
    const bool track = requests[k].table->track_steps_.load(std::memory_order_relaxed);
    aborted[k].store(track, std::memory_order_relaxed);
  }
  std::vector<BatchRunner::ReadTask>& reads = read_tasks;
  // Per id: its place, written by the read tasks (and by gather_shard if the request goes
  // to the locked path; a request's places are kept only if it inserts).
  std::vector<uint64_t*> read_places(R);
  for (size_t k = 0; k < R; ++k) {
    spaces[k]->resolution.places.resize(requests[k].n);
    read_places[k] = spaces[k]->resolution.places.data();
  }
  pool.run(tasks.total(), workers, [&](size_t task) {
    const size_t k = tasks.request_of(task);
    const LookupSumRequest& r = requests[k];
    BatchRunner::ReadTask& read = reads[task];
    if (aborted[k].load(std::memory_order_relaxed)) return;
    const size_t bag_lo = (task - tasks.begin[k]) * bags_per_task[k];
    const size_t bag_hi = std::min(r.num_bags, bag_lo + bags_per_task[k]);
    BatchRunner::read_bags(*r.table, r, bag_lo, bag_hi, aborted[k], read, read_places[k], false);
    if (read.raced && !aborted[k].load(std::memory_order_relaxed)) {
      r.table->read_retries_.fetch_add(1, std::memory_order_relaxed);  // redo it row by row
      BatchRunner::read_bags(*r.table, r, bag_lo, bag_hi, aborted[k], read, read_places[k], true);
    }
  });
  pool.run(R, workers, [&](size_t k) {  // (every task ran: reads[] is complete)
    BatchRunner::finish_reads(*requests[k].table, requests[k], reads.data() + tasks.begin[k],
                              tasks.begin[k + 1] - tasks.begin[k],
                              aborted[k].load(std::memory_order_relaxed), spaces[k]->resolution);
  });
  clock.lap(Timer::kStageGather);

  // 3. Locked path for aborted requests: group ids by shard, resolve them under each
  //    shard's lock in id order (inserting missing ids), then pool their rows in bag order.
  std::vector<size_t> locked;
  for (size_t k = 0; k < R; ++k) {
    if (aborted[k].load(std::memory_order_relaxed)) locked.push_back(k);
  }
  if (locked.empty()) {
    clock.record(requests, op);
    return;
  }
  // A training lookup that pools (bags of any size) records its rows' places and pools
  // straight from the rows after the pass (gather_shard's `pass`); others copy the rows to
  // their output (one id per bag) or to the workspace, and pool from there.
  const auto record_only = [&](size_t k) {
    return requests[k].insert && !spaces[k]->one_hot;
  };
  pool.run(locked.size(), workers, [&](size_t q) {
    const size_t k = locked[q];
    const LookupSumRequest& r = requests[k];
    BatchRunner::plan(*r.table, r.keys, r.n, *spaces[k]);
    if (!spaces[k]->one_hot) spaces[k]->rows.resize(r.n * r.table->dim());
    spaces[k]->resolution.versions.assign(r.table->num_shards(), RowResolution::kUnknownVersion);
    spaces[k]->pass.resize(r.table->num_shards());
  });
  clock.lap(Timer::kStagePlan);
  const size_t rot = rotation();
  // Runs the locked pass of requests locked[q] for q in `which`.
  const auto gather = [&](const std::vector<size_t>& which, bool first) {
    TaskSpace shard_tasks;
    for (const size_t q : which) shard_tasks.add(requests[locked[q]].table->num_shards());
    pool.run(shard_tasks.total(), workers, [&](size_t task) {
      const size_t w = shard_tasks.request_of(task);
      const size_t k = locked[which[w]];
      const LookupSumRequest& r = requests[k];
      Workspace& ws = *spaces[k];
      const size_t s = (task - shard_tasks.begin[w] + rot) % r.table->num_shards();
      uint64_t* places = r.insert ? ws.resolution.places.data() : nullptr;
      uint64_t* versions = ws.resolution.versions.data();
      if (ws.one_hot) {
        BatchRunner::gather_shard(*r.table, s, r.keys, ws, r.insert, r.weights,
                                  r.offsets != nullptr, r.out, places, versions);
      } else {
        BatchRunner::gather_shard(*r.table, s, r.keys, ws, r.insert, nullptr, false,
                                  ws.rows.data(), places, versions,
                                  first && record_only(k) ? ws.pass.data() : nullptr, first);
      }
    });
  };
  // Pools the bags of requests locked[q] for q in `which`; `raced[q]` is set where a
  // record-only request's rows changed before they were read.
  std::unique_ptr<std::atomic<bool>[]> raced(new std::atomic<bool>[locked.size()]);
  for (size_t q = 0; q < locked.size(); ++q) raced[q].store(false, std::memory_order_relaxed);
  const auto pool_all = [&](const std::vector<size_t>& which, bool first) {
    TaskSpace pool_tasks;
    for (const size_t q : which) {
      const size_t k = locked[q];
      pool_tasks.add(spaces[k]->one_hot ? 0 : (requests[k].num_bags + kBagsPerPoolTask - 1) /
                                                  kBagsPerPoolTask);
    }
    pool.run(pool_tasks.total(), workers, [&](size_t task) {
      const size_t w = pool_tasks.request_of(task);
      const size_t k = locked[which[w]];
      const LookupSumRequest& r = requests[k];
      Workspace& ws = *spaces[k];
      const size_t lo = (task - pool_tasks.begin[w]) * kBagsPerPoolTask;
      const size_t hi = std::min(r.num_bags, lo + kBagsPerPoolTask);
      if (!first || !record_only(k)) {
        BatchRunner::pool_bags(r, r.table->dim(), ws.rows.data(), lo, hi);
      } else if (!BatchRunner::pool_places(*r.table, r, ws.resolution.places.data(),
                                           ws.pass.data(), ws.rows.data(), lo, hi)) {
        raced[which[w]].store(true, std::memory_order_relaxed);
      }
    });
    return pool_tasks.total() != 0;
  };
  std::vector<size_t> all(locked.size());
  for (size_t q = 0; q < locked.size(); ++q) all[q] = q;
  gather(all, true);
  clock.lap(Timer::kStageLockedGather);
  const bool pooled = pool_all(all, true);
  // A writer changed rows a record-only request was to read: redo its pass copying rows.
  // Its ids are in the table now unless that writer evicted them; the redo does not count
  // its hits and misses again (an admission sketch does see its rejected ids again).
  std::vector<size_t> redo;
  for (size_t q = 0; q < locked.size(); ++q) {
    if (raced[q].load(std::memory_order_relaxed)) redo.push_back(q);
  }
  if (!redo.empty()) {
    for (const size_t q : redo) requests[locked[q]].table->read_retries_.fetch_add(1);
    gather(redo, false);
    pool_all(redo, false);
  }
  for (const size_t k : locked) {  // inexact shards' rows are checked (see gather_shard)
    const LookupSumRequest& r = requests[k];
    if (r.insert) {
      Workspace& ws = *spaces[k];
      ws.resolution.refs_pending = false;  // gather_shard referenced its rows
      std::swap(ws.resolution.order, ws.order);  // the plan goes with it, for the apply
      std::swap(ws.resolution.shard_begin, ws.shard_begin);
      ws.resolution.planned = true;
      r.table->keep_resolution(r.keys, r.n, ws.resolution);
    }
  }
  if (pooled) clock.lap(Timer::kStagePool);
  clock.record(requests, op);
}

void apply_gradients_many(std::vector<ApplyRequest>& requests, Timer op) {
  StageClock clock;
  const size_t R = requests.size();
  std::vector<Workspace*> spaces = caller_workspaces(R);
  const size_t workers = workers_for(requests);
  // 1. Validate everything before any table changes.
  validate_each(R, workers, [&](size_t k) {
    const ApplyRequest& r = requests[k];
    const size_t grad_rows = r.offsets == nullptr ? r.n : r.num_bags;
    if (r.offsets != nullptr) validate_offsets(r.offsets, r.num_bags, r.n, r.label);
    validate_finite(r.grads, grad_rows * r.table->dim(), "grads", r.label);
    if (r.weights != nullptr) validate_finite(r.weights, r.n, "weights", r.label);
  });
  ThreadPool& pool = ThreadPool::global();
  std::vector<float> lrs(R);  // one learning rate per call, even if set_lr runs meanwhile
  for (size_t k = 0; k < R; ++k) lrs[k] = requests[k].table->lr();
  clock.lap(Timer::kStageValidate);
  // 2. Group by shard; map each id to its bag. (The gradient sums live in per-thread
  //    scratch: apply_scratch.)
  pool.run(R, workers, [&](size_t k) {
    const ApplyRequest& r = requests[k];
    Workspace& ws = *spaces[k];
    const bool reuse = r.table->take_resolution(r.keys, r.n, ws.resolution);
    if (reuse && ws.resolution.planned) {  // the lookup's locked pass grouped these ids
      std::swap(ws.order, ws.resolution.order);
      std::swap(ws.shard_begin, ws.resolution.shard_begin);
      ws.resolution.planned = false;
    } else {
      BatchRunner::plan(*r.table, r.keys, r.n, ws, reuse ? ws.resolution.places.data() : nullptr);
    }
    if (r.offsets != nullptr) {
      ws.bag_of.resize(r.n);
      for (size_t bag = 0; bag < r.num_bags; ++bag) {
        for (int64_t i = r.offsets[bag]; i < r.offsets[bag + 1]; ++i) {
          ws.bag_of[static_cast<size_t>(i)] = static_cast<uint32_t>(bag);
        }
      }
    }
  });
  clock.lap(Timer::kStagePlan);
  // 3. One task per (request, shard): sum duplicates, then one fused update per row. Every
  //    updated row gets its reference bit, which pays what a taken resolution owed; if the
  //    call fails part way, the owed bits are set here instead.
  TaskSpace shard_tasks;
  for (const ApplyRequest& r : requests) shard_tasks.add(r.table->num_shards());
  const size_t rot = rotation();
  try {
    pool.run(shard_tasks.total(), workers, [&](size_t task) {
      const size_t k = shard_tasks.request_of(task);
      const ApplyRequest& r = requests[k];
      const size_t s = (task - shard_tasks.begin[k] + rot) % r.table->num_shards();
      BatchRunner::apply_shard(*r.table, s, r, lrs[k], *spaces[k]);
    });
  } catch (...) {
    for (size_t k = 0; k < R; ++k) requests[k].table->pay_references(spaces[k]->resolution);
    throw;
  }
  clock.lap(Timer::kStageUpdate);
  clock.record(requests, op);
}

}  // namespace embstore
