// File: tests/cpp/test_read_races.cpp
//
// Unit tests: lock-free reads meeting a writer.
#include "helpers.hpp"

// =======================================================================================
// Lock-free reads meeting a writer (docs/semantics.md "Threads")
// =======================================================================================

// A writer holds one shard's lock and is inside its write scope (the version is odd), with
// a row of that shard half-written (garbage here). A lookup_sum must not read that row:
// its read task is rejected (up front when it has >= 8 ids per shard and notes every
// shard's version at its start, else at its first probe of that shard) and redone row by
// row, which waits on the shard lock for that shard's ids and so reads the row only after
// the writer has put it back. Without either rejection the garbage reaches the sums.
TEST_CASE(reads_never_see_a_row_a_writer_is_inside) {
  const size_t dim = 4, shards = 8;
  for (const size_t per_bag : {size_t{1}, size_t{8}}) {
    Table t(config(dim, 4096, shards));
    const Ids ids = range_ids(0, 32 * per_bag);  // one task: 32 ids (4 per shard) or 256
    Offsets offsets;
    for (size_t b = 0; b <= 32; ++b) offsets.push_back(static_cast<int64_t>(b * per_bag));
    lookup(t, ids);  // insert every id
    const Floats expected = lookup_sum(t, ids, offsets, nullptr, PoolMode::kSum, false);
    const uint64_t retries_before = t.stats().read_retries;

    Shard& sh = TableTestAccess::shard_of_id(t, ids[0]);
    float* row = TableTestAccess::row_of_id(t, ids[0]);
    CHECK(row != nullptr);
    const Floats saved(row, row + dim);
    std::atomic<bool> writing{false}, read_done{false};
    std::thread writer([&] {
      const auto lock = sh.lock();
      Shard::WriteScope scope(sh);
      for (size_t d = 0; d < dim; ++d) row[d] = 1e30f;  // mid-change
      writing = true;
      // The reader cannot finish before the row is put back (it must wait on the lock);
      // if it does, the check below sees the garbage.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
      while (!read_done.load() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      std::copy(saved.begin(), saved.end(), row);
    });
    while (!writing.load()) std::this_thread::yield();
    const Floats got = lookup_sum(t, ids, offsets, nullptr, PoolMode::kSum, false);
    read_done = true;
    writer.join();
    CHECK_FLOATS_EQ(got, expected);
    CHECK_MSG(t.stats().read_retries > retries_before,
              "the read task was not redone (per_bag " + std::to_string(per_bag) + ")");
  }
}
