// File: embstore/table.hpp
//
// Table: an embedding table (uint64 id -> float32 row of `dim` weights + optimizer state).
// Rows live in one preallocated RowArena; ids are spread over a power-of-two number of
// Shards by the high bits of mix64(id); each shard owns a fixed slice of the arena, its own
// index, CLOCK ring and lock.
//
// Batch operations group the batch's ids by shard (a stable counting sort), take each
// shard's lock once, and run shards as tasks on the shared ThreadPool; pooling then runs per
// bag in a fixed order, so results are bitwise identical for any thread count.
// The exact semantics (insertion, summation orders, optimizers, CLOCK) are in
// docs/semantics.md.
//
// Thread safety: every public method may be called from any number of threads at once.
// Reads are row-consistent: lookups read rows without locks and validate them with the
// shard's seqlock version (redoing under the lock a read that raced a writer), so a row is
// never half-updated nor another id's row. Writers take each shard's lock once per batch.
// There is no table-wide lock.
//
// Errors: std::invalid_argument for bad input (thrown before anything changes),
// CapacityError when a row is needed and none can be had (see docs/semantics.md).
//
// Checkpoints: a Snapshot (snapshot.hpp) copies the table out, shard by shard, as it was at
// one instant while other threads keep calling every operation: writers call
// snapshot_join() once per critical section and preserve() before changing a row of a shard
// the snapshot has not written yet (copy-on-write of pre-images). import_rows() puts rows
// back (a checkpoint load, or Table.import_).
#pragma once

#include <atomic>              // std::atomic
#include <condition_variable>  // std::condition_variable
#include <cstddef>             // size_t
#include <cstdint>             // uint64_t, int64_t
#include <memory>              // std::unique_ptr
#include <mutex>               // std::mutex
#include <string>              // std::string
#include <vector>              // std::vector

#include "embstore/admission.hpp"  // CountMinSketch
#include "embstore/arena.hpp"   // RowArena
#include "embstore/config.hpp"   // TableConfig
#include "embstore/metrics.hpp"  // TimerSet, Timer
#include "embstore/resolution.hpp"  // RowResolution
#include "embstore/shard.hpp"   // Shard, IndexView

namespace embstore {

enum class PoolMode : uint8_t { kSum = 0, kMean = 1 };

struct TableStats {
  size_t size = 0, capacity = 0, dim = 0, num_shards = 0, row_stride = 0;
  uint64_t hits = 0, misses = 0, inserts = 0, evictions = 0, erased = 0;
  uint64_t admitted = 0, rejected = 0;        // admission filter: inserts it let through,
                                        // occurrences of ids it kept out
  uint64_t lock_waits = 0, lock_wait_ns = 0;  // shard-lock acquisitions that blocked
  uint64_t reused_rows = 0;  // applied ids whose row came from the lookup before (no probe)
  uint64_t read_retries = 0;  // lock-free read tasks a writer got in the way of, redone row by row
  uint64_t arena_bytes_in_use = 0;  // rows ever claimed x row bytes
  double bytes_per_row = 0;  // arena + index, links and bitmaps per row of capacity
};

class Table;

// Rows taken out of a table (Table::evict_older_than, Table::drain_evicted): ids[i] with its
// `width` floats (weights, then optimizer state when asked for) at rows[i * width].
struct RemovedRows {
  std::vector<uint64_t> ids;
  std::vector<float> rows;
  size_t width = 0;
};

// Pre-images of rows a pending snapshot has not written yet, preserved by the writer that
// changes or removes them (see snapshot.hpp). Rows are kept in fixed chunks so a growing
// buffer never copies what it holds while a shard lock is held.
struct PreImages {
  static constexpr size_t kChunkRows = 256;
  std::vector<uint64_t> ids;
  std::vector<uint32_t> steps;
  std::vector<uint8_t> dirty;  // dirty when the snapshot began
  std::vector<std::unique_ptr<float[]>> chunks;
  size_t width = 0;  // floats per row (weights + optimizer state)
  size_t emitted = 0;  // pre-images [0, emitted) already copied out

