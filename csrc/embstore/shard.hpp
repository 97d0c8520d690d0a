// File: embstore/shard.hpp
//
// Shard: one lock-protected slice of a table. It owns a fixed range of the table's arena
// rows, an open-addressing index (linear probing) from id to row, the CLOCK ring over its
// rows, a free list of erased rows, and its counters.
//
// Thread safety: every method except the counter readers, the `*_optimistic` readers and the
// reference-bit / last-step accessors requires the caller to hold `mutex()`. The table takes
// each shard's lock once per batch for writes. Row pointers obtained under the lock are valid
// only while it is held (the row may be evicted and reused after).
//
// Optimistic reads (a seqlock): every change of the index, the rows or their weights happens
// inside a WriteScope, which makes the shard's version odd for its duration. A lock-free
// reader notes an even version, probes the index and copies the row, then checks that the
// version did not move; if it did (or was odd), it retries (the table's read kernel: row by
// row, then under the lock). So lookups take no lock at all unless they race with a writer
// of the same shard, or must insert.
//
// Layout choices:
//  - Slot = {id, row + 1} packed in 12 bytes; row + 1 == 0 marks an empty slot, so every
//    uint64 id is usable and a calloc'ed index needs no initialisation pass. The top bit of
//    row + 1 is the slot's read mark (kReadMark): a lookup that does not insert marks its
//    rows there, in the line its probe has just read, rather than in the reference bitmap
//    (one more cache line per id; see docs/tuning.md); the CLOCK hand honours the mark like
//    a reference bit (clock_victim).
//  - The id lives only in the index slot. Each row keeps one word, its link: an occupied
//    row's slot position (the backward-shift deletion updates it when it moves a slot), a
//    free row's next free row. Row-order walks (CLOCK, eviction, checkpoints) reach the id
//    through it; 4 bytes a row instead of a copy of the id (see docs/tuning.md).
//  - Per-row bits (CLOCK reference, occupied, dirty, pinned) live in bitmaps of their own
//    (1 bit per row: 2 KiB for a 16K-row shard, cache-resident), so a lookup hit touches
//    only its index slot and its row (a reference bit beside the link would cost one more
//    cache miss per id).
//  - A pinned row is one an apply batch holding the lock is updating: its inserts must not
//    evict it (the pin is set only when the batch has ids to insert).
//  - A row's last step is the table step (Table::set_step) at which it was last looked up or
//    updated; it is written only once a step has been set, so tables that never use steps
//    pay no extra cache miss per id. It is written only under the shard lock (tables that
//    track steps read on the locked path); `touch`/`last_step` use relaxed atomics anyway.
//    Steps live in an array of their own, apart from the links: a write that would not change
//    a step is skipped, so a table that never sets one never makes those pages resident
//    (4 bytes a row less).
//
// Checkpoint state (driven by Table and Snapshot, see snapshot.hpp): which snapshot the shard
// has joined, whether that snapshot still has to write it (`snapshot_pending`: writers then
// preserve a row's pre-image before changing it), a cursor over the rows written so far, and
// per-row bits: `captured` (pre-image preserved), `born_after` (linked after the snapshot
// began: not part of it), `saved` (the id is in the last checkpoint, so its removal goes to
// the removed-ids log of the next delta) and `dirty_pending` (dirty bits a checkpoint still
// being written has taken; restored if it fails).
#pragma once

#include <atomic>   // std::atomic
#include <chrono>   // std::chrono::steady_clock
#include <cstddef>  // size_t
#include <cstdint>  // uint64_t, uint32_t
#include <mutex>    // std::mutex
#include <vector>   // std::vector

#include "embstore/arena.hpp"  // ZeroedBuffer, BufferSlice, LargeBuffer
#include "embstore/hash.hpp"   // fast_range32

