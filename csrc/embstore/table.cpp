#include "embstore/table.hpp"

#include <algorithm>  // std::min, std::max
#include <cmath>      // std::isfinite, std::sqrt, std::ceil
#include <cstring>    // std::memcmp
#include <stdexcept>  // std::invalid_argument
#include <string>     // std::to_string
#include <utility>    // std::swap

#include "embstore/errors.hpp"                 // CapacityError
#include "embstore/hash.hpp"                   // mix64
#include "embstore/initializer.hpp"            // initial_row
#include "embstore/internal/batch_common.hpp"  // workspace, rotation, choose_workers
#include "embstore/internal/batch_runner.hpp"  // BatchRunner::plan
#include "embstore/internal/float_env.hpp"     // DenormalScope
#include "embstore/internal/fork_guard.hpp"    // ForkGuard
#include "embstore/internal/tuning.hpp"        // kMaxShards
#include "embstore/optimizer.hpp"              // state_width, init_state
#include "embstore/thread_pool.hpp"            // ThreadPool

namespace embstore {

using detail::choose_workers;
using detail::kMaxShards;
using detail::prefetch_lines;
using detail::rotation;
using detail::Workspace;
using detail::workspace;

namespace {

bool is_power_of_two(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

constexpr size_t kRowsPerDefaultShard = 16384;

size_t default_shards(size_t capacity) {
  // One shard per 16,384 rows, at most 16: enough that concurrent callers rarely meet on a
  // lock (W3: fewer lock waits than with 64), few enough that a call's ids per shard keep
  // the fixed costs per (table, shard) small and small tables keep one exact CLOCK ring.
  // A shard's slack (shard_rows: 4 sigma + 32) is 3.3% of 16,384 rows, 10% of 2,048, and
  // resident once huge pages span the shards: mid-size tables paid ~8 bytes a row for it.
  // From 16,384 rows at least two: an apply runs a task per shard (one shard: one thread).
  size_t s = capacity >= kRowsPerDefaultShard ? 2 : 1;
  while (s < 16 && s * 2 * kRowsPerDefaultShard <= capacity) s *= 2;
  return s;
}

// Capacity is split into per-shard quotas and a pool of the rest. A shard below its quota
// can always take a row; beyond it, it borrows from the pool, and once the pool is empty it
// evicts one of its own rows. No shard ever needs another shard's rows (no cross-shard
// locking). Rows a light shard leaves under its quota cannot be lent, so the quota sits
// 6 sigma of a shard's load (binomial: sigma = sqrt(share)) below its share: then no shard
// of `capacity` hashed ids is left under its quota, and the pool covers every heavier one.
// The reserve stays within [share/16, share/4], so a shard still gets 3/4 of its share
// (the rows one apply may pin) on a full table. Quotas are accounting only: no memory.
uint32_t shard_quota(size_t share, size_t num_shards) {
  if (num_shards == 1) return static_cast<uint32_t>(share);
  const size_t six_sigma =
      static_cast<size_t>(std::ceil(6.0 * std::sqrt(static_cast<double>(share))));
  const size_t reserve = std::min(std::max(share / 16, six_sigma), share / 4);
  return static_cast<uint32_t>(std::max<size_t>(1, share - reserve));
}

// Rows a shard may own: its share of the capacity plus slack for hash imbalance. With
// 4 sigma + 32 a shard of random ids overflows it rarely (and then just evicts early: quotas
// keep len <= capacity either way). The slack is kept small because its pages become
// resident once neighbouring shards touch their huge pages (see docs/tuning.md).
size_t shard_rows(size_t share, size_t num_shards, size_t capacity) {
  size_t rows = share;
  if (num_shards > 1) rows += static_cast<size_t>(4.0 * std::sqrt(static_cast<double>(share))) + 32;
  return std::min(rows, capacity);
}

}  // namespace

Table::Table(const TableConfig& config)
    : config_(config), shard_shift_(64), arena_(0, 1), lr_(config.optimizer.lr) {
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
                                ") must not exceed capacity (" + std::to_string(config_.capacity) +
                                ")");
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
  const size_t stride =
      row_stride(config_.dim, embstore::state_width(config_.optimizer, config_.dim));
  arena_ = RowArena(total_rows, stride);
  size_t index_bytes = 0, steps_bytes = 0;
  for (size_t s = 0; s < S; ++s) {
    index_bytes += Shard::index_bytes(rows[s]);
    steps_bytes += Shard::steps_bytes(rows[s]);
  }
  // One huge-page mapping for every shard's index, then every shard's steps.
  shard_index_ = LargeBuffer(index_bytes + steps_bytes);
  shards_.reserve(S);
  size_t first = 0;
  char* memory = static_cast<char*>(shard_index_.data());
  char* steps = memory + index_bytes;
  for (size_t s = 0; s < S; ++s) {
    shards_.push_back(std::make_unique<Shard>(static_cast<uint32_t>(first), rows[s], quotas[s],
                                              memory, reinterpret_cast<uint32_t*>(steps)));
    first += rows[s];
    memory += Shard::index_bytes(rows[s]);
    steps += Shard::steps_bytes(rows[s]);
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
  const detail::DenormalScope ieee;  // DAZ would take a denormal lr for 0
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
  // for writing now, so they arrive while evict() unlinks the slot.
  prefetch_lines<1>(row_ptr(sh, victim), arena_.stride() * sizeof(float));
  if (sh.snapshot_pending()) preserve(shard_index, victim);  // the caller joined
  if (config_.stage_evicted) {
    RemovedRows& staged = staged_rows_[shard_index];
    const float* values = row_ptr(sh, victim);
    staged.ids.push_back(sh.id_of(victim));
    staged.rows.insert(staged.rows.end(), values, values + config_.dim);
    staged_.fetch_add(1, std::memory_order_relaxed);
  }
  sh.evict(victim);
  ++evictions;
  // The next insert most likely takes the next clear row past the hand: fetch its index
  // slot (which the sweep and evict() read) and its row, while the caller does other work.
  const uint32_t next = sh.likely_victim(64);
  if (next != kNoRow) {
    sh.prefetch_slot_of(next);
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
    st.arena_bytes_in_use +=
        static_cast<uint64_t>(sh->used_rows()) * arena_.stride() * sizeof(float);
    meta_and_index += sh->footprint_bytes();
  }
  if (config_.admission.enabled()) st.admitted = st.inserts;
  for (const auto& sketch : sketches_) meta_and_index += sketch.bytes();
  const double arena_bytes = static_cast<double>(arena_.rows() * arena_.stride() * sizeof(float));
  st.bytes_per_row =
      (arena_bytes + static_cast<double>(meta_and_index)) / static_cast<double>(arena_.rows());
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
  ScopedTimer timed(timer(Timer::kContains));
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
  ScopedTimer timed(timer(Timer::kErase));
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
      out.ids.push_back(sh.id_of(row));
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
  const detail::DenormalScope ieee;  // the caller's FTZ/DAZ modes (float_env.hpp)
  const size_t chunk = 1024;
  ThreadPool::global().run(
      (n + chunk - 1) / chunk, choose_workers(n, config_.num_threads), [&](size_t task) {
        for (size_t i = task * chunk; i < std::min(n, (task + 1) * chunk); ++i) {
          initial_row(config_.initializer, keys[i], out + i * config_.dim, config_.dim);
        }
      });
}

}  // namespace embstore
