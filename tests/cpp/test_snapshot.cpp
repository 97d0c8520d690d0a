// File: tests/cpp/test_snapshot.cpp
//
// Unit tests: checkpoint primitives (Snapshot, import_rows).
#include "helpers.hpp"

// =======================================================================================
// Checkpoint primitives: Snapshot (point-in-time, copy-on-write), import_rows
// =======================================================================================

namespace {

// Every row a snapshot yields, by id: (last step, row floats).
using Image = std::map<uint64_t, std::pair<uint32_t, Floats>>;

struct Taken {
  Image rows;
  std::set<uint64_t> removed;
};

// Runs a whole snapshot with chunks of `cap` rows; `between(k)` runs after chunk k.
Taken take(Table& t, SnapshotMode mode, size_t cap, bool commit = true,
           const std::function<void(size_t)>& between = nullptr) {
  Snapshot snap(t, mode);
  const size_t w = snap.row_width();
  Ids ids(cap);
  Floats rows(cap * w);
  std::vector<uint32_t> steps(cap);
  Taken out;
  size_t chunk = 0;
  for (size_t s = 0; s < snap.num_shards(); ++s) {
    while (!snap.done(s)) {
      const size_t n = snap.next(s, ids.data(), rows.data(), steps.data(), cap);
      for (size_t i = 0; i < n; ++i) {
        const bool fresh =
            out.rows.emplace(ids[i], std::make_pair(steps[i], slice(rows, i, w))).second;
        CHECK_MSG(fresh, "id " + std::to_string(ids[i]) + " yielded twice");
      }
      if (between) between(chunk);
      ++chunk;
    }
    for (uint64_t id : snap.removed(s)) out.removed.insert(id);
  }
  if (commit) snap.commit();
  return out;
}

std::string image_diff(const Image& a, const Image& b) {
  if (a.size() != b.size()) {
    return "sizes " + std::to_string(a.size()) + " != " + std::to_string(b.size());
  }
  for (const auto& [id, v] : a) {
    auto it = b.find(id);
    if (it == b.end()) return "id " + std::to_string(id) + " missing";
    if (it->second.first != v.first) return "last step of " + std::to_string(id);
    if (std::memcmp(it->second.second.data(), v.second.data(), v.second.size() * 4) != 0) {
      return "row of " + std::to_string(id);
    }
  }
  return "";
}

}  // namespace

TEST_CASE(snapshot_full_copies_every_row_and_import_restores_it) {
  for (size_t shards : {1, 4}) {
    Table t(config(3, 500, shards, Eviction::kClock, adagrad(0.1f), uniform(-1, 1, 3)));
    const Ids keys = range_ids(0, 300);
    t.set_step(7);
    lookup(t, keys);
    apply(t, Ids(keys.begin(), keys.begin() + 100), Floats(300, 0.5f));
    const Taken all = take(t, SnapshotMode::kFull, 37);
    CHECK(all.rows.size() == 300 && all.removed.empty());
    // Import into tables of other shapes: the same rows come back.
    for (size_t shards2 : {1, 2, 8}) {
      Table u(config(3, 400, shards2, Eviction::kClock, adagrad(0.1f), uniform(-1, 1, 3)));
      Ids ids;
      Floats rows;
      std::vector<uint32_t> steps;
      for (const auto& [id, v] : all.rows) {
        ids.push_back(id);
        steps.push_back(v.first);
        rows.insert(rows.end(), v.second.begin(), v.second.end());
      }
      std::vector<uint8_t> placed(ids.size(), 7);
      CHECK(u.import_rows(ids.data(), ids.size(), rows.data(), steps.data(), ImportMode::kRestore,
                          placed.data()) == 300);
      for (uint8_t p : placed) CHECK(p == 1);
      const Taken again = take(u, SnapshotMode::kExport, 1000);
      CHECK_MSG(image_diff(all.rows, again.rows).empty(), image_diff(all.rows, again.rows));
      // Restored rows are clean: an immediate delta is empty.
      CHECK(take(u, SnapshotMode::kDelta, 64).rows.empty());
    }
  }
}

