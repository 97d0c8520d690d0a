// File: tests/cpp/test_admission_steps.cpp
//
// Unit tests: admission, step eviction, staged evictions and reused resolutions.
#include "helpers.hpp"

// =======================================================================================
// Admission, steps, staged evictions
// =======================================================================================

TEST_CASE(count_min_sketch_never_undercounts) {
  CountMinSketch sk(64, 3);
  std::mt19937_64 rng(5);
  std::map<uint64_t, uint32_t> truth;
  for (int i = 0; i < 2000; ++i) {
    const uint64_t id = rng() % 300;
    ++truth[id];
    CHECK(sk.add(mix64(id)) >= truth[id]);
  }
  for (const auto& [id, count] : truth) CHECK(sk.estimate(mix64(id)) >= count);
  CountMinSketch wide(1 << 16, 4);  // no collisions for 3 ids: exact
  for (int i = 0; i < 5; ++i) CHECK(wide.add(mix64(7)) == static_cast<uint32_t>(i + 1));
  CHECK(wide.estimate(mix64(8)) == 0);
  CountMinSketch tiny(1, 1);  // saturates instead of wrapping
  for (uint32_t i = 0; i < CountMinSketch::kMaxCount + 10; ++i) tiny.add(mix64(i));
  CHECK(tiny.estimate(mix64(1)) == CountMinSketch::kMaxCount);
}

TEST_CASE(admission_filter_and_step_eviction) {
  TableConfig c = config(2, 64, 2);
  c.admission.min_count = 2;
  c.admission.width = 1 << 14;
  c.admission.depth = 4;
  Table t(c);
  const Ids ids = {1, 2, 3};
  const Floats first = lookup(t, ids);
  for (float v : first) CHECK(v == 0.0f);  // first sighting: zeros, no row
  CHECK(t.size() == 0);
  apply(t, ids, Floats(6, 1.0f));  // not admitted: dropped
  CHECK(t.size() == 0);
  lookup(t, ids);  // second sighting admits
  CHECK(t.size() == 3);
  CHECK(t.stats().admitted == 3 && t.stats().rejected == 6);
  t.set_step(4);
  lookup(t, {1});
  apply(t, {2}, Floats(2, 1.0f));
  RemovedRows removed;
  CHECK(t.evict_older_than(4, true, removed) == 1);
  CHECK(removed.ids == Ids{3});
  CHECK(removed.width == 2 + state_width(c.optimizer, 2));
  CHECK(removed.rows.size() == removed.width);
  CHECK(t.size() == 2);
  CHECK_THROWS(std::invalid_argument, t.set_step(uint64_t{1} << 32));
  TableConfig bad = c;
  bad.admission.depth = 0;
  CHECK_THROWS(std::invalid_argument, Table{bad});
}

TEST_CASE(staged_evictions_drain_once) {
  TableConfig c = config(2, 4, 1);
  c.stage_evicted = true;
  Table t(c);
  lookup(t, {1, 2, 3, 4});
  const Floats row1 = lookup(t, {1}, false);
  CHECK(t.evicted_pending() == 0);
  lookup(t, {10, 11});  // evicts 2, 3 (1 was looked up again)
  CHECK(t.evicted_pending() == 2);
  RemovedRows out;
  CHECK(t.drain_evicted(out) == 2);
  CHECK(out.ids.size() == 2 && out.rows.size() == 4);
  CHECK(t.evicted_pending() == 0);
  RemovedRows again;
  CHECK(t.drain_evicted(again) == 0 && again.ids.empty());
  (void)row1;
}

// Lookups/applies with advancing steps, evict_older_than and drain_evicted run at once on
// one table (TSan checks the locking); afterwards every evicted row was drained exactly once.
TEST_CASE(step_eviction_and_staging_concurrent) {
  TableConfig c = config(4, 2048, 8, Eviction::kClock, adagrad(0.1f), uniform(-1, 1, 9), 2);
  c.stage_evicted = true;
  Table t(c);
  std::atomic<bool> stop{false};
  std::atomic<size_t> drained{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937_64 rng(static_cast<uint64_t>(w) + 1);
      Ids keys(256);
      for (int it = 0; it < 200; ++it) {
        for (auto& k : keys) k = rng() % 6000;
        lookup(t, keys);
        apply(t, Ids(keys.begin(), keys.begin() + 64), Floats(64 * 4, 0.01f));
      }
    });
  }
  workers.emplace_back([&] {
    RemovedRows out;
    while (!stop.load()) drained += t.drain_evicted(out);
  });
  size_t step_evicted = 0;
  for (uint32_t step = 1; step < 50; ++step) {
    t.set_step(step);
    RemovedRows removed;
    step_evicted += t.evict_older_than(step > 2 ? step - 2 : 0, false, removed);
    CHECK(removed.ids.size() * 4 == removed.rows.size());
  }
  workers[0].join();
  workers[1].join();
  stop = true;
  workers[2].join();
  RemovedRows rest;
  drained += t.drain_evicted(rest);
  const TableStats st = t.stats();
  CHECK(st.evictions == drained.load() + step_evicted);
  CHECK(st.inserts - st.evictions - st.erased == t.size());
}

// A training step's apply reuses the rows its lookup resolved only for ids those rows still
// hold: with another thread erasing and re-inserting some of the ids, id k (gradient
// -(k + 1), SGD lr 1, zeros) must end with a whole multiple of k + 1 (an update that went
// to a row the id no longer held would break that), all 300 steps' worth when never erased.
TEST_CASE(reused_resolution_never_writes_a_row_its_id_left) {
  Table t(config(2, 10000, 4, Eviction::kClock, sgd(1.0f), zeros(), 2));
  Ids keys(256);
  for (size_t k = 0; k < keys.size(); ++k) keys[k] = k;
  Floats grads(keys.size() * 2);
  for (size_t k = 0; k < keys.size(); ++k) grads[2 * k] = grads[2 * k + 1] = -float(k + 1);
  Ids victims;
  for (uint64_t k = 0; k < 256; k += 7) victims.push_back(k);
  lookup(t, keys);
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    const Floats none(victims.size() * 2, 0.0f);
    while (!stop.load()) {
      t.erase(victims.data(), victims.size());
      apply(t, victims, none);
    }
  });
  for (int step = 0; step < 300; ++step) {
    lookup(t, keys);
    apply(t, keys, grads);
  }
  stop = true;
  churn.join();
  const Floats rows = lookup(t, keys, false);
  for (size_t k = 0; k < keys.size(); ++k) {
    const float steps = rows[2 * k] / float(k + 1);
    CHECK(rows[2 * k] == rows[2 * k + 1]);
    CHECK(steps == std::round(steps) && steps >= 0 && steps <= 300);
    if (k % 7 != 0) CHECK(steps == 300);
  }
  CHECK(t.stats().reused_rows > 0);
}