namespace embstore {

constexpr uint32_t kNoRow = 0xFFFFFFFFu;
constexpr uint32_t kRetry = 0xFFFFFFFEu;  // an optimistic probe must be redone under the lock
// Slot::row_plus1 is (row + 1) | kReadMark when a lookup that does not insert read the row
// since the CLOCK hand last looked at its slot; so a shard holds at most kMaxShardRows rows.
constexpr uint32_t kReadMark = 0x80000000u;
constexpr uint32_t kRowPlus1Bits = kReadMark - 1;
constexpr uint32_t kMaxShardRows = kRowPlus1Bits - 1;

// Optimistic readers race with writers by design (the seqlock validates what they read);
// ThreadSanitizer must not instrument those reads (nor see them as memcpy calls, which it
// intercepts: GCC turns copy loops into memcpy unless told not to).
#if defined(__SANITIZE_THREAD__)
#define EMBSTORE_NO_SANITIZE_THREAD \
  __attribute__((no_sanitize("thread"), optimize("no-tree-loop-distribute-patterns")))
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EMBSTORE_NO_SANITIZE_THREAD __attribute__((no_sanitize("thread")))
#endif
#endif
#ifndef EMBSTORE_NO_SANITIZE_THREAD
#define EMBSTORE_NO_SANITIZE_THREAD
#endif

#pragma pack(push, 4)
struct Slot {
  uint64_t id;
  uint32_t row_plus1;  // 0: empty; else (row + 1), with kReadMark when read-marked

  // row_plus1 is read and written with relaxed atomics (plain moves on x86): lock-free
  // lookups mark it with a compare-and-swap while writers hold the shard lock.
  uint32_t load_row_plus1() const noexcept { return __atomic_load_n(&row_plus1, __ATOMIC_RELAXED); }
  void store_row_plus1(uint32_t v) noexcept { __atomic_store_n(&row_plus1, v, __ATOMIC_RELAXED); }
  bool empty() const noexcept { return load_row_plus1() == 0; }
  uint32_t row() const noexcept { return row_of(load_row_plus1()); }
  // The row of a non-empty row_plus1 value, read mark or not.
  static uint32_t row_of(uint32_t rp1) noexcept { return (rp1 & kRowPlus1Bits) - 1; }
  // Read-marks a slot last seen holding `seen` (non-zero). A compare-and-swap: if a writer
  // changed the slot since, the mark is dropped (lost in a race, never put on an empty slot).
  void mark(uint32_t seen) noexcept {
    if ((seen & kReadMark) != 0) return;
    __atomic_compare_exchange_n(&row_plus1, &seen, seen | kReadMark, false, __ATOMIC_RELAXED,
                                __ATOMIC_RELAXED);
  }
  // Clears the read mark (atomic: lock-free readers may mark the slot meanwhile).
  void clear_mark() noexcept { __atomic_fetch_and(&row_plus1, kRowPlus1Bits, __ATOMIC_RELAXED); }
};
#pragma pack(pop)
static_assert(sizeof(Slot) == 12, "Slot is packed to 12 bytes");

// Counters are written only under the shard lock and read without it, hence relaxed atomics
// updated with load+store (no locked instruction on the hot path).
struct ShardCounters {
  std::atomic<uint64_t> hits{0}, misses{0}, inserts{0}, evictions{0}, erased{0};
  std::atomic<uint64_t> admitted{0}, rejected{0};  // admission filter decisions
  std::atomic<uint64_t> reused{0};  // applied ids whose row a lookup's resolution gave
  std::atomic<uint64_t> lock_waits{0}, lock_wait_ns{0};  // acquisitions that had to block
  std::atomic<uint32_t> claimed_rows{0};  // rows ever claimed (used_), readable without the lock
  std::atomic<uint32_t> size{0};

  static void add(std::atomic<uint64_t>& c, uint64_t d) noexcept {
    if (d != 0) c.store(c.load(std::memory_order_relaxed) + d, std::memory_order_relaxed);
  }
};

// One bit per row, updated with relaxed atomic operations: lock-free readers set bits while
// the CLOCK sweep (under the lock) clears them. A set bit is only read, never rewritten.
class AtomicBitmap {
 public:
  explicit AtomicBitmap(size_t bits) : words_((bits + 63) / 64) {}
  void set(uint32_t i) noexcept { set(words_.get(), i); }
  // Sets bit i of the bitmap whose words are `words` (see words()).
  static void set(uint64_t* words, uint32_t i) noexcept {
    uint64_t* w = words + i / 64;
    const uint64_t bit = uint64_t{1} << (i % 64);
    if (!(__atomic_load_n(w, __ATOMIC_RELAXED) & bit)) __atomic_fetch_or(w, bit, __ATOMIC_RELAXED);
  }
  uint64_t* words() noexcept { return words_.get(); }
  void clear(uint32_t i) noexcept {
    __atomic_fetch_and(words_.get() + i / 64, ~(uint64_t{1} << (i % 64)), __ATOMIC_RELAXED);
  }
  bool test(uint32_t i) const noexcept {
    return (__atomic_load_n(words_.get() + i / 64, __ATOMIC_RELAXED) >> (i % 64)) & 1;
  }
  void prefetch(uint32_t i) const noexcept { __builtin_prefetch(words_.get() + i / 64); }
  size_t bytes() const noexcept { return words_.size() * sizeof(uint64_t); }

