// File: tests/cpp/test_clock.cpp
//
// Unit tests: CLOCK eviction, free-list reuse and capacity errors, against the reference.
#include "helpers.hpp"
#include "reference_table.hpp"

// =======================================================================================
// CLOCK on a one-shard table (docs/semantics.md "Eviction")
// =======================================================================================

TEST_CASE(clock_scripted_sequences) {
  // ids: 0 and 2^64-1 are ordinary.
  const uint64_t a = 0, b = kMaxId, c = 7, d = 1234567, e = 1ULL << 63, f = 99, g = 5, h = 6, i = 8,
                 j = 9, k = 10;
  const Ids universe = {a, b, c, d, e, f, g, h, i, j, k};
  Table t(config(2, 4, 1, Eviction::kClock, sgd(0.5f), uniform(-1, 1, 3)));
  RefTable ref(2, sgd(0.5f), uniform(-1, 1, 3), 4);
  auto step = [&](const Ids& keys, bool insert, const std::set<uint64_t>& expect) {
    CHECK_FLOATS_EQ(lookup(t, keys, insert), ref.lookup(keys, insert));
    const std::set<uint64_t> got = present(t, universe);
    CHECK_MSG(got == expect, "present " + describe(got) + " expected " + describe(expect));
    CHECK_MSG(ref.ids() == expect, "reference model disagrees with the hand prediction");
    CHECK_STATS(t, ref);
  };
  // The ring is rows in insertion order; each insert sets the bit.
  step({a}, true, {a});
  step({b}, true, {a, b});
  step({c, d}, true, {a, b, c, d});
  // Full, every bit set: the hand clears a, b, c, d and comes back to a.
  step({e}, true, {b, c, d, e});
  // Hand at b (bit cleared by the sweep): b goes.
  step({f}, true, {c, d, e, f});
  // Touch c (a hit sets the bit); the hand skips c (clearing it) and takes d.
  step({c}, true, {c, d, e, f});
  step({g}, true, {c, e, f, g});
  // Ring [e f c g], hand at e: e and f were set on insert (cleared now), c was cleared: c goes.
  step({h}, true, {e, f, g, h});
  // contains() sets no bit, lookup(insert=false) on a hit does: f survives, e goes.
  CHECK(contains(t, {e})[0]);
  step({f}, false, {e, f, g, h});
  // Ring [e f h g], hand at g (set on insert): clear g, then e is clear: e goes.
  step({i}, true, {f, g, h, i});
  // A miss with insert=false inserts nothing and sets no bit.
  step({j}, false, {f, g, h, i});
  // Ring [i f h g], hand at f (set): clear f, clear h, g clear: g goes.
  step({k}, true, {f, h, i, k});
  const TableStats st = t.stats();
  CHECK(st.inserts == 10 && st.evictions == 6 && st.size == 4 && st.hits == 2 && st.misses == 11);
  CHECK(st.inserts - st.evictions - st.erased == st.size);

  // Within one batch an id inserted earlier may be evicted by a later insert; its row was
  // already copied out (the initial row).
  Table t2(config(3, 4, 1, Eviction::kClock, sgd(0.5f), uniform(-1, 1, 3)));
  const Ids batch = {a, b, c, d, e, f};
  CHECK_FLOATS_EQ(lookup(t2, batch), initial(t2, batch));
  const std::set<uint64_t> expect2 = {c, d, e, f};
  CHECK(present(t2, universe) == expect2);
  CHECK(t2.stats().evictions == 2);
  // A repeated missing id counts one miss (+ insert) and then hits.
  Table t3(config(3, 4, 1));
  lookup(t3, {j, j, j});
  CHECK(t3.stats().misses == 1 && t3.stats().hits == 2 && t3.stats().inserts == 1);
}

