// File: tests/cpp/test_table_ops.cpp
//
// Unit tests: Table's batch operations against the reference, and input validation.
#include "helpers.hpp"
#include "reference_table.hpp"

// =======================================================================================
// Table operations against the reference (no eviction)
// =======================================================================================

TEST_CASE(optimizers_hand_computed) {
  // SGD, Zeros, lr 0.5: ids [1, 1, 2] -> row1 = 0 - 0.5 * ((1,2) + (3,4)), row2 = -0.5 * (5,6).
  Table s(config(2, 16, 1, Eviction::kClock, sgd(0.5f), zeros()));
  apply(s, {1, 1, 2}, Floats{1, 2, 3, 4, 5, 6});
  CHECK_FLOATS_EQ(lookup(s, {1, 2}, false), (Floats{-2.0f, -3.0f, -2.5f, -3.0f}));
  CHECK(s.stats().inserts == 2 && s.stats().hits == 2 && s.stats().misses == 0);
  // Adagrad lr 1, eps 0, acc0 0: ids [1, 1] grads 3 and 4 summed to 7 before ONE update:
  // acc = 49, w = 0 - 7 / 7 = -1 (two separate updates would give -1 - 4/5).
  Table a(config(1, 16, 1, Eviction::kClock, adagrad(1.0f, 0.0f, 0.0f), zeros()));
  apply(a, {1, 1}, Floats{3, 4});
  CHECK(lookup(a, {1}, false)[0] == -1.0f);
  // Second update: g = 24 -> acc = 49 + 576 = 625, w = -1 - 24 / 25.
  apply(a, {1}, Floats{24});
  CHECK(lookup(a, {1}, false)[0] == -1.0f - 24.0f / 25.0f);
  // initial_accumulator and eps: acc = 16 + 9 = 25, w = 0 - 2 * 3 / (5 + 1) = -1.
  Table a2(config(1, 16, 1, Eviction::kClock, adagrad(2.0f, 1.0f, 16.0f), zeros()));
  apply(a2, {7}, Floats{3});
  CHECK(lookup(a2, {7}, false)[0] == -1.0f);
  // Pooled backward: bags [[1, 2], [1]], mean, grads (4), (8): g1 = 4/2 + 8, g2 = 4/2.
  Table p(config(1, 16, 1, Eviction::kClock, sgd(1.0f), zeros()));
  apply_pooled(p, {1, 2, 1}, Floats{4, 8}, Offsets{0, 2, 3}, nullptr, PoolMode::kMean);
  CHECK_FLOATS_EQ(lookup(p, {1, 2}, false), (Floats{-10.0f, -2.0f}));
  // Weighted sum: weights (0.5, 2, 3) -> g1 = 0.5*4 + 3*8 = 26, g2 = 2*4 = 8.
  const Floats w = {0.5f, 2.0f, 3.0f};
  apply_pooled(p, {1, 2, 1}, Floats{4, 8}, Offsets{0, 2, 3}, &w, PoolMode::kSum);
  CHECK_FLOATS_EQ(lookup(p, {1, 2}, false), (Floats{-36.0f, -10.0f}));
  // Weighted mean: c = w / count.
  apply_pooled(p, {1, 2, 1}, Floats{4, 8}, Offsets{0, 2, 3}, &w, PoolMode::kMean);
  CHECK_FLOATS_EQ(lookup(p, {1, 2}, false), (Floats{-36.0f - 1.0f - 24.0f, -14.0f}));
  // lookup_sum: bags [[1, 2], [], [2]] sum / mean / weighted.
  const Floats r1 = lookup(p, {1}, false), r2 = lookup(p, {2}, false);
  CHECK_FLOATS_EQ(lookup_sum(p, {1, 2, 2}, Offsets{0, 2, 2, 3}, nullptr, PoolMode::kSum),
                  (Floats{r1[0] + r2[0], 0.0f, r2[0]}));
  CHECK_FLOATS_EQ(lookup_sum(p, {1, 2, 2}, Offsets{0, 2, 2, 3}, nullptr, PoolMode::kMean),
                  (Floats{(r1[0] + r2[0]) / 2.0f, 0.0f, r2[0]}));
  CHECK_FLOATS_EQ(lookup_sum(p, {1, 2, 2}, Offsets{0, 2, 2, 3}, &w, PoolMode::kMean),
                  (Floats{(0.5f * r1[0] + 2.0f * r2[0]) / 2.0f, 0.0f, 3.0f * r2[0]}));
}