 private:
  ZeroedBuffer<uint64_t> words_;
};

// One bit per row, zero-initialised; only touched under the shard lock.
class Bitmap {
 public:
  explicit Bitmap(size_t bits) : words_((bits + 63) / 64) {}
  void set(uint32_t i) noexcept { words_.get()[i / 64] |= uint64_t{1} << (i % 64); }
  void clear(uint32_t i) noexcept { words_.get()[i / 64] &= ~(uint64_t{1} << (i % 64)); }
  bool test(uint32_t i) const noexcept { return (words_.get()[i / 64] >> (i % 64)) & 1; }
  void prefetch(uint32_t i) const noexcept { __builtin_prefetch(words_.get() + i / 64); }
  size_t bytes() const noexcept { return words_.size() * sizeof(uint64_t); }
  size_t words() const noexcept { return words_.size(); }
  uint64_t* data() noexcept { return words_.get(); }
  const uint64_t* data() const noexcept { return words_.get(); }
  void clear_all() noexcept {
    for (size_t w = 0; w < words_.size(); ++w) words_.get()[w] = 0;
  }

 private:
  ZeroedBuffer<uint64_t> words_;
};

// What a probe of one shard's index reads: the Shard's own find and prefetch use it, and the
// table keeps a copy per shard in one array (Table::views_), so the lock-free read kernel
// reaches a slot without first loading the Shard object.
struct IndexView {
  Slot* slots;  // read-only but for the read marks lookups set
  uint32_t num_slots;
  uint32_t num_rows;

  uint32_t home(uint64_t hash) const noexcept { return fast_range32(hash, num_slots); }
  uint32_t next(uint32_t pos) const noexcept { return pos + 1 == num_slots ? 0 : pos + 1; }
  // Prefetches the line of the index slot where a probe for `hash` starts, and the line
  // after it: at 1.5 slots per row, 26% of successful probes read past their home slot's
  // line (the home is in the line's last slots, or the id sits further on), and that line
  // was then a miss the probe waited for. (Past the slot array's end it is a harmless
  // prefetch of other memory.)
  void prefetch(uint64_t hash) const noexcept { prefetch_at(home(hash)); }
  void prefetch_at(uint32_t pos) const noexcept {
    const char* line = reinterpret_cast<const char*>(slots + pos);
    __builtin_prefetch(line);
    __builtin_prefetch(line + kCacheLine);
  }
  // The row of `id`, kNoRow when absent, or kRetry when the index looked inconsistent (it
  // may race with a writer: the caller validates the shard's version afterwards). With
  // kMark, a hit read-marks its slot (see kReadMark).
  template <bool kMark = false>
  uint32_t find_optimistic(uint64_t id, uint64_t hash) const noexcept {
    return find_optimistic_at<kMark>(id, home(hash));
  }
  // find_optimistic with the probe's start, home(hash), already known.
  template <bool kMark = false>
  EMBSTORE_NO_SANITIZE_THREAD uint32_t find_optimistic_at(uint64_t id,
                                                          uint32_t pos) const noexcept {
    bool wrapped = false;  // a probe racing writers could otherwise circle forever
    for (;;) {
      // The row is loaded once (a relaxed atomic: free on x86), so the bounds-checked value
      // is the one returned even if a writer changes the slot meanwhile; a torn id only
      // fails the seqlock check later.
      const uint32_t rp1 = slots[pos].load_row_plus1();
      if (rp1 == 0) return kNoRow;
      if (slots[pos].id == id) {
        const uint32_t row = Slot::row_of(rp1);
        if (row >= num_rows) return kRetry;
        if (kMark) slots[pos].mark(rp1);
        return row;
      }
      if (++pos == num_slots) {  // one compare per step: the wrap is also the bound
        if (wrapped) return kRetry;
        wrapped = true;
        pos = 0;
      }
    }
  }
};

class alignas(64) Shard {  // 64: a shard's lock and counters never share a cache line
 public:
  // `first_row`: this shard's first row in the table arena; `num_rows`: rows it may own;
  // `quota`: rows it may always hold (more only by borrowing from the table's pool).
  // `memory`: index_bytes(num_rows) zeroed, 64-byte aligned bytes for its index and row
  // links, and `steps`: num_rows zeroed uint32 for the rows' last steps; or nullptr for
  // both to allocate its own. A table carves all its shards' memory from one huge-page
  // mapping: per-shard allocations (a few hundred KiB each) get 4 KiB pages, and then nearly
  // every probe of a large table also missed the TLB. It puts all the steps after all the
  // indexes, so that untouched steps share no huge page with an index.
  Shard(uint32_t first_row, uint32_t num_rows, uint32_t quota, void* memory = nullptr,
        uint32_t* steps = nullptr);
  // Bytes of index and row links a shard of `num_rows` rows needs (a multiple of 64).
  static size_t index_bytes(uint32_t num_rows) noexcept;
  // Bytes of last steps a shard of `num_rows` rows needs (a multiple of 64).
  static size_t steps_bytes(uint32_t num_rows) noexcept;

