// File: tests/cpp/test_arena_shard.cpp
//
// Unit tests: the output buffer pool, the arena, and the shard index (linear probing with
// backward-shift deletion, read marks).
#include "helpers.hpp"

#if defined(__linux__)
#include <sys/mman.h>  // mincore
#include <unistd.h>    // sysconf
#endif

#include <vector>  // std::vector

// =======================================================================================
// Arena
// =======================================================================================

TEST_CASE(buffer_pool_recycles_by_size_within_its_limit) {
  BufferPool pool(1 << 20);
  void* a = pool.acquire(100000);
  void* b = pool.acquire(100000);
  CHECK(a != b);
  CHECK(reinterpret_cast<uintptr_t>(a) % 64 == 0 && reinterpret_cast<uintptr_t>(b) % 64 == 0);
  std::memset(a, 1, 100000);  // the whole size is usable (ASan checks the bounds)
  pool.release(a);
  CHECK(pool.pooled_bytes() >= 100000 && pool.pooled_bytes() < 100000 + 4096);
  CHECK(pool.acquire(99000) == a);  // same 4 KiB size class: the released buffer
  CHECK(pool.pooled_bytes() == 0);
  void* c = pool.acquire(200000);  // another class: a new buffer
  CHECK(c != a && c != b);
  pool.release(a);
  pool.release(b);
  pool.release(c);
  CHECK(pool.pooled_bytes() <= pool.limit());
  void* big = pool.acquire(pool.limit() / 4 + 4096);  // over a quarter of the limit: not kept
  const size_t before = pool.pooled_bytes();
  pool.release(big);
  CHECK(pool.pooled_bytes() == before);
  pool.set_limit(0);  // frees every released buffer
  CHECK(pool.pooled_bytes() == 0);
  pool.release(pool.acquire(0));  // empty results work too
  pool.release(nullptr);
}

TEST_CASE(resolution_gives_back_a_large_batchs_buffers) {
  RowResolution r;
  const size_t big = 4 * RowResolution::kShrinkAbove, small = 1000;
  r.keys.resize(big);
  r.places.resize(big);
  r.order.resize(big);
  r.planned = true;
  r.shrink_if_oversized();  // sized to fit: kept
  CHECK(r.keys.capacity() >= big && r.places.capacity() >= big && r.order.capacity() >= big);
  r.keys.resize(small);
  r.places.resize(small);
  r.planned = false;  // a lock-free lookup's: the stale plan goes too
  r.shrink_if_oversized();
  CHECK(r.keys.size() == small && r.keys.capacity() < 2 * small);
  CHECK(r.places.size() == small && r.places.capacity() < 2 * small);
  CHECK(r.order.empty() && r.order.capacity() < 2 * small);
  r.keys.resize(RowResolution::kShrinkAbove / 4);  // small buffers are left alone
  r.keys.reserve(RowResolution::kShrinkAbove);
  r.shrink_if_oversized();
  CHECK(r.keys.capacity() >= RowResolution::kShrinkAbove);
}

TEST_CASE(buffer_pool_from_many_threads) {
  BufferPool pool(8 << 20);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int k = 0; k < 2000; ++k) {
        const size_t bytes = 4096 * static_cast<size_t>(1 + (k + w) % 7);
        auto* p = static_cast<unsigned char*>(pool.acquire(bytes));
        std::memset(p, w, bytes);  // a buffer is never handed to two holders at once
        if (p[0] != w || p[bytes - 1] != w) bad.fetch_add(1);
        pool.release(p);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(bad.load() == 0);
  CHECK(pool.pooled_bytes() <= pool.limit());
}

#if defined(__linux__)
// Pages of [p, p + bytes) resident in RAM (p page-aligned).
static size_t resident_pages(const void* p, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((bytes + page - 1) / page);
  CHECK(mincore(const_cast<void*>(p), bytes, in.data()) == 0);
  size_t n = 0;
  for (const unsigned char v : in) n += v & 1;
  return n;
}

// From 16 KiB up a buffer is mapped, zero-filled on first touch: what a table never writes
// (a small table's last steps, a shard's slack) takes no RAM.
TEST_CASE(large_buffers_are_resident_only_where_touched) {
  // 16 KiB as a literal: a higher kMapThreshold must fail this test.
  for (const size_t bytes : {size_t{16} << 10, size_t{1} << 20}) {
    LargeBuffer b(bytes);
    CHECK(reinterpret_cast<uintptr_t>(b.data()) % 4096 == 0);
    // 4 KiB faults whatever the machine's transparent huge page policy, so one write makes
    // one page resident (a huge page could also span a merged neighbouring mapping).
    CHECK(madvise(b.data(), bytes, MADV_NOHUGEPAGE) == 0);
    CHECK(resident_pages(b.data(), bytes) == 0);
    static_cast<char*>(b.data())[bytes - 1] = 1;
    CHECK(resident_pages(b.data(), bytes) == 1);
    CHECK(static_cast<const char*>(b.data())[0] == 0);  // read, not written: still zero
  }
}
#endif