// Long random sequences of lookup/contains/erase/apply on small one-shard tables, compared
// after every operation with the reference CLOCK model (ring, bits, hand, LIFO free list).
TEST_CASE(clock_random_sequences_match_reference) {
  for (size_t capacity : {1, 2, 3, 4, 5, 8}) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      const size_t dim = 3;
      const OptimizerConfig opt = seed == 2 ? adagrad(0.25f, 1e-8f, 0.1f) : sgd(0.5f);
      const InitializerConfig init = uniform(-1, 1, seed);
      Table t(config(dim, capacity, 1, Eviction::kClock, opt, init));
      RefTable ref(dim, opt, init, capacity);
      std::mt19937_64 rng(seed * 1000 + capacity);
      Ids universe;
      for (uint64_t id = 0; id < 3 * capacity + 2; ++id)
        universe.push_back(id * 0x9E3779B97F4A7C15ULL);
      universe.push_back(kMaxId);
      auto pick = [&](size_t n) {
        Ids keys(n);
        for (uint64_t& id : keys) id = universe[rng() % universe.size()];
        return keys;
      };
      for (int op = 0; op < 400; ++op) {
        const std::string where = "capacity=" + std::to_string(capacity) +
                                  " seed=" + std::to_string(seed) + " op=" + std::to_string(op);
        const int kind = static_cast<int>(rng() % 6);
        if (kind <= 1) {
          const Ids keys = pick(1 + rng() % 3);
          const bool insert = kind == 0;
          CHECK_FLOATS_EQ(lookup(t, keys, insert), ref.lookup(keys, insert));
        } else if (kind == 2) {
          const Ids keys = pick(rng() % 3);
          CHECK(t.erase(keys.data(), keys.size()) == ref.erase(keys));
        } else if (kind == 3) {
          const Ids keys = pick(4);
          CHECK(contains(t, keys) == ref.contains(keys));
        } else if (kind == 4) {
          // apply_gradients with every distinct id present (no eviction inside the call).
          Ids keys;
          for (uint64_t id : pick(3)) {
            if (ref.has(id)) keys.push_back(id);
          }
          const Floats grads = random_floats(rng, keys.size() * dim, -1, 1);
          apply(t, keys, grads);
          ref.apply(keys, grads, nullptr, nullptr, PoolMode::kSum);
        } else {
          // apply_gradients on ids all missing (inserted, pinned as they come).
          Ids keys;
          for (uint64_t id : pick(std::min<size_t>(capacity, 2))) {
            if (!ref.has(id) && std::find(keys.begin(), keys.end(), id) == keys.end()) {
              keys.push_back(id);
            }
          }
          const Floats grads = random_floats(rng, keys.size() * dim, -1, 1);
          apply(t, keys, grads);
          ref.apply(keys, grads, nullptr, nullptr, PoolMode::kSum);
        }
        const std::set<uint64_t> got = present(t, universe);
        CHECK_MSG(got == ref.ids(),
                  where + ": present " + describe(got) + " reference " + describe(ref.ids()));
        CHECK_STATS(t, ref);
      }
      // Final values (read through the reference too, so bits stay in step).
      const std::set<uint64_t> ids_now = ref.ids();
      const Ids all(ids_now.begin(), ids_now.end());
      CHECK_FLOATS_EQ(lookup(t, all, false), ref.lookup(all, false));
    }
  }
}

TEST_CASE(free_list_reuse_after_erase) {
  const uint64_t a = 1, b = 2, c = 3, d = 4, e = 5, f = 6, g = 7, h = 8;
  const Ids universe = {a, b, c, d, e, f, g, h, 100};
  Table t(config(2, 4, 1));
  lookup(t, {a, b, c, d});
  const Ids to_erase = {b, b, 100, d};  // duplicates and missing ids count 0
  CHECK(t.erase(to_erase.data(), to_erase.size()) == 2);
  CHECK(t.size() == 2 && t.stats().erased == 2);
  CHECK((present(t, universe) == std::set<uint64_t>{a, c}));
  // Freed rows are reused before anything is evicted, most recently freed (d's row 3) first:
  // e takes row 3, f takes row 1.
  lookup(t, {e});
  lookup(t, {f});
  CHECK(t.stats().evictions == 0);
  CHECK(t.size() == 4);
  // Ring [a f c e], every bit set: the sweep clears all and takes a (row 0); then the hand
  // is at row 1, which holds f (LIFO reuse; with FIFO reuse it would hold e).
  lookup(t, {g});
  CHECK((present(t, universe) == std::set<uint64_t>{c, e, f, g}));
  lookup(t, {h});
  CHECK((present(t, universe) == std::set<uint64_t>{c, e, g, h}));
  const TableStats st = t.stats();
  CHECK(st.evictions == 2 && st.inserts == 8 && st.erased == 2 && st.size == 4);
  CHECK(st.inserts - st.evictions - st.erased == st.size);
  // Erase everything, then refill without evicting; erased rows read as misses.
  const Ids all = {c, e, g, h};
  CHECK(t.erase(all.data(), all.size()) == 4);
  CHECK(t.size() == 0);
  CHECK_FLOATS_EQ(lookup(t, all, false), Floats(8, 0.0f));
  lookup(t, {a, b, c, d});
  CHECK(t.stats().evictions == 2 && t.size() == 4);
  // A multi-shard table: erase then insert as many ids, no eviction.
  Table m(config(4, 256, 4));
  Ids ids;
  for (uint64_t id = 0; id < 150; ++id) ids.push_back(id * 31 + 7);
  lookup(m, ids);
  const Ids half(ids.begin(), ids.begin() + 75);
  CHECK(m.erase(half.data(), half.size()) == 75);
  Ids fresh;
  for (uint64_t id = 0; id < 75; ++id) fresh.push_back(1000000 + id);
  lookup(m, fresh);
  CHECK(m.stats().evictions == 0 && m.size() == 150);
  CHECK_FLOATS_EQ(lookup(m, fresh, false), initial(m, fresh));
}