  std::mutex& mutex() noexcept { return mutex_; }

  // Makes the version odd while a locked section changes the index or rows (see above).
  class WriteScope {
   public:
    explicit WriteScope(Shard& sh) noexcept : sh_(sh) {
      const uint64_t v = sh_.version_.load(std::memory_order_relaxed);
      sh_.version_.store(v + 1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_release);
    }
    ~WriteScope() {
      sh_.version_.store(sh_.version_.load(std::memory_order_relaxed) + 1,
                         std::memory_order_release);
    }
    WriteScope(const WriteScope&) = delete;
    WriteScope& operator=(const WriteScope&) = delete;

   private:
    Shard& sh_;
  };
  // The version now; under the lock it is even and moves only in the caller's WriteScopes.
  uint64_t version_locked() const noexcept { return version_.load(std::memory_order_relaxed); }
  // Seqlock reader side: read_begin() before, read_valid(v) after the optimistic reads.
  uint64_t read_begin() const noexcept { return version_.load(std::memory_order_acquire); }
  bool read_valid(uint64_t v) const noexcept {
    std::atomic_thread_fence(std::memory_order_acquire);
    return (v & 1) == 0 && version_.load(std::memory_order_relaxed) == v;
  }
  // Lock-free probe (may race with a writer: the caller validates with read_valid). Returns
  // the row, kNoRow when absent, or kRetry when the index looked inconsistent.
  template <bool kMark = false>
  uint32_t find_optimistic(uint64_t id, uint64_t hash) noexcept {
    return index_view().find_optimistic<kMark>(id, hash);
  }
  // Takes the shard lock, counting (and timing) the acquisitions that have to wait: the
  // uncontended path is one try_lock and reads no clock.
  std::unique_lock<std::mutex> lock() {
    std::unique_lock<std::mutex> held(mutex_, std::try_to_lock);
    if (!held.owns_lock()) {
      const auto start = std::chrono::steady_clock::now();
      held.lock();
      const auto waited = std::chrono::steady_clock::now() - start;
      ShardCounters::add(counters.lock_waits, 1);
      ShardCounters::add(counters.lock_wait_ns,
                         static_cast<uint64_t>(
                             std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count()));
    }
    return held;
  }