TEST_CASE(arena_alignment_and_stride) {
  CHECK(row_stride(1, 0) == 4);
  CHECK(row_stride(4, 0) == 4);
  CHECK(row_stride(5, 0) == 8);
  CHECK(row_stride(3, 3) == 8);
  CHECK(row_stride(6, 6) == 12);
  CHECK(row_stride(16, 16) == 32);
  for (size_t dim = 1; dim < 40; ++dim) {
    CHECK(row_stride(dim, 0) % 4 == 0 && row_stride(dim, 0) >= dim && row_stride(dim, 0) < dim + 4);
    CHECK(row_stride(dim, dim) % 4 == 0 && row_stride(dim, dim) >= 2 * dim);
  }
  for (size_t stride : {4, 8, 12, 20, 36, 132}) {
    for (size_t rows : {0, 1, 3, 17, 100}) {
      RowArena a(rows, stride);
      CHECK(a.rows() == rows);
      CHECK(a.stride() == stride);
      CHECK(reinterpret_cast<uintptr_t>(a.row(0)) % kCacheLine == 0);
      CHECK(kCacheLine == 64);
      for (size_t r = 0; r < rows; ++r) {
        CHECK(a.row(r) == a.row(0) + r * stride);
        CHECK(reinterpret_cast<uintptr_t>(a.row(r)) % 16 == 0);  // stride is a multiple of 4
        for (size_t k = 0; k < stride; ++k) a.row(r)[k] = static_cast<float>(r * 1000 + k);
      }
      const RowArena& ca = a;
      for (size_t r = 0; r < rows; ++r) {
        for (size_t k = 0; k < stride; ++k) CHECK(ca.row(r)[k] == static_cast<float>(r * 1000 + k));
      }
    }
  }
  RowArena moved(1, 4);
  moved = RowArena(9, 8);
  CHECK(moved.rows() == 9 && moved.stride() == 8);
  CHECK(reinterpret_cast<uintptr_t>(moved.row(0)) % 64 == 0);
  moved.row(8)[7] = 1.0f;  // last float: in bounds (ASan)

  // Large blocks (several MiB: the allocator may map them differently) keep the same rules.
  for (size_t rows : {size_t{1} << 17, (size_t{1} << 18) + 3}) {
    RowArena big(rows, 20);
    CHECK(reinterpret_cast<uintptr_t>(big.row(0)) % 64 == 0);
    CHECK(big.row(rows - 1) == big.row(0) + (rows - 1) * 20);
    big.row(0)[0] = 1.0f;
    big.row(rows - 1)[19] = 2.0f;  // the last float of the block
    CHECK(big.row(0)[0] == 1.0f && big.row(rows - 1)[19] == 2.0f);
  }
  ZeroedBuffer<Slot> big_index(size_t{1} << 20);  // 12 MiB, all-zero = every slot empty
  for (size_t i = 0; i < big_index.size(); i += 4093) CHECK(big_index.get()[i].row_plus1 == 0);
  CHECK(big_index.get()[big_index.size() - 1].id == 0);
  big_index.get()[big_index.size() - 1].id = 5;
  ZeroedBuffer<Slot> slots(100);
  CHECK(slots.size() == 100);
  for (size_t i = 0; i < 100; ++i) CHECK(slots.get()[i].id == 0 && slots.get()[i].row_plus1 == 0);
  ZeroedBuffer<uint32_t> empty(0);
  CHECK(empty.size() == 0 && empty.get() != nullptr);

  // The table's rows use the arena stride: dim weights + optimizer state, rounded up to 4.
  CHECK(Table(config(6, 8, 1, Eviction::kClock, sgd(0.1f))).stats().row_stride == 8);
  CHECK(Table(config(6, 8, 1, Eviction::kClock, adagrad(0.1f))).stats().row_stride == 12);
  CHECK(Table(config(1, 8, 1, Eviction::kClock, sgd(0.1f))).stats().row_stride == 4);
  CHECK(Table(config(2, 8, 1, Eviction::kClock, adagrad(0.1f))).stats().row_stride == 4);
  CHECK(Table(config(64, 8, 1, Eviction::kClock, adagrad(0.1f))).stats().row_stride == 128);
}

