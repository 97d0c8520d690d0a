// File: tests/cpp/stress_index.cpp
//
// Seeded, time-bounded multi-thread stress of one embstore Table at a time: index and CLOCK
// eviction churn under concurrent lookup(insert=true/false), lookup_sum, apply_gradients
// (SGD), erase and contains, checked where exact checking is possible:
//
//  Phase 1 "churn" (small capacity, eviction="clock", Uniform initializer, dim 6):
//   (a) "fingerprint" ids (every 4th id of the universe) never receive a gradient, so their
//       rows must always read exactly their initial row (or zeros for a read-only miss); no
//       id ever receives a gradient in its upper half (elements 3..5), so EVERY row read must
//       carry its own id's initial upper half. A mismatch means another id's row, a stale or
//       a half-written row was returned. Pooled sums (insert=true) of those halves are exact.
//   (b) len(table) <= capacity at all times; at quiescence inserts - evictions - erased ==
//       size == number of universe ids contains() reports; hits + misses == ids looked up;
//       erased == sum of erase() results; a clock table never raises CapacityError here.
//  Phase 2 "exact" (capacity large, eviction="none"): threads apply power-of-two SGD
//       gradients (every element of a row gets the same gradient) to their own ids and to
//       shared ids, mixing per-id and pooled (weights, mean) forms; every value stays a
//       multiple of 2^-22 in [1, 4), so float arithmetic is exact and the final rows must
//       equal the exactly computed expectation, whatever the interleaving. Rows read while
//       updates run must be whole (the same delta on every element).
//  Both phases also run on a one-shard table with many threads contending on one lock.
//  Phase 1b "cross-shard": a full 2-shard table whose inserts into an empty shard must free
//       a row of the other, busy shard: eviction="clock" must not raise CapacityError.
//
// Usage: stress_index [--seconds S] [--threads N] [--seed X] [--skip PHASE]... [--verbose]
// (--seconds is the total over all phases; --skip drops the phases whose name starts with
// PHASE, e.g. "cross-shard" or "exact").
// Exit status 0 when no violation was seen.

#include <algorithm>  // std::min, std::max
#include <atomic>     // std::atomic
#include <chrono>     // std::chrono
#include <cmath>      // std::isfinite, std::ldexp
#include <cstdint>    // uint64_t, int64_t
#include <cstdio>     // std::printf, std::fprintf
#include <cstdlib>    // std::strtod, std::strtoull
#include <cstring>    // std::strcmp, std::memcmp
#include <exception>  // std::exception
#include <functional> // std::function
#include <limits>     // std::numeric_limits
#include <map>        // std::map
#include <memory>     // std::unique_ptr
#include <mutex>      // std::mutex
#include <random>     // std::mt19937_64
#include <stdexcept>  // std::invalid_argument
#include <string>     // std::string
#include <thread>     // std::thread
#include <vector>     // std::vector

#include "embstore/config.hpp"
#include "embstore/errors.hpp"
#include "embstore/hash.hpp"
#include "embstore/initializer.hpp"
#include "embstore/table.hpp"

#include "test_util.hpp"  // Ids, Floats, Offsets, random_offsets

namespace {

using namespace embstore;
using Clock = std::chrono::steady_clock;
using embstore_test::Floats;
using embstore_test::Ids;
using embstore_test::Offsets;
using embstore_test::random_offsets;
constexpr uint64_t kMaxId = std::numeric_limits<uint64_t>::max();

// ---- violations -------------------------------------------------------------------------

std::atomic<uint64_t> g_violations{0};
std::mutex g_log_mutex;
bool g_verbose = false;

void violation(const char* file, int line, const std::string& what) {
  const uint64_t n = g_violations.fetch_add(1) + 1;
  if (n <= 25 || g_verbose) {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    std::fprintf(stderr, "%s:%d: VIOLATION: %s\n", file, line, what.c_str());
  } else if (n == 26) {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    std::fprintf(stderr, "(further violations counted, not printed)\n");
  }
}

#define VIOLATION(msg) violation(__FILE__, __LINE__, (msg))
#define EXPECT(cond, msg)                                                          \
  do {                                                                             \
    if (!(cond)) violation(__FILE__, __LINE__, std::string(#cond) + ": " + (msg)); \
  } while (0)

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

std::string fmt(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

// ---- options --------------------------------------------------------------------------------

struct Options {
  double seconds = 5.0;
  size_t threads = 4;
  uint64_t seed = 12345;
  std::vector<std::string> skip;  // phase names (or name prefixes) not to run
};

[[noreturn]] void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--seconds S] [--threads N] [--seed X] [--skip PHASE]... [--verbose]\n"
               "phases: churn/shards8 churn/tiny churn/one-shard cross-shard exact/shards8\n"
               "        exact/one-shard exact/shards64 (--skip matches a name prefix)\n",
               argv0);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(argv[0]);
      return argv[++i];
    };
    if (std::strcmp(argv[i], "--seconds") == 0) {
      o.seconds = std::strtod(value(), nullptr);
    } else if (std::strcmp(argv[i], "--threads") == 0) {
      o.threads = std::strtoull(value(), nullptr, 10);
    } else if (std::strcmp(argv[i], "--seed") == 0) {
      o.seed = std::strtoull(value(), nullptr, 0);
    } else if (std::strcmp(argv[i], "--skip") == 0) {
      o.skip.emplace_back(value());
    } else if (std::strcmp(argv[i], "--verbose") == 0) {
      g_verbose = true;
    } else {
      usage(argv[0]);
    }
  }
  if (!(o.seconds > 0) || o.threads == 0 || o.threads > 256) usage(argv[0]);
  return o;
}