  size_t size() const noexcept { return ids.size(); }
  void add(uint64_t id, uint32_t step, bool was_dirty, const float* row);
  const float* row(size_t k) const noexcept {
    return chunks[k / kChunkRows].get() + (k % kChunkRows) * width;
  }
  void clear() noexcept;  // frees the memory
};

// How import_rows treats rows: kRestore fills a fresh table from a checkpoint (never evicts:
// a row whose shard has no free row is skipped; rows are clean and count as checkpointed);
// kUpsert inserts or overwrites like an insert (CLOCK may evict; CapacityError when no row
// can be had; rows are dirty).
enum class ImportMode : uint8_t { kRestore = 0, kUpsert = 1 };

// One table's part of a pooled lookup: out[b] = sum (or mean) of rows of keys in bag b.
struct LookupSumRequest {
  Table* table;
  const uint64_t* keys;  // (n)
  size_t n;
  const int64_t* offsets;  // (num_bags + 1) CSR
  size_t num_bags;
  const float* weights;  // (n) or nullptr
  PoolMode mode;
  bool insert;
  float* out;  // (num_bags, dim) out
  std::string label;  // names the table in error messages (may be empty)
};

// One table's part of a gradient apply: per-id grads (offsets == nullptr, grads (n, dim)) or
// the backward of lookup_sum (grads (num_bags, dim)).
struct ApplyRequest {
  Table* table;
  const uint64_t* keys;  // (n)
  size_t n;
  const float* grads;  // (n, dim) or (num_bags, dim)
  const int64_t* offsets;  // (num_bags + 1) or nullptr
  size_t num_bags;
  const float* weights;  // (n) or nullptr
  PoolMode mode;
  std::string label;
};

// Runs the requests of several tables as one parallel batch (all tables in one crossing).
// `op` names the operation in the tables' latency histograms; a call over several tables
// records its whole duration (and each stage's) into every table it touches.
void lookup_sum_many(std::vector<LookupSumRequest>& requests, Timer op = Timer::kLookupSum);
void apply_gradients_many(std::vector<ApplyRequest>& requests, Timer op = Timer::kApplyGradients);

class Table {
 public:
  explicit Table(const TableConfig& config);
  ~Table();
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  size_t dim() const noexcept { return config_.dim; }
  size_t capacity() const noexcept { return config_.capacity; }
  size_t num_shards() const noexcept { return shards_.size(); }
  size_t num_threads() const noexcept { return config_.num_threads; }
  size_t size() const noexcept;
  const TableConfig& config() const noexcept { return config_; }
  // The learning rate (alpha for FTRL) used by later calls; a call reads it once.
  float lr() const noexcept { return lr_.load(std::memory_order_relaxed); }
  void set_lr(float lr);
  // The training step that lookups and updates record into their rows (Shard::last_step).
  // Until the first set_step every row records step 0 without writing it.
  uint32_t step() const noexcept { return step_.load(std::memory_order_relaxed); }
  void set_step(uint64_t step);
  size_t state_width() const noexcept;
  TableStats stats() const;
  // Latency histograms of operations and batch stages (see metrics.hpp).
  const TimerSet& timers() const noexcept { return timers_; }
  // The histogram to record into (allocated on first use; nullptr if that failed).
  LatencyHistogram* timer(Timer t) noexcept { return timers_.get(static_cast<size_t>(t)); }
  void reset_timers() noexcept { timers_.reset(); }

  // out[i] = row of keys[i]; see docs/semantics.md for insert=true/false.
  void lookup(const uint64_t* keys, size_t n, bool insert, float* out);  // out: (n, dim)
  void lookup_sum(const uint64_t* keys, size_t n, const int64_t* offsets, size_t num_bags,
                  const float* weights, PoolMode mode, bool insert, float* out);
  void apply_gradients(const uint64_t* keys, size_t n, const float* grads, const int64_t* offsets,
                       size_t num_bags, const float* weights, PoolMode mode);
  void contains(const uint64_t* keys, size_t n, bool* out);  // out: (n)
  size_t erase(const uint64_t* keys, size_t n);
  // The initializer's rows for keys (the table is not touched).
  void initial_values(const uint64_t* keys, size_t n, float* out) const;  // out: (n, dim)
  // Removes every row whose last step is < `step`, appending them to `out` (weights, and the
  // optimizer state too when `with_state`). Shard by shard, each under its lock.
  size_t evict_older_than(uint64_t step, bool with_state, RemovedRows& out);
  // Moves the rows CLOCK evicted since the last drain (config.stage_evicted) into `out`.
  size_t drain_evicted(RemovedRows& out);
  // Evicted rows waiting for drain_evicted (a lock-free hint: 0 means none).
  size_t evicted_pending() const noexcept { return staged_.load(std::memory_order_relaxed); }