// =======================================================================================
// Shard
// =======================================================================================

TEST_CASE(shard_link_find_unlink) {
  Shard sh(100, 8, 8);
  std::lock_guard<std::mutex> lock(sh.mutex());
  CHECK(sh.first_row() == 100);
  CHECK(sh.used_rows() == 0);
  CHECK(sh.has_unclaimed_row());
  const Ids ids = {0, kMaxId, 1, 2, 0x8000000000000000ULL, 12345, kMaxId - 1, 42};
  for (uint32_t i = 0; i < ids.size(); ++i) {
    CHECK(sh.find(ids[i], mix64(ids[i])) == kNoRow);
    const uint32_t row = sh.claim_unused_row();
    CHECK(row == i);  // never-used rows in order
    sh.link(ids[i], mix64(ids[i]), row, 0);
    CHECK(sh.id_of(row) == ids[i]);
    CHECK(!sh.pinned(row));
    CHECK(sh.occupied(row));
    CHECK(sh.dirty(row));  // new rows are dirty until a checkpoint
    CHECK(sh.last_step(row) == 0);
    CHECK(sh.referenced(row));  // set on insert
    CHECK(sh.counters.size.load() == i + 1);
  }
  CHECK(!sh.has_unclaimed_row());
  CHECK(sh.used_rows() == 8);
  for (uint32_t i = 0; i < ids.size(); ++i) CHECK(sh.find(ids[i], mix64(ids[i])) == i);

  CHECK(sh.unlink_and_free(ids[3], mix64(ids[3])) == 3);
  CHECK(sh.find(ids[3], mix64(ids[3])) == kNoRow);
  CHECK(!sh.occupied(3));
  CHECK(!sh.dirty(3));
  CHECK(sh.unlink_and_free(ids[3], mix64(ids[3])) == kNoRow);  // already gone
  CHECK(sh.unlink_and_free(999, mix64(999)) == kNoRow);  // never there
  CHECK(sh.counters.size.load() == 7);
  sh.touch(5, 9);  // a step on a row that is then freed and reused ...
  CHECK(sh.last_step(5) == 9);
  CHECK(sh.unlink_and_free(ids[5], mix64(ids[5])) == 5);
  for (uint32_t i = 0; i < ids.size(); ++i) {
    if (i != 3 && i != 5) CHECK(sh.find(ids[i], mix64(ids[i])) == i);
  }
  // Free list: most recently freed first.
  CHECK(sh.has_unclaimed_row());
  CHECK(sh.claim_unused_row() == 5);
  CHECK(sh.claim_unused_row() == 3);
  CHECK(!sh.has_unclaimed_row());
  sh.link(77, mix64(77), 5, 0);
  sh.link(78, mix64(78), 3, 0);
  CHECK(sh.last_step(5) == 0 && sh.last_step(3) == 0);  // ... gets its new id's step
  CHECK(sh.find(77, mix64(77)) == 5);
  CHECK(sh.find(78, mix64(78)) == 3);
  CHECK(sh.counters.size.load() == 8);
  CHECK(sh.footprint_bytes() >= 8 * sizeof(uint32_t) + 8 * sizeof(Slot));
}