TEST_CASE(eviction_none_throws_capacity_error) {
  Table t(config(2, 4, 1, Eviction::kNone));
  lookup(t, {1, 2, 3, 4});
  CHECK_THROWS(CapacityError, lookup(t, {5}));
  CHECK_THROWS(std::runtime_error, lookup(t, {5}));  // CapacityError is a runtime_error
  CHECK(t.size() == 4);
  CHECK((present(t, {1, 2, 3, 4, 5}) == std::set<uint64_t>{1, 2, 3, 4}));
  CHECK(t.stats().evictions == 0);
  // Hits and read-only misses still work on a full table.
  CHECK_FLOATS_EQ(lookup(t, {1, 2}), initial(t, {1, 2}));
  CHECK_FLOATS_EQ(lookup(t, {5}, false), Floats(2, 0.0f));
  // Rows already inserted by the failing call stay.
  CHECK(t.erase(Ids{1}.data(), 1) == 1);
  CHECK_THROWS(CapacityError, lookup(t, {6, 7}));
  CHECK((present(t, {1, 2, 3, 4, 5, 6, 7}) == std::set<uint64_t>{2, 3, 4, 6}));
  CHECK_FLOATS_EQ(lookup(t, {6}, false), initial(t, {6}));
  // apply_gradients needing a row: CapacityError, nothing applied, table consistent.
  const Floats before = lookup(t, {2, 3}, false);
  CHECK_THROWS(CapacityError, apply(t, {2, 8, 3}, Floats(6, 1.0f)));
  CHECK(t.size() == 4);
  CHECK(!contains(t, {8})[0]);
  CHECK_FLOATS_EQ(lookup(t, {2, 3}, false), before);
  const TableStats st = t.stats();
  CHECK(st.inserts - st.evictions - st.erased == st.size);
  // Updates of present ids still work.
  apply(t, {2}, Floats{1.0f, 1.0f});
  CHECK(lookup(t, {2}, false)[0] == initial(t, {2})[0] - 0.5f);

  // Several shards: len(t) never exceeds capacity; an insert beyond it throws.
  Table m(config(2, 64, 4, Eviction::kNone));
  size_t inserted = 0;
  bool threw = false;
  for (uint64_t id = 0; id < 200 && !threw; ++id) {
    try {
      lookup(m, {id * 0x100000001ULL});
      ++inserted;
    } catch (const CapacityError&) {
      threw = true;
    }
    CHECK(m.size() <= 64);
  }
  CHECK(threw);
  CHECK(m.size() == inserted && inserted <= 64);
  CHECK(m.stats().evictions == 0);
}

TEST_CASE(clock_every_row_pinned_throws_capacity_error) {
  Table t(config(2, 2, 1, Eviction::kClock));
  apply(t, {1, 2}, Floats(4, 1.0f));  // two distinct rows: fits
  CHECK(t.size() == 2);
  // Three distinct ids in one call: the third finds both rows pinned.
  CHECK_THROWS(CapacityError, apply(t, {3, 4, 5}, Floats(6, 1.0f)));
  CHECK(t.size() <= 2);
  const TableStats st = t.stats();
  CHECK(st.inserts - st.evictions - st.erased == st.size);
  // The pins were released: a later insert can evict again.
  lookup(t, {10, 11, 12});
  CHECK(t.size() == 2);
  CHECK((present(t, {1, 2, 3, 4, 5, 10, 11, 12}) == std::set<uint64_t>{11, 12}));
  apply(t, {11, 12}, Floats(4, 1.0f));
  CHECK(lookup(t, {11}, false)[0] == initial(t, {11})[0] - 0.5f);
}

