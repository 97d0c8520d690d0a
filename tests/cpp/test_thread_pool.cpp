// File: tests/cpp/test_thread_pool.cpp
//
// Unit tests: the thread pool, and results independent of the thread count.
#include "helpers.hpp"
#include "reference_table.hpp"

// =======================================================================================
// ThreadPool
// =======================================================================================

TEST_CASE(thread_pool_runs_every_task_once_and_rethrows) {
  CHECK(ThreadPool::hardware_threads() >= 1);
  CHECK(&ThreadPool::global() == &ThreadPool::global());
  ThreadPool pool(3);
  for (size_t tasks : {0, 1, 2, 7, 1000}) {
    for (size_t workers : {0, 1, 2, 4, 16}) {
      std::vector<std::atomic<int>> runs(tasks);
      pool.run(tasks, workers, [&](size_t task) { runs[task].fetch_add(1); });
      for (size_t k = 0; k < tasks; ++k) CHECK(runs[k].load() == 1);
    }
  }
  // A task's exception reaches the caller (on both the inline and the helper path); no task
  // runs twice; the pool stays usable.
  for (size_t workers : {1, 4}) {
    std::vector<std::atomic<int>> runs(200);
    bool caught = false;
    try {
      pool.run(200, workers, [&](size_t task) {
        runs[task].fetch_add(1);
        if (task == 37) throw std::runtime_error("task 37 failed");
      });
    } catch (const std::runtime_error& e) {
      caught = std::strcmp(e.what(), "task 37 failed") == 0;
    }
    CHECK(caught);
    CHECK(runs[37].load() == 1);
    for (size_t k = 0; k < 200; ++k) CHECK(runs[k].load() <= 1);
    std::atomic<size_t> total{0};
    pool.run(500, workers, [&](size_t) { total.fetch_add(1); });
    CHECK(total.load() == 500);
  }
  // Several callers at once on one pool, and a job started from inside a task.
  std::vector<std::thread> callers;
  std::atomic<bool> ok{true};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int rep = 0; rep < 30; ++rep) {
        std::vector<std::atomic<int>> runs(300);
        pool.run(300, 4, [&](size_t task) { runs[task].fetch_add(1); });
        for (auto& r : runs) {
          if (r.load() != 1) ok = false;
        }
      }
    });
  }
  for (std::thread& th : callers) th.join();
  CHECK(ok.load());
  std::atomic<size_t> inner{0};
  pool.run(8, 4, [&](size_t) { pool.run(10, 4, [&](size_t) { inner.fetch_add(1); }); });
  CHECK(inner.load() == 80);
  // A pool without helpers runs everything on the caller.
  ThreadPool solo(0);
  const std::thread::id me = std::this_thread::get_id();
  bool all_here = true;
  solo.run(20, 8, [&](size_t) { all_here = all_here && std::this_thread::get_id() == me; });
  CHECK(all_here);
}

// Waiting threads spin before they sleep (ThreadPool's file comment): every task still runs
// once whether the helpers are spinning, asleep, or woken ahead of a job, whether the caller
// finds its helpers done while it spins or has to sleep for them, and a pool whose helpers
// spin is destroyed without waiting out their spin.
TEST_CASE(thread_pool_spinning_and_sleeping_waits_run_every_task_once) {
  for (uint32_t spin : {0u, 50u, 5000u}) {
    ThreadPool pool(2, spin);
    CHECK(pool.spin_us() == spin);
    for (int rep = 0; rep < 120; ++rep) {
      if (rep % 3 == 0) pool.prewake();
      if (rep % 10 == 9) std::this_thread::sleep_for(std::chrono::microseconds(200));
      const size_t tasks = 1 + static_cast<size_t>(rep % 7) * 5;
      std::vector<std::atomic<int>> runs(tasks);
      pool.run(tasks, 3, [&](size_t task) {
        // Some last tasks outlast the caller's spin, some end while it spins.
        if (task + 1 == tasks && rep % 4 == 1) {
          std::this_thread::sleep_for(std::chrono::microseconds(rep % 8 == 1 ? 8000 : 20));
        }
        runs[task].fetch_add(1);
      });
      for (size_t k = 0; k < tasks; ++k) CHECK(runs[k].load() == 1);
    }
  }
  ThreadPool capped(1, 0);
  capped.set_spin_us(ThreadPool::kMaxSpinUs * 10);
  CHECK(capped.spin_us() == ThreadPool::kMaxSpinUs);
  const auto start = std::chrono::steady_clock::now();
  {
    ThreadPool spinning(2, ThreadPool::kMaxSpinUs);  // 100 ms spins
    std::atomic<int> ran{0};
    spinning.run(8, 3, [&](size_t) {  // long enough for both helpers to join, then spin
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ran.fetch_add(1);
    });
    CHECK(ran.load() == 8);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(60));
}

// =======================================================================================
// Thread-count independence
// =======================================================================================