  // Whether set_step has ever been called (rows record their last step only from then on).
  bool step_tracking() const noexcept { return track_steps_.load(std::memory_order_relaxed); }
  // Floats per row in checkpoints and imports: the weights, then the optimizer state.
  size_t row_width() const noexcept { return config_.dim + state_width(); }
  // Inserts or overwrites rows: ids[i] gets rows[i * row_width(), +row_width()) and last step
  // steps[i] (nullptr: the current step when step tracking is on, else 0). With kRestore,
  // placed[i] (when given) says whether row i was stored; returns the rows stored. The rows
  // of one shard are stored under its lock, in order (a repeated id: the last one wins).
  size_t import_rows(const uint64_t* ids, size_t n, const float* rows, const uint32_t* steps,
                     ImportMode mode, uint8_t* placed);
  // The admission sketch counters of shard s (empty without admission), and their restore
  // (false, and nothing changes, when the sizes differ).
  std::vector<uint16_t> sketch_counters(size_t s);
  bool restore_sketch(size_t s, const uint16_t* counters, size_t count);
  // The id of the checkpoint this table's rows were last saved to or loaded from ("" when
  // none): the parent of its next delta (checkpoint.hpp). Set by Snapshot::commit and by a
  // load; defined in snapshot.cpp.
  std::string checkpoint_id() const;
  void set_checkpoint_id(const std::string& id);
  // Records a duration into one of the table's latency histograms.
  void record_latency(Timer t, uint64_t ns) noexcept {
    if (!metrics_enabled()) return;
    if (LatencyHistogram* h = timer(t)) h->record(ns);
  }

 private:
  friend void lookup_sum_many(std::vector<LookupSumRequest>& requests, Timer op);
  friend void apply_gradients_many(std::vector<ApplyRequest>& requests, Timer op);
  friend struct BatchRunner;
  friend struct ForkGuard;
  friend class Snapshot;
  // Tests only (tests/cpp): reaches a shard to play a writer caught mid-change.
  friend struct TableTestAccess;

  // Under shard `sh`'s lock, once per critical section that may change rows: joins a
  // snapshot that began since the shard last joined one. Returns whether writes to the shard
  // must first preserve() the rows they change (one predictable branch per row write).
  bool snapshot_join(Shard& sh) noexcept {
    const uint64_t gen = snapshot_gen_.load(std::memory_order_acquire);
    if (gen != sh.snapshot_gen()) {
      sh.open_snapshot(gen, snapshot_bookkeeping_.load(std::memory_order_relaxed));
    }
    return sh.snapshot_pending();
  }
  // Preserves the pre-image of `row` of shard s (whose lock the caller holds, and whose
  // snapshot is pending) unless the snapshot has it already or does not include it. Out of
  // line, so the batch kernels' loops pay only the branch that guards the call.
  __attribute__((noinline)) void preserve(size_t s, uint32_t row);
  // A lookup of a present row records the current step (and marks the row dirty when that
  // changes its last step); `cow` is snapshot_join's answer. Out of line: the lookup loop
  // keeps its registers (only tables that use steps call it).
  __attribute__((noinline)) void touch_step(size_t s, uint32_t row, uint32_t step, bool cow);
  // Leaves snapshot `gen` in shard s (lock held) without writing it: drops its pre-images.
  void abandon_snapshot_locked(size_t s, uint64_t gen);
  // fork() child: forgets a snapshot a thread of the parent was writing.
  void reset_snapshot_after_fork();