TEST_CASE(snapshot_delta_has_dirty_rows_and_checkpointed_removals) {
  Table t(config(2, 1000, 4, Eviction::kClock, sgd(0.5f)));
  const Ids keys = range_ids(0, 200);
  lookup(t, keys);
  take(t, SnapshotMode::kFull, 50);
  CHECK(take(t, SnapshotMode::kDelta, 50).rows.empty());
  apply(t, Ids{keys[3], keys[4]}, Floats(4, 1.0f));
  const Ids fresh = range_ids(1000, 1005);
  lookup(t, fresh);
  t.erase(&keys[10], 1);
  t.erase(&fresh[0], 1);  // never checkpointed: not logged
  const Taken d = take(t, SnapshotMode::kDelta, 3);
  std::set<uint64_t> want{keys[3], keys[4], fresh[1], fresh[2], fresh[3], fresh[4]};
  std::set<uint64_t> got;
  for (const auto& kv : d.rows) got.insert(kv.first);
  CHECK_MSG(got == want, describe(got));
  CHECK(d.removed == std::set<uint64_t>{keys[10]});
  // Both bookkeeping steps are final after commit.
  const Taken d2 = take(t, SnapshotMode::kDelta, 3);
  CHECK(d2.rows.empty() && d2.removed.empty());
}

TEST_CASE(snapshot_abort_gives_back_dirty_rows_and_removed_ids) {
  Table t(config(2, 1000, 2, Eviction::kClock, sgd(0.5f)));
  const Ids keys = range_ids(0, 100);
  lookup(t, keys);
  take(t, SnapshotMode::kFull, 50);
  apply(t, Ids(keys.begin(), keys.begin() + 20), Floats(40, 1.0f));
  t.erase(&keys[50], 5);
  {
    Snapshot snap(t, SnapshotMode::kDelta);
    Ids ids(4);
    Floats rows(4 * 2);
    std::vector<uint32_t> steps(4);
    while (!snap.done(0)) snap.next(0, ids.data(), rows.data(), steps.data(), 4);
    snap.next(1, ids.data(), rows.data(), steps.data(), 4);
    snap.abort();
    CHECK_THROWS(std::logic_error, snap.commit());
  }
  {
    Snapshot dropped(t, SnapshotMode::kFull);  // destroyed unfinished: aborts
    Ids ids(4);
    Floats rows(4 * 2);
    std::vector<uint32_t> steps(4);
    dropped.next(1, ids.data(), rows.data(), steps.data(), 4);
  }
  const Taken d = take(t, SnapshotMode::kDelta, 4);
  CHECK(d.rows.size() == 20);
  CHECK(d.removed.size() == 5);
}

TEST_CASE(snapshot_is_the_table_at_its_start_whatever_writers_do_meanwhile) {
  for (size_t shards : {1, 4}) {
    for (SnapshotMode mode : {SnapshotMode::kFull, SnapshotMode::kExport}) {
      OptimizerConfig adam;
      adam.kind = OptimizerKind::kAdam;
      adam.lr = 0.01f;
      Table t(config(4, 300, shards, Eviction::kClock, adam, uniform(-1, 1, 9)));
      const Ids universe = range_ids(0, 600);
      std::mt19937_64 rng(shards * 10 + static_cast<int>(mode));
      auto some = [&](size_t n) {
        Ids k;
        for (size_t i = 0; i < n; ++i) k.push_back(universe[rng() % universe.size()]);
        return k;
      };
      t.set_step(1);
      lookup(t, Ids(universe.begin(), universe.begin() + 250));
      const Taken before = take(t, SnapshotMode::kExport, 1000);
      // The same table, snapshotted while every kind of write happens between chunks.
      uint32_t step = 2;
      const Taken during = take(t, mode, 9, true, [&](size_t k) {
        t.set_step(step++);
        const Ids a = some(30);
        apply(t, a, Floats(a.size() * 4, 0.25f));  // updates, and inserts that evict
        lookup(t, some(20));                       // last steps, inserts
        const Ids e = some(5);
        t.erase(e.data(), e.size());
        if (k % 5 == 4) {
          RemovedRows out;
          t.evict_older_than(step - 3, true, out);
        }
        const Ids imp = some(3);
        std::set<uint64_t> uniq(imp.begin(), imp.end());
        Ids ids(uniq.begin(), uniq.end());
        Floats rows(ids.size() * t.row_width(), 0.5f);
        t.import_rows(ids.data(), ids.size(), rows.data(), nullptr, ImportMode::kUpsert, nullptr);
      });
      CHECK(t.stats().evictions > 0);
      CHECK_MSG(image_diff(before.rows, during.rows).empty(), image_diff(before.rows, during.rows));
    }
  }
}