// Many ids forced into one probe run that wraps around the end of the index; random
// link/unlink (backward-shift deletion) against a model: every other id stays findable.
TEST_CASE(shard_backward_shift_keeps_colliding_ids_findable) {
  for (uint32_t rows : {1u, 2u, 3u, 5u, 16u, 62u}) {
    // Slots per row are an implementation detail; the "low"/"high" ids collide (home 0 /
    // home last) for any index of <= 256 slots, which covers every size used here.
    const size_t per_kind = rows;
    Ids pool = colliding_ids(per_kind, false, 1);
    const Ids high = colliding_ids(per_kind, true, 1);
    pool.insert(pool.end(), high.begin(), high.end());
    pool.push_back(0);
    pool.push_back(kMaxId);
    pool.push_back(kMaxId - 1);
    for (uint64_t id : pool) {  // sanity: the claimed homes
      const uint32_t lo32 = static_cast<uint32_t>(mix64(id));
      CHECK(fast_range32(mix64(id), 256) == 0 || fast_range32(mix64(id), 256) == 255 || id == 0 ||
            id >= kMaxId - 1);
      (void)lo32;
    }
    std::mt19937_64 rng(rows * 7919 + 1);
    Shard sh(0, rows, rows);
    std::lock_guard<std::mutex> lock(sh.mutex());
    std::map<uint64_t, uint32_t> model;
    auto verify = [&](const char* when) {
      for (uint64_t id : pool) {
        auto it = model.find(id);
        const uint32_t got = sh.find(id, mix64(id));
        CHECK_MSG(
            got == (it == model.end() ? kNoRow : it->second),
            std::string(when) + ": rows=" + std::to_string(rows) + " id=" + std::to_string(id));
      }
      CHECK(sh.counters.size.load() == model.size());
      // Each row's link follows its id's slot as deletions shift slots back.
      for (const auto& kv : model) CHECK(sh.id_of(kv.second) == kv.first);
    };
    // Fill with alternating high/low ids: one long run across the wrap-around point.
    for (size_t k = 0; k < per_kind && sh.has_unclaimed_row(); ++k) {
      for (uint64_t id : {high[k], pool[k]}) {
        if (!sh.has_unclaimed_row()) break;
        const uint32_t row = sh.claim_unused_row();
        sh.link(id, mix64(id), row, 0);
        model[id] = row;
      }
    }
    verify("fill");
    for (int step = 0; step < 3000; ++step) {
      const uint64_t id = pool[rng() % pool.size()];
      if (model.count(id)) {
        if (step % 2 == 0) {
          const uint32_t row = sh.unlink_and_free(id, mix64(id));
          CHECK(row == model[id]);
        } else {
          sh.free_row(model[id]);  // by row: through its link
        }
        model.erase(id);
        verify("after unlink");
      } else if (sh.has_unclaimed_row()) {
        const uint32_t row = sh.claim_unused_row();
        CHECK(row < rows);
        for (const auto& kv : model) CHECK(kv.second != row);  // a free row, not a live one
        sh.link(id, mix64(id), row, 0);
        model[id] = row;
        verify("after link");
      }
    }
    // Unlink everything in a random order, then the index must be empty.
    Ids live;
    for (const auto& kv : model) live.push_back(kv.first);
    std::shuffle(live.begin(), live.end(), rng);
    for (uint64_t id : live) {
      CHECK(sh.unlink_and_free(id, mix64(id)) == model[id]);
      model.erase(id);
      verify("drain");
    }
  }
}

TEST_CASE(shard_clock_victim_and_pins) {
  Shard sh(0, 4, 4);
  std::lock_guard<std::mutex> lock(sh.mutex());
  CHECK(sh.clock_victim() == kNoRow);  // nothing occupied
  const Ids ids = {10, 20, 30, 40};
  for (uint64_t id : ids) sh.link(id, mix64(id), sh.claim_unused_row(), 0);
  // Every bit is set on insert: one sweep clears them all, then row 0 is the victim.
  CHECK(sh.clock_victim() == 0);
  for (uint32_t r = 0; r < 4; ++r) CHECK(!sh.referenced(r));
  CHECK(sh.find(10, mix64(10)) == 0);  // the victim stays linked until evict()
  sh.evict(0);
  CHECK(sh.find(10, mix64(10)) == kNoRow);
  CHECK(!sh.occupied(0));
  CHECK(sh.counters.size.load() == 3);
  for (uint64_t id : {20, 30, 40}) CHECK(sh.find(id, mix64(id)) != kNoRow);
  sh.link(50, mix64(50), 0, 0);
  CHECK(sh.clock_victim() == 1);  // the hand moved past row 0; row 1's bit is clear
  // A pinned row is skipped and keeps its reference bit.
  sh.reference(2);
  sh.pin(2);
  CHECK(sh.clock_victim() == 3);
  CHECK(sh.referenced(2));
  // Every row pinned: no victim.
  for (uint32_t r = 0; r < 4; ++r) sh.pin(r);
  CHECK(sh.clock_victim() == kNoRow);
  for (uint32_t r = 0; r < 4; ++r) sh.unpin(r);
  // A freed row is not a victim.
  CHECK(sh.unlink_and_free(20, mix64(20)) == 1);
  for (int k = 0; k < 10; ++k) CHECK(sh.clock_victim() != 1);
}