  // The hash's top log2(num_shards) bits; branch-free (two shifts: one shard's shift of 64
  // would be undefined as one shift, and the read kernel computes this for every id).
  size_t shard_of(uint64_t hash) const noexcept {
    return static_cast<size_t>((hash >> 1) >> (shard_shift_ - 1));
  }
  float* row_ptr(const Shard& s, uint32_t local_row) noexcept {
    return arena_.row(static_cast<size_t>(s.first_row()) + local_row);
  }
  // Inserts the absent `id` into shard `shard_index` (whose lock the caller holds) with its
  // initial row and state. Returns the shard-local row, or kNoRow when no row can be had,
  // or kRetry when taking one would sweep more than `max_sweep` rows (then the sweep has
  // moved the CLOCK hand and cleared the bits it passed, as any sweep does; nothing else).
  uint32_t insert_locked(size_t shard_index, uint64_t id, uint64_t hash, uint32_t step,
                         uint64_t& evictions, uint64_t max_sweep = Shard::kUnlimitedSweep);
  uint32_t claim_row_locked(size_t shard_index, uint64_t& evictions,
                            uint64_t max_sweep = Shard::kUnlimitedSweep);
  bool try_borrow() noexcept;
  void give_back(size_t rows) noexcept { pool_.fetch_add(rows, std::memory_order_relaxed); }
  std::string no_row_message(uint64_t id, size_t shard_index) const;
  // Keeps `r`, whose places resolve `keys[0, n)`, as the last lookup's resolution (swapped
  // in: `r` gets the previous buffers, so nothing is allocated once warm). The replaced
  // resolution's pending reference bits are set first.
  void keep_resolution(const uint64_t* keys, size_t n, RowResolution& r);
  // Takes the kept resolution into `r` if it resolved exactly `keys[0, n)`; returns whether
  // it did. A taken resolution is used once; one of other keys stays kept. The taker owes
  // its pending reference bits (RowResolution::refs_pending).
  bool take_resolution(const uint64_t* keys, size_t n, RowResolution& r);
  // Sets the reference bits the kept resolution still owes. Called before every CLOCK sweep,
  // so a sweep sees the bits of every lookup before it (one atomic load when none are owed).
  void settle_references();
  // Sets the reference bits `r` still owes (RowResolution::refs_pending), if any.
  void pay_references(RowResolution& r) noexcept;

  TableConfig config_;
  unsigned shard_shift_;  // 64 - log2(num_shards); 64 means one shard
  RowArena arena_;
  LargeBuffer shard_index_;  // every shard's index and row links (outlives shards_)
  std::vector<std::unique_ptr<Shard>> shards_;
  // Per shard, what the lock-free read kernel needs, packed: its index, its first arena row
  // and its CLOCK reference bits (fixed at construction, like the memory they point into).
  struct ShardView {
    IndexView index;
    float* rows;
    uint64_t* reference_words;
  };
  std::vector<ShardView> views_;
  // Rows of capacity not in any shard's quota, lent to shards that grow beyond theirs.
  // sum(quota) + pool_ + rows lent == capacity, so len(table) <= capacity always.
  std::atomic<size_t> pool_{0};
  std::atomic<float> lr_;
  std::atomic<uint32_t> step_{0};
  std::atomic<bool> track_steps_{false};  // set by the first set_step
  // Per shard, guarded by that shard's lock: its admission sketch (empty when admission is
  // off) and the rows CLOCK evicted while config_.stage_evicted.
  std::vector<CountMinSketch> sketches_;
  std::vector<RemovedRows> staged_rows_;
  std::atomic<size_t> staged_{0};
  // Hits and misses of lock-free reads, added once per read task (the locked paths count
  // per shard).
  alignas(64) std::atomic<uint64_t> read_hits_{0};
  std::atomic<uint64_t> read_misses_{0};
  std::atomic<uint64_t> read_retries_{0};
  alignas(64) TimerSet timers_;
  // Checkpoints (snapshot.hpp). snapshot_gen_ counts snapshots begun; it changes only while
  // snapshot_busy_ is held (one snapshot at a time), and writers read it under a shard lock.
  std::atomic<uint64_t> snapshot_gen_{0};
  std::atomic<bool> snapshot_bookkeeping_{false};
  std::mutex snapshot_mutex_;  // guards snapshot_busy_ and active_gen_
  std::condition_variable snapshot_cv_;
  bool snapshot_busy_ = false;
  uint64_t active_gen_ = 0;  // the running snapshot's generation, 0 when none
  std::vector<PreImages> preimages_;  // per shard, guarded by its lock
  mutable std::mutex checkpoint_id_mutex_;  // taken inside snapshot_mutex_, never around it
  std::string checkpoint_id_;
  // The last training lookup's resolution (resolution.hpp), handed over by swapping buffers
  // (no allocation once warm); the mutex is taken once per call, never per id.
  std::mutex resolution_mutex_;
  RowResolution resolution_;
  std::atomic<bool> references_owed_{false};  // resolution_.refs_pending, readable unlocked
};

}  // namespace embstore