// ---- small helpers --------------------------------------------------------------------------

TableConfig make_config(size_t dim, size_t capacity, size_t shards, Eviction eviction, float lr,
                        double lo, double hi, uint64_t seed, size_t threads) {
  TableConfig c;
  c.dim = dim;
  c.capacity = capacity;
  c.num_shards = shards;
  c.num_threads = threads;
  c.eviction = eviction;
  c.optimizer.kind = OptimizerKind::kSgd;
  c.optimizer.lr = lr;
  c.initializer.kind = InitializerKind::kUniform;
  c.initializer.a = lo;
  c.initializer.b = hi;
  c.initializer.seed = seed;
  return c;
}

// A universe of n ids: 0 and 2^64-1 first, then scattered 64-bit values (distinct).
Ids make_universe(size_t n, uint64_t seed) {
  Ids ids = {0, kMaxId};
  for (uint64_t k = 0; ids.size() < n; ++k) {
    const uint64_t id = splitmix64(seed * 0x100000001B3ULL + k);
    if (id != 0 && id != kMaxId) ids.push_back(id);
  }
  return ids;
}

double elapsed_s(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Runs `body(thread_index)` on `threads` threads while the calling thread calls `monitor()`
// until they finish. Exceptions escaping a body are violations. A phase still running
// `seconds` + 60 s after it started is a hang (a deadlock, or a probe loop on a corrupt
// index): reported, then the process exits at once.
template <typename Body, typename Monitor>
void run_threads(size_t threads, double seconds, Body body, Monitor monitor) {
  const Clock::time_point start = Clock::now();
  std::atomic<size_t> running{threads};
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      try {
        body(t);
      } catch (const std::exception& e) {
        VIOLATION(std::string("thread ") + std::to_string(t) +
                  ": unexpected exception: " + e.what());
      }
      running.fetch_sub(1);
    });
  }
  while (running.load() != 0) {
    monitor();
    if (elapsed_s(start) > seconds + 60.0) {
      std::fprintf(stderr,
                   "VIOLATION: %zu of %zu threads still running %.0f s after a %.2f s "
                   "phase: hang (deadlock or endless probe)\n",
                   running.load(), threads, elapsed_s(start), seconds);
      std::fflush(stderr);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (std::thread& th : pool) th.join();
}

// =============================================================================================
// Phase 1: churn
// =============================================================================================

struct ChurnConfig {
  const char* name;
  size_t capacity;
  size_t shards;
  size_t threads;
  double seconds;
};

constexpr size_t kDim1 = 6;   // elements [0, 3) may be trained, [3, 6) never are
constexpr size_t kHalf = 3;

struct ChurnCounts {
  uint64_t ops = 0, looked_up = 0, erased = 0, applies = 0, big_batches = 0, bad_inputs = 0;
  uint64_t apply_capacity_errors = 0;
  uint64_t checked_rows = 0, checked_bags = 0;
};

void churn(const ChurnConfig& cc, uint64_t seed) {
  const size_t U = std::max<size_t>(4 * cc.capacity, 64);
  const Ids universe = make_universe(U, seed);
  const TableConfig cfg =
      make_config(kDim1, cc.capacity, cc.shards, Eviction::kClock, 0.05f, -1.0, 1.0, seed, 4);
  Table table(cfg);
  std::printf(
      "phase churn/%s: capacity=%zu shards=%zu (requested %zu) threads=%zu "
      "universe=%zu seconds=%.2f\n",
      cc.name, cc.capacity, table.num_shards(), cc.shards, cc.threads, U, cc.seconds);
  std::fflush(stdout);
  // Initial rows of the universe (the initializer is a pure function of (seed, id)).
  Floats init(U * kDim1);
  for (size_t k = 0; k < U; ++k) initial_row(cfg.initializer, universe[k], &init[k * kDim1], kDim1);
  auto is_fp = [](size_t k) { return k % 4 == 0; };  // fingerprint ids: never trained

  // Checks a row read for universe index k: `may_be_zero` for read-only lookups.
  auto check_row = [&](size_t k, const float* row, bool may_be_zero, const char* op) {
    bool zero = true;
    for (size_t j = 0; j < kDim1; ++j) zero = zero && row[j] == 0.0f && !std::signbit(row[j]);
    if (may_be_zero && zero) return;
    const size_t lo = is_fp(k) ? 0 : kHalf;
    for (size_t j = lo; j < kDim1; ++j) {
      if (!same_bits(row[j], init[k * kDim1 + j])) {
        VIOLATION(std::string(op) + ": id " + std::to_string(universe[k]) +
                  (is_fp(k) ? " (fingerprint)" : "") + " element " + std::to_string(j) + " = " +
                  fmt(row[j]) + ", its initial value is " + fmt(init[k * kDim1 + j]) +
                  " (another id's row, a stale row or a torn row)");
        return;
      }
    }
    for (size_t j = 0; j < kHalf; ++j) {
      if (!std::isfinite(row[j])) VIOLATION(std::string(op) + ": non-finite trained element");
    }
  };

  const Clock::time_point start = Clock::now();
  std::vector<ChurnCounts> counts(cc.threads);
  std::atomic<uint64_t> max_size{0};

  auto body = [&](size_t tid) {
    std::mt19937_64 rng(splitmix64(seed ^ (0xC0FFEEULL + tid)));
    ChurnCounts& cnt = counts[tid];
    std::vector<size_t> idx;
    Ids keys;
    Floats out, grads, weights;
    auto pick = [&](size_t n, bool trainable_only) {
      idx.resize(n);
      keys.resize(n);
      for (size_t i = 0; i < n; ++i) {
        size_t k = rng() % U;
        if (trainable_only && is_fp(k)) k = (k + 1 + rng() % 3) % U;  // k % 4 != 0
        // A few hot ids (more hits, more duplicates in a batch).
        if (!trainable_only && rng() % 4 == 0) k = rng() % 8;
        idx[i] = k;
        keys[i] = universe[k];
      }
    };
    while (elapsed_s(start) < cc.seconds) {
      ++cnt.ops;
      const unsigned op = static_cast<unsigned>(rng() % 100);
      try {
        if (op < 25 || (op >= 88 && op < 96)) {
          // lookup (insert=true for op < 25; read-only otherwise), sometimes a big batch that
          // runs on the thread pool.
          const bool big = rng() % 100 == 0;
          const size_t n = big ? 4096 + rng() % 4096 : 1 + rng() % 32;
          cnt.big_batches += big;
          pick(n, false);
          const bool insert = op < 25;
          out.assign(n * kDim1, std::numeric_limits<float>::quiet_NaN());
          table.lookup(keys.data(), n, insert, out.data());
          cnt.looked_up += n;
          for (size_t i = 0; i < n; ++i) check_row(idx[i], &out[i * kDim1], !insert, "lookup");
          cnt.checked_rows += n;
        } else if (op < 40) {
          // contains (no effect) and read-only lookups of the same ids.
          const size_t n = 1 + rng() % 32;
          pick(n, false);
          std::unique_ptr<bool[]> c(new bool[n]);
          table.contains(keys.data(), n, c.get());
          out.assign(n * kDim1, std::numeric_limits<float>::quiet_NaN());
          table.lookup(keys.data(), n, false, out.data());
          cnt.looked_up += n;
          for (size_t i = 0; i < n; ++i)
            check_row(idx[i], &out[i * kDim1], true, "lookup(insert=false)");
        } else if (op < 60) {
          // lookup_sum: insert=true bags are exact on the upper half (and on fingerprint-only
          // bags entirely); read-only bags of one id are that id's row or zeros.
          const bool insert = op < 55;
          const bool big = rng() % 100 == 0;
          const size_t n = big ? 4096 + rng() % 4096 : rng() % 24;
          cnt.big_batches += big;
          const bool fp_only = rng() % 3 == 0;
          pick(n, false);
          if (fp_only) {
            for (size_t i = 0; i < n; ++i) {
              idx[i] = idx[i] / 4 * 4;
              keys[i] = universe[idx[i]];
            }
          }
          const size_t bags = 1 + (big ? n / 4 : rng() % 8);
          const Offsets off = random_offsets(rng, n, bags);
          const bool weighted = rng() % 2 == 0;
          const PoolMode mode = rng() % 2 ? PoolMode::kMean : PoolMode::kSum;
          weights.resize(n);
          for (float& w : weights) w = std::ldexp(static_cast<float>(rng() % 7) - 3.0f, -1);
          out.assign(bags * kDim1, std::numeric_limits<float>::quiet_NaN());
          table.lookup_sum(keys.data(), n, off.data(), bags, weighted ? weights.data() : nullptr,
                           mode, insert, out.data());
          cnt.looked_up += n;
          for (size_t b = 0; b < bags; ++b) {
            const size_t lo = static_cast<size_t>(off[b]), hi = static_cast<size_t>(off[b + 1]);
            bool all_fp = true;
            for (size_t i = lo; i < hi; ++i) all_fp = all_fp && is_fp(idx[i]);
            if (!insert) {
              if (hi - lo != 1) continue;
              bool zero = true;
              for (size_t j = 0; j < kDim1; ++j) zero = zero && out[b * kDim1 + j] == 0.0f;
              if (zero) continue;  // a miss (or a row that pools to zero)
            }
            for (size_t j = (all_fp ? 0 : kHalf); j < kDim1; ++j) {
              float s = 0.0f;
              for (size_t i = lo; i < hi; ++i) {
                const float r = init[idx[i] * kDim1 + j];
                s = weighted ? s + weights[i] * r : s + r;
              }
              if (mode == PoolMode::kMean && hi > lo) s = s / static_cast<float>(hi - lo);
              if (!same_bits(out[b * kDim1 + j], s)) {
                VIOLATION(std::string("lookup_sum(insert=") + (insert ? "true" : "false") +
                          "): bag " + std::to_string(b) + " of " + std::to_string(hi - lo) +
                          " ids, element " + std::to_string(j) + " = " + fmt(out[b * kDim1 + j]) +
                          ", expected " + fmt(s));
                break;
              }
            }
            ++cnt.checked_bags;
          }
        } else if (op < 80) {
          // apply_gradients (SGD) on trainable ids, lower half only; at most 8 ids per call
          // so a shard can never be entirely pinned by one call.
          ++cnt.applies;
          const size_t n = 1 + rng() % 8;
          pick(n, true);
          const bool pooled = rng() % 2 == 0;
          const size_t rows = pooled ? 1 + rng() % 4 : n;
          grads.assign(rows * kDim1, 0.0f);
          for (size_t r = 0; r < rows; ++r) {
            for (size_t j = 0; j < kHalf; ++j) {
              grads[r * kDim1 + j] =
                  static_cast<float>(static_cast<int>(rng() % 201) - 100) / 100.0f;
            }
          }
          if (pooled) {
            const Offsets off = random_offsets(rng, n, rows);
            weights.resize(n);
            for (float& w : weights) w = static_cast<float>(rng() % 5) - 2.0f;
            const bool weighted = rng() % 2 == 0;
            table.apply_gradients(keys.data(), n, grads.data(), off.data(), rows,
                                  weighted ? weights.data() : nullptr,
                                  rng() % 2 ? PoolMode::kMean : PoolMode::kSum);
          } else {
            table.apply_gradients(keys.data(), n, grads.data(), nullptr, 0, nullptr,
                                  PoolMode::kSum);
          }
        } else if (op < 88) {
          const size_t n = 1 + rng() % 4;
          pick(n, false);
          cnt.erased += table.erase(keys.data(), n);
        } else if (op < 98) {
          // Bad input: rejected before anything changes (so it counts nothing either).
          ++cnt.bad_inputs;
          const size_t n = 1 + rng() % 4;
          pick(n, true);
          grads.assign(n * kDim1, 0.25f);
          grads[rng() % grads.size()] = std::numeric_limits<float>::quiet_NaN();
          bool threw = false;
          try {
            table.apply_gradients(keys.data(), n, grads.data(), nullptr, 0, nullptr,
                                  PoolMode::kSum);
          } catch (const std::invalid_argument&) {
            threw = true;
          }
          EXPECT(threw, "NaN gradient accepted");
          const Offsets bad = {0, static_cast<int64_t>(n) + 1};
          threw = false;
          out.assign(kDim1, 0.0f);
          try {
            table.lookup_sum(keys.data(), n, bad.data(), 1, nullptr, PoolMode::kSum, true,
                             out.data());
          } catch (const std::invalid_argument&) {
            threw = true;
          }
          EXPECT(threw, "bad offsets accepted");
        } else {
          const TableStats st = table.stats();
          EXPECT(st.size <= cc.capacity, "stats().size " + std::to_string(st.size));
        }
      } catch (const CapacityError& e) {
        if (op >= 60 && op < 80) {
          // apply_gradients: errors.hpp allows CapacityError when every row of the shard is
          // pinned by the call; with <= 8 ids a call can pin every row a shard holds (tiny
          // capacity), and then the row must come from another shard. Counted, reported.
          ++cnt.apply_capacity_errors;
        } else {
          // lookup/lookup_sum pin nothing: with eviction="clock" a row can always be had.
          VIOLATION(std::string("CapacityError with eviction=clock from a lookup (op ") +
                    std::to_string(op) + "): " + e.what());
        }
      }
    }
  };
  auto monitor = [&] {
    const size_t s = table.size();
    if (s > max_size.load()) max_size.store(s);
    EXPECT(s <= cc.capacity, "len(table) = " + std::to_string(s) + " > capacity");
  };
  run_threads(cc.threads, cc.seconds, body, monitor);

  // ---- quiescence -----------------------------------------------------------------------
  ChurnCounts total;
  for (const ChurnCounts& c : counts) {
    total.ops += c.ops;
    total.looked_up += c.looked_up;
    total.erased += c.erased;
    total.applies += c.applies;
    total.big_batches += c.big_batches;
    total.bad_inputs += c.bad_inputs;
    total.checked_rows += c.checked_rows;
    total.checked_bags += c.checked_bags;
    total.apply_capacity_errors += c.apply_capacity_errors;
  }
  const TableStats st = table.stats();
  std::printf(
      "  ops=%llu applies=%llu big=%llu bad=%llu rows_checked=%llu bags_checked=%llu | "
      "size=%zu max_seen=%llu hits=%llu misses=%llu inserts=%llu evictions=%llu "
      "erased=%llu\n",
      (unsigned long long)total.ops, (unsigned long long)total.applies,
      (unsigned long long)total.big_batches, (unsigned long long)total.bad_inputs,
      (unsigned long long)total.checked_rows, (unsigned long long)total.checked_bags, st.size,
      (unsigned long long)max_size.load(), (unsigned long long)st.hits,
      (unsigned long long)st.misses, (unsigned long long)st.inserts,
      (unsigned long long)st.evictions, (unsigned long long)st.erased);
  std::fflush(stdout);
  if (total.apply_capacity_errors != 0) {
    std::printf(
        "  note: %llu apply_gradients calls raised CapacityError (every row the id's "
        "shard held was pinned by the call while the shard had to evict: the documented "
        "case of docs/semantics.md)\n",
        (unsigned long long)total.apply_capacity_errors);
  }
  EXPECT(st.size <= cc.capacity, "size " + std::to_string(st.size));
  EXPECT(st.size == table.size(), "stats().size != len(table)");
  EXPECT(st.inserts - st.evictions - st.erased == st.size,
         "inserts " + std::to_string(st.inserts) + " - evictions " + std::to_string(st.evictions) +
             " - erased " + std::to_string(st.erased) + " != size " + std::to_string(st.size));
  EXPECT(st.hits + st.misses == total.looked_up,
         "hits + misses = " + std::to_string(st.hits + st.misses) + ", ids looked up " +
             std::to_string(total.looked_up));
  EXPECT(st.erased == total.erased, "stats().erased " + std::to_string(st.erased) +
                                        ", erase() returned " + std::to_string(total.erased));
  EXPECT(st.evictions > 0, "the churn phase never evicted (test too weak)");
  // The index agrees with the size, and every stored row is its own id's.
  std::unique_ptr<bool[]> c(new bool[U]);
  table.contains(universe.data(), U, c.get());
  Ids present;
  std::vector<size_t> present_idx;
  for (size_t k = 0; k < U; ++k) {
    if (c[k]) {
      present.push_back(universe[k]);
      present_idx.push_back(k);
    }
  }
  EXPECT(present.size() == st.size, "contains() finds " + std::to_string(present.size()) +
                                        " universe ids, size is " + std::to_string(st.size));
  Floats rows(present.size() * kDim1);
  table.lookup(present.data(), present.size(), false, rows.data());
  for (size_t i = 0; i < present.size(); ++i) {
    check_row(present_idx[i], &rows[i * kDim1], false, "final lookup");
  }
  const TableStats st2 = table.stats();
  EXPECT(st2.hits == st.hits + present.size() && st2.misses == st.misses,
         "a final read-only lookup of present ids did not count as hits only");
  // Erase everything: empty, consistent.
  EXPECT(table.erase(present.data(), present.size()) == present.size(), "erase of present ids");
  const TableStats st3 = table.stats();
  EXPECT(st3.size == 0 && table.size() == 0, "not empty after erasing every present id");
  EXPECT(st3.inserts - st3.evictions - st3.erased == 0, "counters after erasing everything");
  table.contains(universe.data(), U, c.get());
  for (size_t k = 0; k < U; ++k) EXPECT(!c[k], "id present after erasing everything");
}

// =============================================================================================
// Phase 1b: cross-shard eviction under contention
// =============================================================================================
//
// Two shards, capacity 8, every row in shard 1 (each shard may own the whole capacity). One
// thread repeatedly erases and re-inserts an id of shard 0: with the table full and shard 0
// empty, the insert must free a row of shard 1 while the other threads keep shard 1 busy with
// inserting lookups. eviction="clock" and no call pins anything, so docs/semantics.md allows no
// CapacityError here. No gradients: every row read must be its id's initial row.
void cross_shard(size_t threads, double seconds, uint64_t seed) {
  const size_t dim = 4, capacity = 8;
  const TableConfig cfg = make_config(dim, capacity, 2, Eviction::kClock, 0.1f, -1.0, 1.0, seed, 1);
  Table table(cfg);
  std::printf("phase cross-shard: capacity=%zu shards=2 threads=%zu seconds=%.2f\n", capacity,
              threads, seconds);
  std::fflush(stdout);
  Ids in0, in1;
  for (uint64_t id = seed; in0.size() < 1 || in1.size() < 1024; ++id) {
    ((mix64(id) >> 63) == 0 ? in0 : in1).push_back(id);  // 2 shards: the top hash bit
  }
  auto init_of = [&](uint64_t id) {
    Floats r(dim);
    initial_row(cfg.initializer, id, r.data(), dim);
    return r;
  };
  const Floats x_init = init_of(in0[0]);
  std::atomic<uint64_t> capacity_errors{0}, attempts{0}, wrong_rows{0};
  std::string first_error;
  std::mutex first_mutex;
  const Clock::time_point start = Clock::now();
  auto body = [&](size_t tid) {
    std::mt19937_64 rng(splitmix64(seed ^ (0x5EED5ULL + tid)));
    Floats out;
    if (tid == 0) {
      const uint64_t x = in0[0];
      while (elapsed_s(start) < seconds) {
        table.erase(&x, 1);
        // Wait (bounded) until the others have refilled the table.
        while (table.size() < capacity && elapsed_s(start) < seconds) std::this_thread::yield();
        out.assign(dim, 0.0f);
        attempts.fetch_add(1);
        try {
          table.lookup(&x, 1, true, out.data());
          for (size_t j = 0; j < dim; ++j) {
            if (!same_bits(out[j], x_init[j])) {
              wrong_rows.fetch_add(1);
              break;
            }
          }
        } catch (const CapacityError& e) {
          if (capacity_errors.fetch_add(1) == 0) {
            std::lock_guard<std::mutex> lock(first_mutex);
            first_error = e.what();
          }
        }
      }
      return;
    }
    Ids keys(64);
    while (elapsed_s(start) < seconds) {
      for (uint64_t& id : keys) id = in1[rng() % in1.size()];
      out.assign(keys.size() * dim, 0.0f);
      table.lookup(keys.data(), keys.size(), true, out.data());
      for (size_t i = 0; i < keys.size(); ++i) {
        const Floats want = init_of(keys[i]);
        if (std::memcmp(&out[i * dim], want.data(), dim * sizeof(float)) != 0)
          wrong_rows.fetch_add(1);
      }
    }
  };
  auto monitor = [&] {
    EXPECT(table.size() <= capacity, "len(table) = " + std::to_string(table.size()));
  };
  run_threads(std::max<size_t>(threads, 2), seconds, body, monitor);
  const TableStats st = table.stats();
  std::printf("  re-inserts=%llu capacity_errors=%llu | size=%zu evictions=%llu\n",
              (unsigned long long)attempts.load(), (unsigned long long)capacity_errors.load(),
              st.size, (unsigned long long)st.evictions);
  std::fflush(stdout);
  EXPECT(wrong_rows.load() == 0, std::to_string(wrong_rows.load()) + " rows were not their id's");
  EXPECT(st.inserts - st.evictions - st.erased == st.size, "counters");
  if (capacity_errors.load() != 0) {
    VIOLATION("eviction=clock raised CapacityError on " + std::to_string(capacity_errors.load()) +
              " of " + std::to_string(attempts.load()) +
              " inserts of a shard-0 id while shard 1 was busy (no row pinned): " + first_error);
  }
}

// =============================================================================================
// Phase 2: exact concurrent SGD
// =============================================================================================

struct ExactConfig {
  const char* name;
  size_t shards;
  size_t threads;
  double seconds;
};

// Values: initial rows in [2, 3) (multiples of 2^-22); each occurrence moves a row by
// c * k * 2^-16 with k in [-3, 3] and c in {1/8, ..., 2} (a multiple of 2^-19); every thread
// keeps its own running total per id within +-kBound units, so all values stay in [1.5, 3.5]
// and every float operation of the core is exact.
constexpr size_t kDim2 = 4;
constexpr int kUnitExp = -19;  // one unit = 2^-19
constexpr float kLr2 = 0.0625f;  // 2^-4; gradient element = k * 2^-12

void exact_sgd(const ExactConfig& ec, uint64_t seed) {
  const size_t own_per_thread = 16, shared = 16;
  const size_t n_ids = shared + own_per_thread * ec.threads;
  const Ids ids = make_universe(n_ids, seed ^ 0xABCDEF);  // [0, shared): shared (0 and max)
  const TableConfig cfg =
      make_config(kDim2, 8 * n_ids, ec.shards, Eviction::kNone, kLr2, 2.0, 3.0, seed, 4);
  Table table(cfg);
  std::printf("phase exact/%s: ids=%zu (shared %zu) shards=%zu threads=%zu seconds=%.2f\n", ec.name,
              n_ids, shared, table.num_shards(), ec.threads, ec.seconds);
  std::fflush(stdout);
  Floats init(n_ids * kDim2);
  for (size_t k = 0; k < n_ids; ++k) initial_row(cfg.initializer, ids[k], &init[k * kDim2], kDim2);
  const int64_t bound = (int64_t{1} << 19) / static_cast<int64_t>(2 * ec.threads + 2);

  // Per thread: units applied to every id (only its own and the shared ones are non-zero).
  std::vector<std::vector<int64_t>> units(ec.threads, std::vector<int64_t>(n_ids, 0));
  std::vector<uint64_t> calls(ec.threads, 0), reads(ec.threads, 0);
  const Clock::time_point start = Clock::now();

  // A row read while others update it: one delta on every element, a whole number of units.
  auto check_whole = [&](size_t k, const float* row, const char* op) {
    const double d0 = static_cast<double>(row[0]) - init[k * kDim2];
    for (size_t j = 1; j < kDim2; ++j) {
      const double dj = static_cast<double>(row[j]) - init[k * kDim2 + j];
      if (dj != d0) {
        VIOLATION(std::string(op) + ": torn row for id " + std::to_string(ids[k]) + ": delta " +
                  fmt(d0) + " on element 0, " + fmt(dj) + " on element " + std::to_string(j));
        return;
      }
    }
    const double u = std::ldexp(d0, -kUnitExp);
    EXPECT(u == static_cast<double>(static_cast<int64_t>(u)) && std::fabs(d0) < 1.0,
           std::string(op) + ": id " + std::to_string(ids[k]) + " moved by " + fmt(d0));
  };

  auto body = [&](size_t tid) {
    std::mt19937_64 rng(splitmix64(seed ^ (0xE4AC7ULL + tid)));
    std::vector<int64_t>& mine = units[tid];
    const size_t own_lo = shared + tid * own_per_thread;
    std::vector<size_t> idx;
    Ids keys;
    Floats grads, weights, out;
    std::vector<int64_t> delta(n_ids);
    while (elapsed_s(start) < ec.seconds) {
      // A batch of own and shared ids with duplicates.
      const size_t n = 1 + rng() % 12;
      idx.resize(n);
      keys.resize(n);
      for (size_t i = 0; i < n; ++i) {
        idx[i] = rng() % 2 ? own_lo + rng() % own_per_thread : rng() % shared;
        keys[i] = ids[idx[i]];
      }
      const bool pooled = rng() % 2 == 0;
      Offsets off;
      size_t rows = n;
      bool weighted = false;
      PoolMode mode = PoolMode::kSum;
      if (pooled) {
        // Bags of 1, 2 or 4 ids (so 1/count is exact), weights in {1/2, 1, 2}.
        off = {0};
        while (static_cast<size_t>(off.back()) < n) {
          const int64_t size = int64_t{1} << (rng() % 3);
          off.push_back(std::min<int64_t>(off.back() + size, static_cast<int64_t>(n)));
          if (rng() % 4 == 0) off.push_back(off.back());  // an empty bag
        }
        // Bag sizes must stay powers of two: a shortened last bag gets padded to one id.
        for (size_t b = 0; b + 1 < off.size(); ++b) {
          const int64_t size = off[b + 1] - off[b];
          if (size == 3) {  // only a truncated 4 can be 3: split into 2 + 1
            off.insert(off.begin() + static_cast<std::ptrdiff_t>(b) + 1, off[b] + 2);
          }
        }
        rows = off.size() - 1;
        weighted = rng() % 2 == 0;
        mode = rng() % 2 ? PoolMode::kMean : PoolMode::kSum;
        weights.resize(n);
        for (float& w : weights) w = std::ldexp(1.0f, static_cast<int>(rng() % 3) - 1);
      }
      // One k per gradient row; the units each occurrence adds (before the sign check).
      std::vector<int> k(rows);
      for (int& kk : k) kk = static_cast<int>(rng() % 7) - 3;
      auto occurrence_units = [&](size_t i, size_t row) -> int64_t {
        // delta w = -lr * c * k * 2^-12 = -c * k * 2^-16 = -(8 c k) units.
        double c = 1.0;
        if (pooled) {
          if (weighted) c = weights[i];
          if (mode == PoolMode::kMean) c = c / static_cast<double>(off[row + 1] - off[row]);
        }
        return -static_cast<int64_t>(8.0 * c) * k[row];
      };
      // Keep this thread's totals within the bound: flip or zero a row's k when needed.
      for (size_t r = 0; r < rows; ++r) {
        for (int attempt = 0; attempt < 3; ++attempt) {
          std::fill(delta.begin(), delta.end(), 0);
          bool ok = true;
          for (size_t i = 0; i < n; ++i) {
            const size_t row_i =
                pooled ? static_cast<size_t>(
                             std::upper_bound(off.begin(), off.end(), static_cast<int64_t>(i)) -
                             off.begin() - 1)
                       : i;
            if (row_i != r) continue;
            delta[idx[i]] += occurrence_units(i, r);
          }
          for (size_t i = 0; i < n; ++i) {
            const int64_t v = mine[idx[i]] + delta[idx[i]];
            ok = ok && v <= bound && v >= -bound;
          }
          if (ok) {
            for (size_t i = 0; i < n; ++i) {
              mine[idx[i]] += delta[idx[i]];
              delta[idx[i]] = 0;
            }
            break;
          }
          k[r] = attempt == 0 ? -k[r] : 0;
        }
      }
      grads.assign(rows * kDim2, 0.0f);
      for (size_t r = 0; r < rows; ++r) {
        for (size_t j = 0; j < kDim2; ++j)
          grads[r * kDim2 + j] = std::ldexp(static_cast<float>(k[r]), -12);
      }
      try {
        if (pooled) {
          table.apply_gradients(keys.data(), n, grads.data(), off.data(), rows,
                                weighted ? weights.data() : nullptr, mode);
        } else {
          table.apply_gradients(keys.data(), n, grads.data(), nullptr, 0, nullptr, PoolMode::kSum);
        }
      } catch (const CapacityError& e) {
        VIOLATION(std::string("CapacityError with capacity for every id: ") + e.what());
      }
      ++calls[tid];
      // Read back: own ids are written by this thread only, so they are exact now; shared
      // ids must be whole rows.
      if (rng() % 2 == 0) {
        const size_t m = 1 + rng() % 8;
        idx.resize(m);
        keys.resize(m);
        for (size_t i = 0; i < m; ++i) {
          idx[i] = rng() % 2 ? own_lo + rng() % own_per_thread : rng() % shared;
          keys[i] = ids[idx[i]];
        }
        out.assign(m * kDim2, std::numeric_limits<float>::quiet_NaN());
        const bool insert = rng() % 2 == 0;
        table.lookup(keys.data(), m, insert, out.data());
        ++reads[tid];
        for (size_t i = 0; i < m; ++i) {
          const size_t kk = idx[i];
          const float* row = &out[i * kDim2];
          if (!insert && row[0] == 0.0f && row[1] == 0.0f && row[2] == 0.0f && row[3] == 0.0f) {
            continue;  // not inserted yet
          }
          if (kk >= own_lo && kk < own_lo + own_per_thread) {
            for (size_t j = 0; j < kDim2; ++j) {
              const float want = static_cast<float>(
                  init[kk * kDim2 + j] + std::ldexp(static_cast<double>(mine[kk]), kUnitExp));
              if (!same_bits(row[j], want)) {
                VIOLATION("own id " + std::to_string(ids[kk]) + " element " + std::to_string(j) +
                          " = " + fmt(row[j]) + ", expected " + fmt(want));
                break;
              }
            }
          } else {
            check_whole(kk, row, "concurrent lookup");
          }
        }
      }
    }
  };
  run_threads(ec.threads, ec.seconds, body, [] {});

  // Final rows: initial row + the sum over threads of their units, exactly. An id never
  // inserted (possible in a short run) must have no units and read as zeros.
  Floats rows(n_ids * kDim2, std::numeric_limits<float>::quiet_NaN());
  std::unique_ptr<bool[]> present(new bool[n_ids]);
  table.contains(ids.data(), n_ids, present.get());
  table.lookup(ids.data(), n_ids, false, rows.data());
  uint64_t total_calls = 0, total_reads = 0;
  for (size_t t = 0; t < ec.threads; ++t) {
    total_calls += calls[t];
    total_reads += reads[t];
  }
  size_t mismatched = 0, num_present = 0;
  for (size_t k = 0; k < n_ids; ++k) {
    int64_t u = 0;
    for (size_t t = 0; t < ec.threads; ++t) u += units[t][k];
    num_present += present[k];
    bool row_ok = true;
    for (size_t j = 0; j < kDim2; ++j) {
      const double want_d = init[k * kDim2 + j] + std::ldexp(static_cast<double>(u), kUnitExp);
      float want = static_cast<float>(want_d);
      if (static_cast<double>(want) != want_d) VIOLATION("test bug: expectation not exact");
      if (!present[k]) {
        EXPECT(u == 0, "id " + std::to_string(ids[k]) + " received gradients but is absent");
        want = 0.0f;
      }
      const float got = rows[k * kDim2 + j];
      if (!same_bits(got, want)) {
        if (row_ok && mismatched < 10) {
          VIOLATION(std::string("final row of ") + (k < shared ? "shared" : "own") + " id " +
                    std::to_string(ids[k]) + " element " + std::to_string(j) + " = " + fmt(got) +
                    ", expected " + fmt(want) + " (initial " + fmt(init[k * kDim2 + j]) + " + " +
                    std::to_string(u) + " * 2^-19)");
        }
        row_ok = false;
      }
    }
    mismatched += !row_ok;
  }
  const TableStats st = table.stats();
  std::printf(
      "  apply calls=%llu reads=%llu mismatched_rows=%zu | size=%zu inserts=%llu "
      "evictions=%llu\n",
      (unsigned long long)total_calls, (unsigned long long)total_reads, mismatched, st.size,
      (unsigned long long)st.inserts, (unsigned long long)st.evictions);
  std::fflush(stdout);
  EXPECT(st.evictions == 0 && st.erased == 0, "eviction or erase in the exact phase");
  EXPECT(st.inserts == st.size, "inserts != size without evictions");
  EXPECT(st.size == num_present, "size " + std::to_string(st.size) + " but contains() finds " +
                                     std::to_string(num_present));
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::printf("stress_index: --seconds %g --threads %zu --seed %llu\n", o.seconds, o.threads,
              (unsigned long long)o.seed);
  std::fflush(stdout);
  const Clock::time_point start = Clock::now();
  const size_t many = std::max<size_t>(8, 2 * o.threads);  // contention on one shard
  struct Phase {
    const char* name;
    std::function<void(double)> run;
  };
  const std::vector<Phase> phases = {
      // Several shards, small capacity: in-shard CLOCK churn.
      {"churn/shards8", [&](double s) { churn({"shards8", 256, 8, o.threads, s}, o.seed + 1); }},
      // Capacity barely above the shard count: shards run empty while the table is full, so
      // inserts free rows of other shards (the cross-shard path).
      {"churn/tiny", [&](double s) { churn({"tiny", 24, 8, o.threads, s}, o.seed + 2); }},
      // One shard, many threads on one lock.
      {"churn/one-shard", [&](double s) { churn({"one-shard", 32, 1, many, s}, o.seed + 3); }},
      // Cross-shard eviction while the other shard's lock is busy.
      {"cross-shard", [&](double s) { cross_shard(o.threads, s, o.seed + 7); }},
      {"exact/shards8", [&](double s) { exact_sgd({"shards8", 8, o.threads, s}, o.seed + 4); }},
      {"exact/one-shard", [&](double s) { exact_sgd({"one-shard", 1, many, s}, o.seed + 5); }},
      {"exact/shards64", [&](double s) { exact_sgd({"shards64", 64, o.threads, s}, o.seed + 6); }},
  };
  std::vector<const Phase*> selected;
  for (const Phase& p : phases) {
    bool skipped = false;
    for (const std::string& prefix : o.skip)
      skipped = skipped || std::string(p.name).rfind(prefix, 0) == 0;
    if (skipped) {
      std::printf("phase %s: skipped (--skip)\n", p.name);
    } else {
      selected.push_back(&p);
    }
  }
  const double slice = selected.empty() ? 0.0 : o.seconds / static_cast<double>(selected.size());
  try {
    for (const Phase* p : selected) p->run(slice);
  } catch (const std::exception& e) {
    VIOLATION(std::string("unexpected exception: ") + e.what());
  }
  const uint64_t v = g_violations.load();
  std::printf("stress_index: %s (%llu violations) in %.2f s, seed %llu\n", v ? "FAILED" : "passed",
              (unsigned long long)v, elapsed_s(start), (unsigned long long)o.seed);
  return v == 0 ? 0 : 1;
}