  // Row (shard-local) of `id`, or kNoRow. `hash` is mix64(id).
  uint32_t find(uint64_t id, uint64_t hash) const noexcept {
    const Slot& s = slots_.get()[find_slot(id, hash)];
    return s.empty() ? kNoRow : s.row();
  }
  // find for a lookup that does not insert: a hit read-marks its slot (see kReadMark).
  uint32_t find_and_mark(uint64_t id, uint64_t hash) noexcept {
    Slot& s = slots_.get()[find_slot(id, hash)];
    const uint32_t rp1 = s.load_row_plus1();
    if (rp1 == 0) return kNoRow;
    s.mark(rp1);  // under the lock only marks change: a failed swap means it is marked
    return Slot::row_of(rp1);
  }
  // CLOCK reference bit of a row: set by its insert, training lookups and updates (lookups
  // that do not insert read-mark its slot instead).
  void reference(uint32_t row) noexcept { ref_bits_.set(row); }
  // The reference bits' words, for AtomicBitmap::set (they never move).
  uint64_t* reference_words() noexcept { return ref_bits_.words(); }
  bool referenced(uint32_t row) const noexcept { return ref_bits_.test(row); }
  // The row's last step (relaxed atomics: lock-free readers record it too).
  // Skips a write that changes nothing: see the file comment.
  void touch(uint32_t row, uint32_t step) noexcept {
    uint32_t* p = steps_.get() + row;
    if (__atomic_load_n(p, __ATOMIC_RELAXED) != step) __atomic_store_n(p, step, __ATOMIC_RELAXED);
  }
  uint32_t last_step(uint32_t row) const noexcept {
    return __atomic_load_n(steps_.get() + row, __ATOMIC_RELAXED);
  }
  // Whether the row holds an id (free and never-claimed rows do not).
  bool occupied(uint32_t row) const noexcept { return occupied_.test(row); }
  // Prefetches the word of the row's occupied bit (the apply checks it per id).
  void prefetch_occupied(uint32_t row) const noexcept { occupied_.prefetch(row); }
  // Dirty bit: the row changed since the last checkpoint (set on insert and update).
  void mark_dirty(uint32_t row) noexcept { dirty_.set(row); }
  bool dirty(uint32_t row) const noexcept { return dirty_.test(row); }
  void clear_dirty(uint32_t row) noexcept { dirty_.clear(row); }
  // Prefetches the words of the row's reference and dirty bits (an update sets both).
  void prefetch_update_bits(uint32_t row) const noexcept {
    ref_bits_.prefetch(row);
    dirty_.prefetch(row);
  }

  // ---- checkpoint snapshot state (see the file comment and snapshot.hpp) ----
  uint64_t snapshot_gen() const noexcept { return snap_gen_; }
  bool snapshot_pending() const noexcept { return snap_pending_; }
  // Joins snapshot `gen`: the shard's rows as they are now are that snapshot's; from here on
  // writers preserve pre-images. `bookkeeping`: a checkpoint (not an export), whose removals
  // are logged for the next delta.
  void open_snapshot(uint64_t gen, bool bookkeeping) noexcept {
    snap_gen_ = gen;
    snap_pending_ = true;
    snap_bookkeeping_ = bookkeeping;
    snap_cursor_ = 0;
    removed_mark_ = removed_.size();
  }
  // Leaves the joined snapshot: clears the per-snapshot bits.
  void close_snapshot() noexcept {
    snap_pending_ = false;
    snap_cursor_ = 0;
    captured_.clear_all();
    born_after_.clear_all();
  }
  // Rows [0, cursor) have been written by the pending snapshot.
  uint32_t snapshot_cursor() const noexcept { return snap_cursor_; }
  void set_snapshot_cursor(uint32_t c) noexcept { snap_cursor_ = c; }
  // Whether a write to `row` must first preserve its pre-image (the caller checked
  // snapshot_pending()).
  bool needs_preimage(uint32_t row) const noexcept {
    return row >= snap_cursor_ && occupied_.test(row) && !captured_.test(row) &&
           !born_after_.test(row);
  }
  void set_captured(uint32_t row) noexcept { captured_.set(row); }
  bool captured(uint32_t row) const noexcept { return captured_.test(row); }
  bool born_after(uint32_t row) const noexcept { return born_after_.test(row); }
  bool saved(uint32_t row) const noexcept { return saved_.test(row); }
  void set_saved(uint32_t row) noexcept { saved_.set(row); }
  // A checkpoint takes the row's dirty bit (restored by restore_dirty if it fails).
  void take_dirty(uint32_t row) noexcept {
    dirty_.clear(row);
    dirty_pending_.set(row);
  }
  // After a checkpoint is written: saved = occupied and not born after it.
  void mark_saved_rows() noexcept {
    uint64_t* sv = saved_.data();
    const uint64_t* occ = occupied_.data();
    const uint64_t* born = born_after_.data();
    for (size_t w = 0; w < saved_.words(); ++w) sv[w] = occ[w] & ~born[w];
  }
  // Commit (drop the taken dirty bits) or abort (give them back to occupied rows).
  void commit_dirty() noexcept { dirty_pending_.clear_all(); }
  void restore_dirty() noexcept {
    uint64_t* d = dirty_.data();
    uint64_t* p = dirty_pending_.data();
    const uint64_t* occ = occupied_.data();
    for (size_t w = 0; w < dirty_.words(); ++w) {
      d[w] |= p[w] & occ[w];
      p[w] = 0;
    }
  }
  // Ids removed since the last checkpoint that it holds (erase, CLOCK, evict_older_than);
  // [0, removed_mark()) were removed before the pending snapshot began.
  std::vector<uint64_t>& removed_log() noexcept { return removed_; }
  size_t removed_mark() const noexcept { return removed_mark_; }
  void set_removed_mark(size_t m) noexcept { removed_mark_ = m; }
  // Rows [0, claimed_rows()) have held an id at least once; the rest were never touched.
  uint32_t claimed_rows() const noexcept { return used_; }
  uint32_t num_rows() const noexcept { return num_rows_; }
  // Prefetches the index slot where a probe for `hash` starts.
  void prefetch(uint64_t hash) const noexcept { index_view().prefetch(hash); }
  // The index as lock-free probes read it (its memory never moves).
  IndexView index_view() noexcept { return IndexView{slots_.get(), num_slots_, num_rows_}; }
  // A view for probes that do not mark (read marks are an IndexView's only writes).
  IndexView index_view() const noexcept {
    return IndexView{const_cast<Slot*>(slots_.get()), num_slots_, num_rows_};
  }