TEST_CASE(table_matches_reference_random) {
  struct Variant {
    OptimizerConfig opt;
    InitializerConfig init;
    size_t shards;
    size_t dim;
  };
  const Variant variants[] = {
      {sgd(0.1f), uniform(-0.5, 0.5, 11), 1, 5},
      {sgd(0.03125f), uniform(-1, 1, 12), 4, 3},
      {adagrad(0.1f), uniform(-1, 1, 13), 1, 5},
      {adagrad(0.05f, 1e-6f, 0.5f), uniform(-0.1, 0.3, 14), 8, 8},
      {sgd(0.25f), zeros(), 2, 1},
  };
  uint64_t seed = 0;
  for (const Variant& v : variants) {
    ++seed;
    const size_t dim = v.dim;
    Table t(config(dim, 4096, v.shards, Eviction::kNone, v.opt, v.init));
    RefTable ref(dim, v.opt, v.init);
    std::mt19937_64 rng(seed);
    Ids universe = {0, kMaxId, kMaxId - 1, 1ULL << 63};
    for (uint64_t id = 1; id < 60; ++id) universe.push_back(id * id * 1000003ULL);
    auto pick = [&](size_t n) {
      Ids keys(n);
      for (uint64_t& id : keys) id = universe[rng() % universe.size()];
      return keys;
    };
    for (int op = 0; op < 300; ++op) {
      const int kind = static_cast<int>(rng() % 7);
      const size_t n = rng() % 12;
      const Ids keys = pick(n);
      const PoolMode mode = rng() % 2 ? PoolMode::kMean : PoolMode::kSum;
      const Floats weights = random_floats(rng, n, -2, 2);
      const Floats* wp = rng() % 2 ? &weights : nullptr;
      if (kind == 0 || kind == 1) {
        const bool insert = kind == 0;
        CHECK_FLOATS_EQ(lookup(t, keys, insert), ref.lookup(keys, insert));
      } else if (kind == 2 || kind == 3) {
        const Offsets off = random_offsets(rng, n, 1 + rng() % 5);
        const bool insert = kind == 2;
        CHECK_FLOATS_EQ(lookup_sum(t, keys, off, wp, mode, insert),
                        ref.lookup_sum(keys, off, wp, mode, insert));
      } else if (kind == 4) {
        const Floats grads = random_floats(rng, n * dim, -1, 1);
        apply(t, keys, grads);
        ref.apply(keys, grads, nullptr, nullptr, PoolMode::kSum);
      } else if (kind == 5) {
        const Offsets off = random_offsets(rng, n, 1 + rng() % 5);
        const Floats grads = random_floats(rng, (off.size() - 1) * dim, -1, 1);
        apply_pooled(t, keys, grads, off, wp, mode);
        ref.apply(keys, grads, &off, wp, mode);
      } else {
        CHECK(contains(t, keys) == ref.contains(keys));
        if (rng() % 4 == 0) CHECK(t.erase(keys.data(), keys.size()) == ref.erase(keys));
      }
      CHECK_STATS(t, ref);
    }
    const std::set<uint64_t> ids_now = ref.ids();
    const Ids all(ids_now.begin(), ids_now.end());
    CHECK_FLOATS_EQ(lookup(t, all, false), ref.lookup(all, false));
  }
}

