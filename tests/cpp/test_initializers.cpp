// File: tests/cpp/test_initializers.cpp
//
// Unit tests: initializers match docs/semantics.md and depend on nothing but (seed, id).
#include "helpers.hpp"

// =======================================================================================
// Initializers
// =======================================================================================

TEST_CASE(initializer_matches_docs_formula) {
  const Ids ids = {0, 1, 2, 12345, 1ULL << 63, kMaxId - 1, kMaxId};
  for (uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{42}, kMaxId}) {
    for (size_t dim : {1, 2, 5, 16}) {
      const InitializerConfig cases[] = {zeros(), uniform(-0.25, 0.75, seed),
                                         normal(0.5, 0.1, seed), truncated(-1.0, 2.0, seed)};
      for (const InitializerConfig& init : cases) {
        for (uint64_t id : ids) {
          Floats row(dim, kNaN);
          initial_row(init, id, row.data(), dim);
          const Floats want = doc_initial_row(init, id, dim);
          for (size_t j = 0; j < dim; ++j) {
            if (init.kind == InitializerKind::kZeros || init.kind == InitializerKind::kUniform) {
              CHECK(row[j] == want[j]);  // exact
            } else {
              // libm log/cos/sin: allow the last float bit.
              CHECK(std::fabs(row[j] - want[j]) <= 1e-6f * std::max(1.0f, std::fabs(want[j])));
            }
            if (init.kind == InitializerKind::kUniform) CHECK(row[j] >= -0.25f && row[j] <= 0.75f);
            if (init.kind == InitializerKind::kTruncatedNormal) {
              CHECK(row[j] >= -1.0f - 4.0f - 1e-5f && row[j] <= -1.0f + 4.0f + 1e-5f);
            }
          }
        }
      }
    }
  }
  // Different seeds give different rows.
  Floats r1(8), r2(8);
  initial_row(uniform(-1, 1, 1), 5, r1.data(), 8);
  initial_row(uniform(-1, 1, 2), 5, r2.data(), 8);
  CHECK(r1 != r2);
}

TEST_CASE(initializer_independent_of_shards_order_threads_capacity) {
  const InitializerConfig inits[] = {uniform(-1, 1, 7), normal(0, 0.1, 8), truncated(0, 1, 9)};
  Ids ids = {0, kMaxId};
  for (uint64_t k = 1; k < 3000; ++k) ids.push_back(k * 0x9E3779B97F4A7C15ULL + k);
  for (const InitializerConfig& init : inits) {
    const size_t dim = 7;
    Table base(config(dim, 8192, 1, Eviction::kNone, sgd(0.1f), init));
    const Floats want = lookup(base, ids);
    CHECK_BITS_EQ(want, initial(base, ids));
    // Other shard counts, reversed / shuffled insertion in small batches, 4 threads.
    std::mt19937_64 rng(3);
    for (size_t shards : {2, 16, 64}) {
      Table t(config(dim, 8192, shards, Eviction::kNone, sgd(0.1f), init, 4));
      Ids order = ids;
      if (shards == 2) std::reverse(order.begin(), order.end());
      if (shards != 2) std::shuffle(order.begin(), order.end(), rng);
      for (size_t lo = 0; lo < order.size(); lo += 97) {
        lookup(t,
               Ids(order.begin() + static_cast<std::ptrdiff_t>(lo),
                   order.begin() + static_cast<std::ptrdiff_t>(std::min(order.size(), lo + 97))));
      }
      CHECK_BITS_EQ(lookup(t, ids, false), want);
      CHECK_BITS_EQ(initial(t, ids), want);
    }
    // A tiny evicting table: a row evicted and re-inserted comes back as its initial row;
    // rows inserted by apply_gradients start from the same row (checked via SGD with g=0).
    Table small(config(dim, 4, 1, Eviction::kClock, sgd(0.1f), init));
    for (size_t i = 0; i < 50; ++i) {
      const Ids one = {ids[i % 10]};
      CHECK_BITS_EQ(lookup(small, one), slice(want, i % 10, dim));
    }
    Table via_apply(config(dim, 64, 1, Eviction::kClock, sgd(0.1f), init));
    const Ids some(ids.begin(), ids.begin() + 20);
    apply(via_apply, some, Floats(20 * dim, 0.0f));
    CHECK_BITS_EQ(lookup(via_apply, some, false),
                  Floats(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(20 * dim)));
  }
}