TEST_CASE(shard_read_marks_move_with_their_ids_and_give_one_chance) {
  Shard sh(0, 3, 3);
  std::lock_guard<std::mutex> lock(sh.mutex());
  const Ids ids = colliding_ids(4, false, 1);  // one probe run from slot 0
  for (size_t k = 0; k < 3; ++k) sh.link(ids[k], mix64(ids[k]), sh.claim_unused_row(), 0);
  CHECK(sh.find_and_mark(ids[2], mix64(ids[2])) == 2);
  CHECK(sh.find_and_mark(99, mix64(99)) == kNoRow);  // a miss marks nothing
  // Unlinking ids[0] shifts ids[1] and ids[2] back one slot: the mark must move along.
  CHECK(sh.unlink_and_free(ids[0], mix64(ids[0])) == 0);
  sh.link(ids[3], mix64(ids[3]), sh.claim_unused_row(), 0);  // takes row 0 again
  CHECK(sh.find(ids[2], mix64(ids[2])) == 2);
  CHECK(sh.clock_victim() == 0);  // clears every bit on the way; the hand is at 1
  sh.reference(1);
  CHECK(sh.clock_victim() == 0);  // 1: bit cleared; 2: mark cleared; 0: the victim
  sh.reference(1);
  CHECK(sh.clock_victim() == 2);  // 1: bit cleared; 2: nothing left
}

// A lock-free probe that marks, validated like the read kernel's (it races the writer by
// design, so ThreadSanitizer must not instrument it): false if the shard's seqlock saw a
// writer; else `wrong` tells whether the row found holds another id.
EMBSTORE_NO_SANITIZE_THREAD bool marking_probe(Shard& sh, uint64_t id, bool& wrong) {
  const uint64_t v = sh.read_begin();
  if ((v & 1) != 0) return false;
  const uint32_t row = sh.find_optimistic<true>(id, mix64(id));
  if (row == kRetry) return false;
  // The id read in this function's own body: a call (id_of) would be instrumented. A link
  // read while a writer changes it may point anywhere: bounded, and then the seqlock fails.
  const IndexView view = sh.index_view();
  uint64_t held = id;
  if (row != kNoRow) {
    const uint32_t pos = sh.links()[row];
    held = pos < view.num_slots ? uint64_t{view.slots[pos].id} : ~id;
  }
  if (!sh.read_valid(v)) return false;
  wrong = held != id;
  return true;
}

TEST_CASE(shard_read_marks_racing_writers_never_break_the_index) {
  constexpr uint32_t kRows = 48;
  constexpr uint64_t kIds = 160;
  Shard sh(0, kRows, kRows);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> validated{0}, wrong_rows{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      while (!stop.load(std::memory_order_relaxed)) {
        bool wrong = false;
        if (!marking_probe(sh, rng() % kIds, wrong)) continue;
        validated.fetch_add(1, std::memory_order_relaxed);
        if (wrong) wrong_rows.fetch_add(1, std::memory_order_relaxed);
      }
    });
  }
  std::mt19937_64 rng(7);
  uint64_t marks_seen = 0, violations = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0;; ++round) {
    // Run the usual rounds, and longer (at most 5 s) until the readers have raced the writer
    // at least once: on a loaded machine they may not be scheduled within the first rounds.
    const auto elapsed = std::chrono::steady_clock::now() - start;
    const bool raced = marks_seen > 0 && validated.load() > 0;
    if (raced && (round >= 20000 || elapsed > std::chrono::milliseconds(300))) break;
    if (elapsed > std::chrono::seconds(5)) break;
    std::lock_guard<std::mutex> lock(sh.mutex());
    {
      Shard::WriteScope writing(sh);
      for (int k = 0; k < 4; ++k) {  // erase (backward shift), insert, or evict by CLOCK
        const uint64_t id = rng() % kIds, hash = mix64(id);
        if (sh.find(id, hash) != kNoRow) {
          sh.unlink_and_free(id, hash);
        } else if (sh.has_unclaimed_row()) {
          sh.link(id, hash, sh.claim_unused_row(), 0);
        } else {
          const uint32_t victim = sh.clock_victim();
          sh.evict(victim);
          sh.link(id, hash, victim, 0);
        }
      }
    }
    // Every linked slot names an occupied row holding its id; a mark never stands alone.
    const IndexView index = sh.index_view();
    uint32_t linked = 0;
    for (uint32_t pos = 0; pos < index.num_slots; ++pos) {
      const uint32_t rp1 = index.slots[pos].load_row_plus1();
      if (rp1 == 0) continue;
      ++linked;
      marks_seen += (rp1 & kReadMark) != 0;
      const uint32_t row = index.slots[pos].row();
      if (rp1 == kReadMark || row >= kRows || !sh.occupied(row) ||
          sh.id_of(row) != index.slots[pos].id) {
        ++violations;
      }
    }
    if (linked != sh.size()) ++violations;
  }
  stop.store(true);
  for (std::thread& r : readers) r.join();
  CHECK(violations == 0);
  CHECK(wrong_rows.load() == 0);
  CHECK(validated.load() > 0);
  CHECK(marks_seen > 0);  // the readers did mark while the writer ran
}