TEST_CASE(lookup_sum_edge_cases) {
  Table t(config(3, 64, 2));
  RefTable ref(3, sgd(0.5f), uniform(-1, 1, 42));
  const Floats w = {2.0f, -1.0f, 0.5f};
  // No keys, no bags; no keys, three empty bags (zero rows in both modes).
  CHECK(lookup_sum(t, {}, Offsets{0}, nullptr, PoolMode::kSum).empty());
  CHECK_FLOATS_EQ(lookup_sum(t, {}, Offsets{0, 0, 0, 0}, nullptr, PoolMode::kMean),
                  Floats(9, 0.0f));
  CHECK(lookup(t, {}).empty());
  // One id per bag (the direct path) with weights, mean and sum.
  for (PoolMode mode : {PoolMode::kSum, PoolMode::kMean}) {
    CHECK_FLOATS_EQ(lookup_sum(t, {5, 6, 5}, Offsets{0, 1, 2, 3}, &w, mode),
                    ref.lookup_sum({5, 6, 5}, Offsets{0, 1, 2, 3}, &w, mode, true));
    CHECK_FLOATS_EQ(lookup_sum(t, {5, 6, 5}, Offsets{0, 1, 2, 3}, nullptr, mode),
                    ref.lookup_sum({5, 6, 5}, Offsets{0, 1, 2, 3}, nullptr, mode, true));
  }
  // Empty bags between full ones; a read-only miss contributes zeros and is not inserted.
  CHECK_FLOATS_EQ(lookup_sum(t, {5, 77, 6}, Offsets{0, 0, 2, 2, 3}, &w, PoolMode::kMean, false),
                  ref.lookup_sum({5, 77, 6}, Offsets{0, 0, 2, 2, 3}, &w, PoolMode::kMean, false));
  CHECK(!contains(t, {77})[0]);
  CHECK_STATS(t, ref);
  // Empty apply calls are no-ops.
  apply(t, {}, {});
  apply_pooled(t, {}, Floats(6, 1.0f), Offsets{0, 0, 0}, nullptr, PoolMode::kMean);
  CHECK_STATS(t, ref);
  CHECK(t.size() == 2);
}

// =======================================================================================
// Validation: std::invalid_argument before anything changes
// =======================================================================================