  // Links `id` to the shard-local row `row` (which must be a row this shard just claimed),
  // recording `step` as its last step.
  void link(uint64_t id, uint64_t hash, uint32_t row, uint32_t step) noexcept;
  // Removes `id` from the index and frees its row to this shard's free list.
  // Returns the freed row or kNoRow if absent.
  uint32_t unlink_and_free(uint64_t id, uint64_t hash);

  // Row allocation, in the order docs/semantics.md gives: the free list, then never-used rows.
  bool has_unclaimed_row() const noexcept { return free_head_ != kNoRow || used_ < num_rows_; }
  uint32_t claim_unused_row() noexcept;  // requires has_unclaimed_row()

  // CLOCK: the next unpinned row whose reference bit is clear and whose slot is not
  // read-marked, clearing bits and marks on the way (a row's bit first, its mark the next
  // time the hand comes round); kNoRow when every occupied row is pinned (or none is
  // occupied). The victim stays linked; `evict` unlinks it. With `max_steps`, a sweep that
  // would pass more rows than that stops first (the hand stays where it got to) and returns
  // kRetry.
  uint32_t clock_victim(uint64_t max_steps = kUnlimitedSweep) noexcept;
  static constexpr uint64_t kUnlimitedSweep = ~uint64_t{0};
  // The row clock_victim would take next if no bit changed meanwhile and its slot is not
  // read-marked (the marks are not looked at: that would read a slot per row), looking at
  // most `limit` rows past the hand and changing nothing; kNoRow if none is found there.
  // Only a hint for prefetching.
  uint32_t likely_victim(uint32_t limit) const noexcept;
  // Rows the CLOCK hand has passed, ever. A call whose sweeps advance the hand by fewer rows
  // than the ring holds visits no row twice, so it evicts no row it referenced itself.
  uint64_t sweep_steps() const noexcept { return sweep_steps_; }
  // Unlinks the id held by `row` so the row can take a new id (no free-list push).
  void evict(uint32_t row);
  // Unlinks the id held by `row` and frees the row to the free list.
  void free_row(uint32_t row);