TEST_CASE(import_rows_restore_skips_what_does_not_fit_and_upsert_evicts) {
  Table small(config(2, 8, 1, Eviction::kClock, sgd(0.5f)));
  const Ids ids = range_ids(0, 12);
  Floats rows(12 * 2, 1.0f);
  std::vector<uint8_t> placed(12, 9);
  CHECK(small.import_rows(ids.data(), 12, rows.data(), nullptr, ImportMode::kRestore,
                          placed.data()) == 8);
  CHECK(std::count(placed.begin(), placed.end(), 1) == 8);
  CHECK(std::count(placed.begin(), placed.end(), 0) == 4);
  CHECK(small.size() == 8 && small.stats().evictions == 0);
  const Ids more = range_ids(100, 103);
  CHECK(small.import_rows(more.data(), 3, rows.data(), nullptr, ImportMode::kUpsert, nullptr) == 3);
  CHECK(small.size() == 8 && small.stats().evictions == 3);
  Table none(config(2, 4, 1, Eviction::kNone, sgd(0.5f)));
  CHECK_THROWS(CapacityError,
               none.import_rows(ids.data(), 5, rows.data(), nullptr, ImportMode::kUpsert, nullptr));
  CHECK(none.size() == 4);
}

// Several writer threads and a snapshotting thread (run under TSan by .ci/sanitizers.sh):
// every snapshot is one instant. One writer applies the same gradient to all of its ids in
// each call, so at any instant its rows have k or k+1 updates; with Adagrad from zero rows
// and g = 0.5 the accumulator is exactly 0.25 k and the weights those after k updates.
TEST_CASE(snapshot_with_concurrent_writers_is_one_instant) {
  const size_t dim = 2, per_writer = 600, writers = 2;
  Table t(config(dim, 4000, 8, Eviction::kClock, adagrad(0.1f), zeros(), 2));
  std::vector<Ids> groups(writers);
  for (size_t w = 0; w < writers; ++w) groups[w] = range_ids(w * 10000, w * 10000 + per_writer);
  std::atomic<bool> stop{false};
  std::atomic<size_t> calls{0};
  std::vector<std::thread> threads;
  for (size_t w = 0; w < writers; ++w) {
    threads.emplace_back([&, w] {
      const Floats g(per_writer * dim, 0.5f);
      while (!stop.load()) {
        apply(t, groups[w], g);
        calls.fetch_add(1);
      }
    });
  }
  // A churn thread: other ids come and go (inserts, erases), and lookups.
  threads.emplace_back([&] {
    const Ids other = range_ids(50000, 50400);
    size_t k = 0;
    while (!stop.load()) {
      lookup(t, Ids(other.begin() + static_cast<std::ptrdiff_t>(k % 300),
                    other.begin() + static_cast<std::ptrdiff_t>(k % 300 + 50)));
      t.erase(&other[(k * 7) % 400], 1);
      ++k;
    }
  });
  // Trajectory of a row after k updates.
  std::vector<float> w_of{0.0f}, acc_of{0.0f};
  auto extend = [&](size_t k) {
    while (w_of.size() <= k) {
      const float a = acc_of.back() + 0.5f * 0.5f;
      acc_of.push_back(a);
      w_of.push_back(w_of.back() - (0.1f * 0.5f) / (std::sqrt(a) + 1e-8f));
    }
  };
  std::map<uint64_t, size_t> group_of;
  for (size_t w = 0; w < writers; ++w) {
    for (uint64_t id : groups[w]) group_of[id] = w;
  }
  for (int round = 0; round < 6; ++round) {
    const SnapshotMode mode = round % 3 == 0   ? SnapshotMode::kFull
                              : round % 3 == 1 ? SnapshotMode::kDelta
                                               : SnapshotMode::kExport;
    const Taken snap = take(t, mode, 64, round != 4, [&](size_t) { std::this_thread::yield(); });
    std::vector<size_t> lo(writers, SIZE_MAX), hi(writers, 0);
    for (const auto& [id, v] : snap.rows) {
      auto it = group_of.find(id);
      if (it == group_of.end()) continue;
      const Floats& row = v.second;
      const size_t k = static_cast<size_t>(std::lround(row[dim] / 0.25f));
      extend(k);
      CHECK_MSG(row[dim] == acc_of[k] && row[0] == w_of[k] && row[1] == w_of[k] &&
                    row[dim + 1] == acc_of[k],
                "row of id " + std::to_string(id) + " is not one update count");
      lo[it->second] = std::min(lo[it->second], k);
      hi[it->second] = std::max(hi[it->second], k);
    }
    for (size_t w = 0; w < writers; ++w) {
      if (hi[w] == 0) continue;  // a delta without this writer's rows
      CHECK_MSG(hi[w] - lo[w] <= 1, "writer " + std::to_string(w) + ": updates from " +
                                        std::to_string(lo[w]) + " to " + std::to_string(hi[w]));
    }
  }
  stop = true;
  for (std::thread& th : threads) th.join();
  CHECK(calls.load() > 0);
}