TEST_CASE(validation_errors_change_nothing) {
  Table t(config(2, 64, 4));
  lookup(t, {1, 2, 3});
  apply(t, {1}, Floats{1, 1});
  const Ids known = {1, 2, 3, 10, 11};
  auto snapshot = [&]() {
    const TableStats st = t.stats();
    return std::vector<uint64_t>{st.size, st.hits, st.misses, st.inserts, st.evictions, st.erased};
  };
  const auto stats0 = snapshot();
  const std::set<uint64_t> present0 = present(t, known);
  const Ids keys = {1, 10, 2, 11};
  const Floats grads_ok(8, 1.0f);
  Floats out(8, kNaN);
  // Without offsets every id is its own bag: any other bag count is refused.
  CHECK_THROWS(std::invalid_argument, t.lookup_sum(keys.data(), keys.size(), nullptr, 2, nullptr,
                                                   PoolMode::kSum, true, out.data()));
  auto bad_offsets = [&](const Offsets& off) {
    Floats o((off.size() - 1) * 2, kNaN);
    CHECK_THROWS(std::invalid_argument,
                 t.lookup_sum(keys.data(), keys.size(), off.data(), off.size() - 1, nullptr,
                              PoolMode::kSum, true, o.data()));
    const Floats g((off.size() - 1) * 2, 1.0f);
    CHECK_THROWS(std::invalid_argument,
                 t.apply_gradients(keys.data(), keys.size(), g.data(), off.data(), off.size() - 1,
                                   nullptr, PoolMode::kMean));
  };
  bad_offsets({1, 2, 4});     // offsets[0] != 0
  bad_offsets({0, 3, 2, 4});  // decreasing
  bad_offsets({0, 2, 3});     // offsets[-1] != len(keys)
  bad_offsets({0, 2, 5});     // offsets[-1] > len(keys)
  bad_offsets({0, -1, 4});    // negative
  // Non-finite gradients (the bad element last, so a partial apply would show) and weights.
  for (float bad :
       {kNaN, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    Floats g = grads_ok;
    g.back() = bad;
    CHECK_THROWS(std::invalid_argument, apply(t, keys, g));
    CHECK_THROWS(std::invalid_argument, apply_pooled(t, keys, Floats{1, 1, 1, bad},
                                                     Offsets{0, 2, 4}, nullptr, PoolMode::kSum));
    Floats w(4, 1.0f);
    w.back() = bad;
    CHECK_THROWS(std::invalid_argument,
                 apply_pooled(t, keys, Floats(4, 1.0f), Offsets{0, 2, 4}, &w, PoolMode::kSum));
    CHECK_THROWS(std::invalid_argument,
                 lookup_sum(t, keys, Offsets{0, 2, 4}, &w, PoolMode::kSum, true));
    CHECK_THROWS(std::invalid_argument,
                 lookup_sum(t, keys, Offsets{0, 1, 2, 3, 4}, &w, PoolMode::kSum, true));
  }
  CHECK(snapshot() == stats0);
  CHECK(present(t, known) == present0);
  // Rows unchanged (read last: lookup changes counters).
  Table fresh(config(2, 64, 4));
  lookup(fresh, {1, 2, 3});
  apply(fresh, {1}, Floats{1, 1});
  CHECK_BITS_EQ(lookup(t, {1, 2, 3}, false), lookup(fresh, {1, 2, 3}, false));

  // Several tables in one call: a bad request leaves the good ones untouched too.
  Table u(config(2, 64, 1));
  Floats o1(4, kNaN), o2(4, kNaN);
  const Ids k2 = {5, 6};
  const Offsets good = {0, 1, 2}, bad = {0, 2, 1};
  std::vector<LookupSumRequest> reqs = {
      {&u, k2.data(), 2, good.data(), 2, nullptr, PoolMode::kSum, true, o1.data(), "first"},
      {&t, k2.data(), 2, bad.data(), 2, nullptr, PoolMode::kSum, true, o2.data(), "second"}};
  try {
    lookup_sum_many(reqs);
    CHECK(!"lookup_sum_many accepted bad offsets");
  } catch (const std::invalid_argument& e) {
    CHECK_MSG(std::strstr(e.what(), "second") != nullptr, e.what());
  }
  CHECK(u.size() == 0 && u.stats().misses == 0);
  const Floats g2 = {1, 1, kNaN, 1};
  std::vector<ApplyRequest> areqs = {
      {&u, k2.data(), 2, grads_ok.data(), nullptr, 0, nullptr, PoolMode::kSum, "first"},
      {&t, k2.data(), 2, g2.data(), nullptr, 0, nullptr, PoolMode::kSum, "second"}};
  CHECK_THROWS(std::invalid_argument, apply_gradients_many(areqs));
  CHECK(u.size() == 0 && u.stats().inserts == 0);
}

TEST_CASE(bad_configuration_throws) {
  CHECK_THROWS(std::invalid_argument, Table(config(0, 16, 1)));
  CHECK_THROWS(std::invalid_argument, Table(config(4, 0, 1)));
  CHECK_THROWS(std::invalid_argument, Table(config(4, 16, 3)));   // not a power of two
  CHECK_THROWS(std::invalid_argument, Table(config(4, 16, 32)));  // more shards than rows
  CHECK_THROWS(std::invalid_argument, Table(config(4, 1 << 20, 8192)));
  // A slot's row + 1 has 31 bits (the top one is its read mark): checked before allocating.
  CHECK_THROWS(std::invalid_argument, Table(config(4, size_t{1} << 31, 1)));
  CHECK_THROWS(std::invalid_argument, Table(config(4, size_t{1} << 32, 2)));
  // Defaults: shards chosen from capacity (a power of two), threads >= 1.
  TableConfig c = config(4, 4096, 0);
  c.num_threads = 0;
  Table t(c);
  CHECK(t.num_shards() >= 1 && (t.num_shards() & (t.num_shards() - 1)) == 0);
  CHECK(t.num_threads() >= 1);
  const TableStats st = t.stats();
  CHECK(st.capacity == 4096 && st.dim == 4 && st.num_shards == t.num_shards());
  CHECK(st.bytes_per_row >= 16.0);
}