// docs/semantics.md: "A row that is the target of an update in the current apply_gradients
// call is pinned and never chosen as that call's victim." (tests/reference.py pins every id of
// the call for the whole call.) Here a present, trained row whose bit is clear sits at the
// hand, and the call inserts a missing id BEFORE it in the key order.
TEST_CASE(clock_apply_never_evicts_its_own_targets) {
  const uint64_t a = 1, b = 2, c = 3, d = 4, e = 5, f = 6;
  const Ids universe = {a, b, c, d, e, f};
  Table t(config(2, 4, 1, Eviction::kClock, sgd(0.5f)));
  RefTable ref(2, sgd(0.5f), uniform(-1, 1, 42), 4);
  auto both_lookup = [&](const Ids& k) { CHECK_FLOATS_EQ(lookup(t, k), ref.lookup(k, true)); };
  auto both_apply = [&](const Ids& k, const Floats& g) {
    apply(t, k, g);
    ref.apply(k, g, nullptr, nullptr, PoolMode::kSum);
  };
  both_lookup({a, b, c, d});
  both_apply({b}, Floats{1.0f, 1.0f});  // b trained
  both_lookup({e});                     // sweep clears all bits, evicts a; hand at b
  CHECK((present(t, universe) == std::set<uint64_t>{b, c, d, e}));
  // apply([f, b]): b is a target of this call, so f must evict c (b is pinned) and b
  // receives its second update on top of the first.
  both_apply({f, b}, Floats{1.0f, 1.0f, 1.0f, 1.0f});
  const std::set<uint64_t> got = present(t, universe);
  CHECK_MSG(got == ref.ids(), "present " + describe(got) + " reference " + describe(ref.ids()));
  CHECK_MSG(t.stats().evictions == ref.evictions,
            "evictions " + std::to_string(t.stats().evictions) + " reference " +
                std::to_string(ref.evictions));
  // b was trained twice: init - 0.5 - 0.5 (it must not have been evicted and re-initialised).
  const float b_now = lookup(t, {b}, false)[0];
  const float b_want = ref.weights(b)[0];
  CHECK_MSG(b_now == b_want, "row of b " + std::to_string(b_now) + " expected " +
                                 std::to_string(b_want) + " (init " +
                                 std::to_string(initial(t, {b})[0]) + ")");
}

// The same rule across shards. A 2-shard table whose rows all sit in shard 1; the call
// inserts an id of shard 0 (which has free rows but the table is full, so the core frees a
// row of another shard) and updates a trained id of shard 1 whose bit is clear at the hand.
// Shard tasks run in a rotating order, so the scenario is repeated with different rotations.
TEST_CASE(clock_apply_cross_shard_eviction_spares_batch_targets) {
  Ids in0, in1;
  for (uint64_t id = 1; in0.size() < 2 || in1.size() < 10; ++id) {
    ((mix64(id) >> 63) == 0 ? in0 : in1).push_back(id);  // 2 shards: the top hash bit
  }
  int lost = 0, reps = 0;
  std::string detail;
  for (int rep = 0; rep < 8; ++rep) {
    Table t(config(1, 8, 2, Eviction::kClock, sgd(0.5f), uniform(-1, 1, 42)));
    const Ids fill(in1.begin(), in1.begin() + 8);
    lookup(t, fill);
    if (t.size() != 8 || t.stats().evictions != 0) {
      std::printf("  (skipped: shard 1 cannot hold the whole capacity in this build)\n");
      return;
    }
    const uint64_t b1 = fill[1], x = in0[0];
    apply(t, {b1}, Floats{1.0f});
    lookup(t, {in1[8]});  // sweep clears every bit of shard 1, evicts fill[0]; hand at b1
    CHECK(!contains(t, {fill[0]})[0]);
    for (int k = 0; k < rep; ++k) contains(t, {x});  // shifts the task rotation
    apply(t, {x, b1}, Floats{1.0f, 1.0f});
    ++reps;
    const float want = (initial(t, {b1})[0] - 0.5f) - 0.5f;
    const float got = lookup(t, {b1}, false)[0];
    if (got != want) {
      ++lost;
      detail = "row of " + std::to_string(b1) + " = " + std::to_string(got) + ", expected " +
               std::to_string(want) + " (initial " + std::to_string(initial(t, {b1})[0]) +
               "): evicted and re-initialised by its own apply call; evictions=" +
               std::to_string(t.stats().evictions);
    }
  }
  CHECK_MSG(lost == 0,
            std::to_string(lost) + " of " + std::to_string(reps) + " rotations: " + detail);
}