TEST_CASE(results_bitwise_equal_for_1_and_4_threads) {
  for (const OptimizerConfig& opt : {sgd(0.1f), adagrad(0.05f)}) {
    const size_t dim = 6, n = 30000;
    Table t1(config(dim, 100000, 16, Eviction::kClock, opt, uniform(-1, 1, 5), 1));
    Table t4(config(dim, 100000, 16, Eviction::kClock, opt, uniform(-1, 1, 5), 4));
    RefTable ref(dim, opt, uniform(-1, 1, 5));
    std::mt19937_64 rng(77);
    for (int round = 0; round < 3; ++round) {
      Ids keys(n);
      for (uint64_t& id : keys) id = (rng() % 4 == 0) ? rng() % 50 : rng() % 20000;  // duplicates
      keys[0] = 0;
      keys[1] = kMaxId;
      const Floats l1 = lookup(t1, keys), l4 = lookup(t4, keys);
      CHECK_BITS_EQ(l1, l4);
      CHECK_FLOATS_EQ(l1, ref.lookup(keys, true));
      const Offsets off = random_offsets(rng, n, 8000);
      const Floats w = random_floats(rng, n, -1, 1);
      for (PoolMode mode : {PoolMode::kSum, PoolMode::kMean}) {
        const Floats s1 = lookup_sum(t1, keys, off, &w, mode),
                     s4 = lookup_sum(t4, keys, off, &w, mode);
        CHECK_BITS_EQ(s1, s4);
        CHECK_FLOATS_EQ(s1, ref.lookup_sum(keys, off, &w, mode, true));
      }
      const Floats g = random_floats(rng, n * dim, -1, 1);
      apply(t1, keys, g);
      apply(t4, keys, g);
      ref.apply(keys, g, nullptr, nullptr, PoolMode::kSum);
      const Floats gb = random_floats(rng, 8000 * dim, -1, 1);
      apply_pooled(t1, keys, gb, off, &w, PoolMode::kMean);
      apply_pooled(t4, keys, gb, off, &w, PoolMode::kMean);
      ref.apply(keys, gb, &off, &w, PoolMode::kMean);
      CHECK(contains(t1, keys) == contains(t4, keys));
    }
    Ids all;
    for (uint64_t id = 0; id < 20000; ++id) all.push_back(id);
    all.push_back(kMaxId);
    const Floats r1 = lookup(t1, all, false), r4 = lookup(t4, all, false);
    CHECK_BITS_EQ(r1, r4);
    CHECK_FLOATS_EQ(r1, ref.lookup(all, false));
    const TableStats a = t1.stats(), b = t4.stats();
    CHECK(a.size == b.size && a.hits == b.hits && a.misses == b.misses && a.inserts == b.inserts);
    Ids gone(all.begin(), all.begin() + 9000);
    CHECK(t1.erase(gone.data(), gone.size()) == t4.erase(gone.data(), gone.size()));
    CHECK(t1.size() == t4.size());
  }
}

// docs/semantics.md "Threads": results are bitwise identical for any num_threads; the one
// documented boundary is the moment a multi-shard table *reaches* capacity (the last free
// rows go to whichever shard task inserts first). Here the tables are filled to capacity one
// id per call (so no call races for the last rows), then run big evicting batches on the
// thread pool: "from then on every insert evicts within its own shard", so a 1-thread table,
// a 4-thread table and a 1-thread table whose calls interleave with other calls (a different
// shard task order) must stay bitwise identical. Also a one-shard evicting table.
TEST_CASE(evicting_results_independent_of_threads_after_capacity) {
  for (size_t shards : {16, 1}) {
    auto make = [&](size_t threads) {
      return config(4, 4096, shards, Eviction::kClock, sgd(0.1f), uniform(-1, 1, 1), threads);
    };
    Table t1(make(1)), t4(make(4)), t1b(make(1));
    for (uint64_t id = 100000; t1.size() < 4096; ++id) {
      const Ids one = {id * 0x9E3779B97F4A7C15ULL};
      lookup(t1, one);
      lookup(t4, one);
      contains(t1b, {1});  // shifts the task rotation of every later call
      lookup(t1b, one);
    }
    CHECK(t4.size() == 4096 && t1b.size() == 4096);
    std::mt19937_64 rng(2024);
    std::string first_difference;
    for (int round = 0; round < 6 && first_difference.empty(); ++round) {
      Ids keys(12000);  // >= 4 * 2048 ids: the 4-thread table splits shards over 4 workers
      for (uint64_t& id : keys) id = rng() % 9000;
      const Ids train(keys.begin(), keys.begin() + 1000);
      const Floats g(1000 * 4, 0.5f);
      apply(t1, train, g);
      apply(t4, train, g);
      contains(t1b, {1});
      apply(t1b, train, g);
      const Floats o1 = lookup(t1, keys), o4 = lookup(t4, keys);
      contains(t1b, {1});
      const Floats o1b = lookup(t1b, keys);
      if (std::memcmp(o1.data(), o4.data(), o1.size() * sizeof(float)) != 0) {
        first_difference = "num_threads 1 vs 4 differ in round " + std::to_string(round);
      } else if (std::memcmp(o1.data(), o1b.data(), o1.size() * sizeof(float)) != 0) {
        first_difference =
            "two 1-thread tables (different task order) differ in round " + std::to_string(round);
      }
    }
    const TableStats a = t1.stats(), b = t4.stats(), c = t1b.stats();
    CHECK_MSG(first_difference.empty(),
              "shards=" + std::to_string(shards) + ": " + first_difference + "; evictions " +
                  std::to_string(a.evictions) + " / " + std::to_string(b.evictions) + " / " +
                  std::to_string(c.evictions));
    CHECK(a.evictions > 0);
    CHECK(a.evictions == b.evictions && a.evictions == c.evictions);
    CHECK(a.size == 4096 && b.size == 4096 && c.size == 4096);
  }
}