  // The id an occupied row holds, by value: Slot is packed, so a reference to its id
  // (push_back's argument, say) would be misaligned.
  uint64_t id_of(uint32_t row) const noexcept { return slots_.get()[links_.get()[row]].id; }
  // The rows' links (see the file comment), for lock-free readers that validate with the
  // seqlock: they must read the words themselves.
  const uint32_t* links() const noexcept { return links_.get(); }
  // Prefetches the row's link (id_of and the CLOCK read it).
  void prefetch_link(uint32_t row) const noexcept { __builtin_prefetch(links_.get() + row); }
  // Prefetches the index slot of an occupied row (one more load: its link).
  void prefetch_slot_of(uint32_t row) const noexcept {
    index_view().prefetch_at(links_.get()[row]);
  }
  // Pins: a row an apply batch updates is pinned while its inserts may evict (see above).
  void pin(uint32_t row) noexcept { pinned_.set(row); }
  void unpin(uint32_t row) noexcept { pinned_.clear(row); }
  bool pinned(uint32_t row) const noexcept { return pinned_.test(row); }
  uint32_t first_row() const noexcept { return first_row_; }
  uint32_t quota() const noexcept { return quota_; }
  uint32_t size() const noexcept { return counters.size.load(std::memory_order_relaxed); }
  // Rows ever claimed; safe to read without the lock (a relaxed copy of used_).
  uint32_t used_rows() const noexcept {
    return counters.claimed_rows.load(std::memory_order_relaxed);
  }
  // Bytes of index, links and bitmaps (the arena's rows are counted by the table).
  size_t footprint_bytes() const noexcept {
    return slots_.size() * sizeof(Slot) + links_.size() * sizeof(uint32_t) +
           steps_.size() * sizeof(uint32_t) + ref_bits_.bytes() + occupied_.bytes() +
           dirty_.bytes() + pinned_.bytes() + captured_.bytes() + born_after_.bytes() +
           saved_.bytes() + dirty_pending_.bytes();
  }

  ShardCounters counters;

 private:
  uint32_t home(uint64_t hash) const noexcept { return index_view().home(hash); }
  uint32_t next(uint32_t pos) const noexcept { return index_view().next(pos); }
  // The slot holding `id`, or the empty slot where it would go.
  uint32_t find_slot(uint64_t id, uint64_t hash) const noexcept {
    const Slot* slots = slots_.get();
    uint32_t pos = home(hash);
    // Terminates: there are always more slots than rows, so an empty slot exists.
    while (!slots[pos].empty() && slots[pos].id != id) pos = next(pos);
    return pos;
  }
  void unreference(uint32_t row) noexcept { ref_bits_.clear(row); }
  // CLOCK's rules, shared by clock_victim and likely_victim: the row after `row` in the ring
  // of claimed rows, and whether a row may be evicted at all (occupied and not pinned).
  uint32_t ring_next(uint32_t row) const noexcept { return row + 1 == used_ ? 0 : row + 1; }
  bool evictable(uint32_t row) const noexcept { return occupied(row) && !pinned_.test(row); }
  void erase_slot(uint32_t pos) noexcept;                          // backward-shift deletion
  void release_row(uint32_t row);  // after unlinking: clear bits, push free list
  // Logs the id of `row`, about to be removed, when a checkpoint (or the snapshot being
  // written) holds it.
  void note_removed(uint32_t row) {
    if (saved_.test(row) || (snap_pending_ && snap_bookkeeping_ && !born_after_.test(row))) {
      removed_.push_back(id_of(row));
    }
  }

  std::mutex mutex_;
  std::atomic<uint64_t> version_{0};  // odd while a WriteScope is open
  uint32_t first_row_;
  uint32_t num_rows_;
  uint32_t quota_;
  uint32_t num_slots_;
  uint32_t used_ = 0;  // rows [0, used_) have been claimed at least once: the CLOCK ring
  uint32_t hand_ = 0;
  uint64_t sweep_steps_ = 0;
  uint32_t free_head_ = kNoRow;
  LargeBuffer own_memory_;  // used only when the shard was given no memory
  BufferSlice<Slot> slots_;
  BufferSlice<uint32_t> links_;  // per row: its slot position, or the next free row
  BufferSlice<uint32_t> steps_;  // last step per row
  AtomicBitmap ref_bits_;
  Bitmap occupied_;
  Bitmap dirty_;
  Bitmap pinned_;
  // Checkpoint state.
  uint64_t snap_gen_ = 0;
  bool snap_pending_ = false;
  bool snap_bookkeeping_ = false;
  uint32_t snap_cursor_ = 0;
  Bitmap captured_;
  Bitmap born_after_;
  Bitmap saved_;
  Bitmap dirty_pending_;
  std::vector<uint64_t> removed_;
  size_t removed_mark_ = 0;
};

}  // namespace embstore
