// File: tests/cpp/test_core.cpp
//
// Unit tests of the embstore C++ core: arena, shard index (linear probing with
// backward-shift deletion), CLOCK eviction, free-list reuse, capacity errors, the batch
// operations of Table against a small hand-written reference that follows
// docs/semantics.md line by line, input validation, initializer determinism, the thread
// pool, and thread-count independence.
//
// Plain asserting executable (no test framework: the build must work offline). Usage:
//   test_core [--list] [NAME-SUBSTRING ...] [-EXCLUDED-NAME-SUBSTRING ...]
// runs every case (or those whose name contains a NAME-SUBSTRING, minus those containing an
// EXCLUDED one). Exit status 0 when every selected case passes.
//
// This file also proves that a C++ parameter server can link the core without Python: the
// only non-standard headers it includes are embstore/... headers.

#include <algorithm>   // std::shuffle, std::find, std::count
#include <atomic>      // std::atomic
#include <chrono>      // std::chrono
#include <cmath>       // std::sqrt, std::log, std::cos, std::sin, std::isnan, std::fabs
#include <cstdint>     // uint64_t, int64_t, uintptr_t
#include <cstdio>      // std::printf, std::fprintf
#include <cstdlib>     // std::exit
#include <cstring>     // std::memcmp, std::strcmp, std::strstr
#include <exception>   // std::exception
#include <functional>  // std::function
#include <limits>      // std::numeric_limits
#include <map>         // std::map
#include <memory>      // std::unique_ptr
#include <random>      // std::mt19937_64
#include <set>         // std::set
#include <stdexcept>   // std::invalid_argument, std::runtime_error
#include <string>      // std::string
#include <thread>      // std::thread
#include <vector>      // std::vector

#include "embstore/admission.hpp"
#include "embstore/arena.hpp"
#include "embstore/buffer_pool.hpp"
#include "embstore/config.hpp"
#include "embstore/errors.hpp"
#include "embstore/hash.hpp"
#include "embstore/initializer.hpp"
#include "embstore/optimizer.hpp"
#include "embstore/resolution.hpp"
#include "embstore/shard.hpp"
#include "embstore/snapshot.hpp"
#include "embstore/table.hpp"
#include "embstore/thread_pool.hpp"

#include "test_util.hpp"  // Ids, Floats, Offsets, random_offsets

// =======================================================================================
// Harness
// =======================================================================================

namespace embstore_test {

struct CheckFailure {};  // thrown by CHECK; deliberately not a std::exception

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  throw CheckFailure{};
}

struct TestCase {
  const char* name;
  void (*fn)();
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> cases;
  return cases;
}

struct Register {
  Register(const char* name, void (*fn)()) { registry().push_back({name, fn}); }
};

}  // namespace embstore_test

// Aborts the current test case, printing file:line and the failing expression.
#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) ::embstore_test::fail(__FILE__, __LINE__, #cond);   \
  } while (0)

// CHECK with a message (a std::string expression) appended to the report.
#define CHECK_MSG(cond, msg)                                                   \
  do {                                                                         \
    if (!(cond)) {                                                             \
      ::embstore_test::fail(__FILE__, __LINE__,                                \
                            std::string(#cond) + "  [" + std::string(msg) + "]"); \
    }                                                                          \
  } while (0)

// Expects `stmt` to throw `type` (or a subclass); any other exception fails the check.
#define CHECK_THROWS(type, stmt)                                                         \
  do {                                                                                   \
    bool caught_ = false;                                                                \
    try {                                                                                \
      stmt;                                                                              \
    } catch (const type&) {                                                              \
      caught_ = true;                                                                    \
    } catch (const std::exception& e_) {                                                 \
      ::embstore_test::fail(__FILE__, __LINE__, std::string(#stmt) +                     \
                                                    " threw another exception: " +       \
                                                    e_.what());                          \
    }                                                                                    \
    if (!caught_) {                                                                      \
      ::embstore_test::fail(__FILE__, __LINE__, std::string(#stmt) + " did not throw " #type); \
    }                                                                                    \
  } while (0)

// Element-wise bitwise float equality, reporting the first mismatch with its values.
#define CHECK_FLOATS_EQ(a, b) ::embstore_test::check_floats_eq(__FILE__, __LINE__, #a, #b, (a), (b))
// Bit-for-bit equality.
#define CHECK_BITS_EQ(a, b) ::embstore_test::check_bits_eq(__FILE__, __LINE__, #a, #b, (a), (b))

#define TEST_CASE(name)                                              \
  static void name();                                                \
  static ::embstore_test::Register register_##name(#name, &name);    \
  static void name()

namespace embstore_test {

inline void check_floats_eq(const char* file, int line, const char* an, const char* bn,
                            const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) {
    fail(file, line, std::string(an) + " == " + bn + ": sizes " + std::to_string(a.size()) +
                         " != " + std::to_string(b.size()));
  }
  for (size_t i = 0; i < a.size(); ++i) {
    // Bit for bit (docs/semantics.md: a float32 implementation of the documented lines
    // reproduces the core's results exactly, signs of zeros included).
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, ": first mismatch at [%zu]: %.9g != %.9g (of %zu)", i,
                    static_cast<double>(a[i]), static_cast<double>(b[i]), a.size());
      fail(file, line, std::string(an) + " == " + bn + buf);
    }
  }
}

inline void check_bits_eq(const char* file, int line, const char* an, const char* bn,
                          const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() ||
      (!a.empty() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0)) {
    size_t i = 0;
    while (i < a.size() && i < b.size() &&
           std::memcmp(&a[i], &b[i], sizeof(float)) == 0) {
      ++i;
    }
    fail(file, line, std::string(an) + " bitwise== " + bn + ": first difference at element " +
                         std::to_string(i));
  }
}

}  // namespace embstore_test

// =======================================================================================
// Helpers
// =======================================================================================

// The one window into Table's internals the tests use: a shard, to play a writer caught in
// the middle of a change (Table is a friend of this struct).
namespace embstore {
struct TableTestAccess {
  static Shard& shard_of_id(Table& t, uint64_t id) { return *t.shards_[t.shard_of(mix64(id))]; }
  static float* row_of_id(Table& t, uint64_t id) {
    Shard& sh = shard_of_id(t, id);
    const uint32_t row = sh.find(id, mix64(id));
    return row == kNoRow ? nullptr : t.row_ptr(sh, row);
  }
};
}  // namespace embstore

namespace {

using namespace embstore;
using embstore_test::Floats;
using embstore_test::Ids;
using embstore_test::Offsets;
using embstore_test::random_offsets;
constexpr uint64_t kMaxId = std::numeric_limits<uint64_t>::max();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

OptimizerConfig sgd(float lr) {
  OptimizerConfig o;
  o.kind = OptimizerKind::kSgd;
  o.lr = lr;
  return o;
}

OptimizerConfig adagrad(float lr, float eps = 1e-8f, float initial_accumulator = 0.0f) {
  OptimizerConfig o;
  o.kind = OptimizerKind::kAdagrad;
  o.lr = lr;
  o.eps = eps;
  o.initial_accumulator = initial_accumulator;
  return o;
}

InitializerConfig init_of(InitializerKind kind, double a, double b, uint64_t seed) {
  InitializerConfig i;
  i.kind = kind;
  i.a = a;
  i.b = b;
  i.seed = seed;
  return i;
}
InitializerConfig zeros() { return init_of(InitializerKind::kZeros, 0, 0, 0); }
InitializerConfig uniform(double lo, double hi, uint64_t seed) {
  return init_of(InitializerKind::kUniform, lo, hi, seed);
}
InitializerConfig normal(double mean, double std, uint64_t seed) {
  return init_of(InitializerKind::kNormal, mean, std, seed);
}
InitializerConfig truncated(double mean, double std, uint64_t seed) {
  return init_of(InitializerKind::kTruncatedNormal, mean, std, seed);
}

TableConfig config(size_t dim, size_t capacity, size_t shards,
                   Eviction eviction = Eviction::kClock, OptimizerConfig opt = sgd(0.5f),
                   InitializerConfig init = uniform(-1.0, 1.0, 42), size_t threads = 1) {
  TableConfig c;
  c.dim = dim;
  c.capacity = capacity;
  c.num_shards = shards;
  c.num_threads = threads;
  c.eviction = eviction;
  c.optimizer = opt;
  c.initializer = init;
  return c;
}

// Outputs are pre-filled with NaN so an element the core forgets to write is caught.
Floats lookup(Table& t, const Ids& keys, bool insert = true) {
  Floats out(keys.size() * t.dim(), kNaN);
  t.lookup(keys.data(), keys.size(), insert, out.data());
  return out;
}

Floats lookup_sum(Table& t, const Ids& keys, const Offsets& offsets, const Floats* weights,
                  PoolMode mode, bool insert = true) {
  Floats out((offsets.size() - 1) * t.dim(), kNaN);
  t.lookup_sum(keys.data(), keys.size(), offsets.data(), offsets.size() - 1,
               weights ? weights->data() : nullptr, mode, insert, out.data());
  return out;
}

void apply(Table& t, const Ids& keys, const Floats& grads) {
  t.apply_gradients(keys.data(), keys.size(), grads.data(), nullptr, 0, nullptr, PoolMode::kSum);
}

void apply_pooled(Table& t, const Ids& keys, const Floats& grads, const Offsets& offsets,
                  const Floats* weights, PoolMode mode) {
  t.apply_gradients(keys.data(), keys.size(), grads.data(), offsets.data(), offsets.size() - 1,
                    weights ? weights->data() : nullptr, mode);
}

std::vector<bool> contains(Table& t, const Ids& keys) {
  std::unique_ptr<bool[]> buf(new bool[keys.size() + 1]);
  t.contains(keys.data(), keys.size(), buf.get());
  return std::vector<bool>(buf.get(), buf.get() + keys.size());
}

// The ids of `universe` present in the table (contains: no side effects).
std::set<uint64_t> present(Table& t, const Ids& universe) {
  std::vector<bool> c = contains(t, universe);
  std::set<uint64_t> out;
  for (size_t i = 0; i < universe.size(); ++i) {
    if (c[i]) out.insert(universe[i]);
  }
  return out;
}

Floats initial(const Table& t, const Ids& keys) {
  Floats out(keys.size() * t.dim(), kNaN);
  t.initial_values(keys.data(), keys.size(), out.data());
  return out;
}

Floats slice(const Floats& rows, size_t i, size_t dim) {
  return Floats(rows.begin() + static_cast<std::ptrdiff_t>(i * dim),
                rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * dim));
}

std::string describe(const std::set<uint64_t>& s) {
  std::string out = "{";
  for (uint64_t id : s) out += std::to_string(id) + ",";
  return out + "}";
}

// ---- docs/semantics.md "Initializers", written independently of the core -------------

uint64_t doc_splitmix64(uint64_t x) {  // all arithmetic mod 2^64
  x = x + 0x9E3779B97F4A7C15ULL;
  uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

double doc_u(uint64_t seed, uint64_t id, uint64_t j) {
  const uint64_t row_seed = doc_splitmix64(id ^ doc_splitmix64(seed));
  return static_cast<double>(doc_splitmix64(row_seed + j) >> 11) * (1.0 / 9007199254740992.0);
}

double doc_gaussian(uint64_t seed, uint64_t id, uint64_t j, uint64_t attempt) {
  const uint64_t p = j / 2, base = attempt << 32;
  const double u1 = 1.0 - doc_u(seed, id, 2 * p + base);
  const double u2 = doc_u(seed, id, 2 * p + 1 + base);
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double two_pi = 6.283185307179586476925286766559;
  return j % 2 == 0 ? r * std::cos(two_pi * u2) : r * std::sin(two_pi * u2);
}

Floats doc_initial_row(const InitializerConfig& init, uint64_t id, size_t dim) {
  Floats row(dim);
  for (size_t j = 0; j < dim; ++j) {
    switch (init.kind) {
      case InitializerKind::kZeros:
        row[j] = 0.0f;
        break;
      case InitializerKind::kUniform:
        row[j] = static_cast<float>(init.a + (init.b - init.a) * doc_u(init.seed, id, j));
        break;
      case InitializerKind::kNormal:
        row[j] = static_cast<float>(init.a + init.b * doc_gaussian(init.seed, id, j, 0));
        break;
      case InitializerKind::kTruncatedNormal: {
        double z = doc_gaussian(init.seed, id, j, 0);
        for (uint64_t a = 1; std::fabs(z) > 2.0; ++a) z = doc_gaussian(init.seed, id, j, a);
        row[j] = static_cast<float>(init.a + init.b * z);
        break;
      }
    }
  }
  return row;
}

// ---- a hand-written reference table (docs/semantics.md, one occurrence at a time) ------
//
// capacity == 0: unbounded (no eviction). Otherwise one CLOCK ring of `capacity` slots in
// allocation order, erased slots reused last-freed-first, and (docs) every id of an
// apply_gradients call pinned for the whole call.
class RefTable {
 public:
  RefTable(size_t dim, OptimizerConfig opt, InitializerConfig init, size_t capacity = 0,
           Eviction eviction = Eviction::kClock)
      : dim_(dim), opt_(opt), init_(init), capacity_(capacity), eviction_(eviction),
        slot_id_(capacity), occupied_(capacity, false), ref_(capacity, false),
        read_mark_(capacity, false) {}

  uint64_t hits = 0, misses = 0, inserts = 0, evictions = 0, erased = 0;

  size_t size() const { return rows_.size(); }
  bool has(uint64_t id) const { return rows_.count(id) != 0; }
  const Floats& weights(uint64_t id) const { return rows_.at(id).w; }
  std::set<uint64_t> ids() const {
    std::set<uint64_t> s;
    for (const auto& kv : rows_) s.insert(kv.first);
    return s;
  }

  Floats lookup(const Ids& keys, bool insert) {
    Floats out(keys.size() * dim_, 0.0f);
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint64_t id = keys[i];
      if (has(id)) {
        ++hits;
        if (insert) {
          touch(id);
        } else if (capacity_ != 0) {
          read_mark_[slot_of_.at(id)] = true;  // a read-only hit marks the slot, not the bit
        }
      } else {
        ++misses;
        if (!insert) continue;
        insert_row(id, {});
      }
      const Floats& w = rows_.at(id).w;
      std::copy(w.begin(), w.end(), out.begin() + static_cast<std::ptrdiff_t>(i * dim_));
    }
    return out;
  }

  Floats lookup_sum(const Ids& keys, const Offsets& offsets, const Floats* weights,
                    PoolMode mode, bool insert) {
    const Floats rows = lookup(keys, insert);
    const size_t bags = offsets.size() - 1;
    Floats out(bags * dim_);
    for (size_t b = 0; b < bags; ++b) {
      Floats s(dim_, 0.0f);
      for (int64_t i = offsets[b]; i < offsets[b + 1]; ++i) {
        for (size_t k = 0; k < dim_; ++k) {
          const float r = rows[static_cast<size_t>(i) * dim_ + k];
          s[k] = weights ? s[k] + (*weights)[static_cast<size_t>(i)] * r : s[k] + r;
        }
      }
      const int64_t count = offsets[b + 1] - offsets[b];
      if (mode == PoolMode::kMean && count > 0) {
        for (size_t k = 0; k < dim_; ++k) s[k] = s[k] / static_cast<float>(count);
      }
      std::copy(s.begin(), s.end(), out.begin() + static_cast<std::ptrdiff_t>(b * dim_));
    }
    return out;
  }

  void apply(const Ids& keys, const Floats& grads, const Offsets* offsets, const Floats* weights,
             PoolMode mode) {
    // Per-occurrence gradients g_i.
    std::vector<Floats> g(keys.size(), Floats(dim_));
    if (offsets == nullptr) {
      for (size_t i = 0; i < keys.size(); ++i) {
        for (size_t k = 0; k < dim_; ++k) g[i][k] = grads[i * dim_ + k];
      }
    } else {
      for (size_t b = 0; b + 1 < offsets->size(); ++b) {
        const int64_t lo = (*offsets)[b], hi = (*offsets)[b + 1];
        for (int64_t i = lo; i < hi; ++i) {
          const size_t ii = static_cast<size_t>(i);
          if (weights == nullptr && mode == PoolMode::kSum) {
            for (size_t k = 0; k < dim_; ++k) g[ii][k] = grads[b * dim_ + k];
            continue;
          }
          float c = weights ? (*weights)[ii] : 1.0f;
          if (mode == PoolMode::kMean) c = c / static_cast<float>(hi - lo);
          for (size_t k = 0; k < dim_; ++k) g[ii][k] = c * grads[b * dim_ + k];
        }
      }
    }
    // Sum equal ids in order, from a zero vector.
    Ids order;
    std::map<uint64_t, Floats> summed;
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = summed.find(keys[i]);
      if (it == summed.end()) {
        order.push_back(keys[i]);
        it = summed.emplace(keys[i], Floats(dim_, 0.0f)).first;
      }
      for (size_t k = 0; k < dim_; ++k) it->second[k] = it->second[k] + g[i][k];
    }
    const std::set<uint64_t> pinned(order.begin(), order.end());
    for (uint64_t id : order) {
      if (!has(id)) insert_row(id, pinned);
    }
    for (uint64_t id : order) {
      update(rows_.at(id), summed.at(id));
      touch(id);
    }
  }

  std::vector<bool> contains(const Ids& keys) const {
    std::vector<bool> out;
    for (uint64_t id : keys) out.push_back(has(id));
    return out;
  }

  size_t erase(const Ids& keys) {
    size_t removed = 0;
    for (uint64_t id : keys) {
      if (!has(id)) continue;
      rows_.erase(id);
      if (capacity_ != 0) {
        const size_t slot = slot_of_.at(id);
        slot_of_.erase(id);
        occupied_[slot] = false;
        ref_[slot] = false;
        read_mark_[slot] = false;
        free_.push_back(slot);
      }
      ++removed;
    }
    erased += removed;
    return removed;
  }

 private:
  struct Row {
    Floats w, acc;
  };

  void touch(uint64_t id) {
    if (capacity_ != 0) ref_[slot_of_.at(id)] = true;
  }

  void insert_row(uint64_t id, const std::set<uint64_t>& pinned) {
    if (capacity_ != 0) {
      size_t slot;
      if (!free_.empty()) {
        slot = free_.back();
        free_.pop_back();
      } else if (bump_ < capacity_) {
        slot = bump_++;
      } else if (eviction_ == Eviction::kNone) {
        throw CapacityError("reference: table full");
      } else {
        slot = victim(pinned);
        const uint64_t old = slot_id_[slot];
        rows_.erase(old);
        slot_of_.erase(old);
        ++evictions;
      }
      slot_id_[slot] = id;
      occupied_[slot] = true;
      ref_[slot] = true;
      read_mark_[slot] = false;
      slot_of_[id] = slot;
    }
    Row r;
    r.w = doc_initial_row(init_, id, dim_);
    if (opt_.kind == OptimizerKind::kAdagrad) r.acc.assign(dim_, opt_.initial_accumulator);
    rows_[id] = r;
    ++inserts;
  }

  size_t victim(const std::set<uint64_t>& pinned) {
    for (size_t step = 0; step < 3 * capacity_ + 1; ++step) {
      const size_t slot = hand_;
      hand_ = (hand_ + 1) % capacity_;
      if (!occupied_[slot] || pinned.count(slot_id_[slot])) continue;
      if (ref_[slot]) {  // the bit first, the read mark the next time round
        ref_[slot] = false;
        continue;
      }
      if (read_mark_[slot]) {
        read_mark_[slot] = false;
        continue;
      }
      return slot;
    }
    throw CapacityError("reference: every row is pinned");
  }

  void update(Row& r, const Floats& g) {
    const float lr = opt_.lr;
    for (size_t k = 0; k < dim_; ++k) {
      if (opt_.kind == OptimizerKind::kSgd) {
        r.w[k] = r.w[k] - lr * g[k];
      } else {
        const float a = r.acc[k] + g[k] * g[k];
        r.acc[k] = a;
        r.w[k] = r.w[k] - (lr * g[k]) / (std::sqrt(a) + opt_.eps);
      }
    }
  }

  size_t dim_;
  OptimizerConfig opt_;
  InitializerConfig init_;
  size_t capacity_;
  Eviction eviction_;
  std::map<uint64_t, Row> rows_;
  // CLOCK ring (capacity_ != 0)
  std::vector<uint64_t> slot_id_;
  std::vector<bool> occupied_, ref_, read_mark_;
  std::map<uint64_t, size_t> slot_of_;
  std::vector<size_t> free_;
  size_t bump_ = 0, hand_ = 0;
};

void check_stats(Table& t, const RefTable& ref, const char* file, int line) {
  const TableStats st = t.stats();
  auto eq = [&](const char* what, uint64_t got, uint64_t want) {
    if (got != want) {
      embstore_test::fail(file, line, std::string("stats.") + what + " = " + std::to_string(got) +
                                          ", reference " + std::to_string(want));
    }
  };
  eq("size", st.size, ref.size());
  eq("hits", st.hits, ref.hits);
  eq("misses", st.misses, ref.misses);
  eq("inserts", st.inserts, ref.inserts);
  eq("evictions", st.evictions, ref.evictions);
  eq("erased", st.erased, ref.erased);
}
#define CHECK_STATS(t, ref) check_stats((t), (ref), __FILE__, __LINE__)

Floats random_floats(std::mt19937_64& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  Floats v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Ids whose mixed hash has its low 32 bits below 2^24 ("low": home slot 0 in any index of at
// most 256 slots) or at least 2^32 - 2^24 ("high": home slot num_slots - 1), found by scanning
// ids in order from `start`.
Ids colliding_ids(size_t count, bool high, uint64_t start) {
  Ids out;
  for (uint64_t id = start; out.size() < count; ++id) {
    const uint32_t lo32 = static_cast<uint32_t>(mix64(id));
    if (!high && lo32 < (1u << 24)) out.push_back(id);
    if (high && lo32 >= 0xFFFFFFFFu - (1u << 24) + 1) out.push_back(id);
  }
  return out;
}

}  // namespace

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
  ZeroedBuffer<RowMeta> empty(0);
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
    CHECK(sh.meta(row).id == ids[i]);
    CHECK(sh.meta(row).aux == kNoRow);
    CHECK(sh.occupied(row));
    CHECK(sh.dirty(row));  // new rows are dirty until a checkpoint
    CHECK(sh.meta(row).last_step == 0);
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
  CHECK(sh.unlink_and_free(999, mix64(999)) == kNoRow);        // never there
  CHECK(sh.counters.size.load() == 7);
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
  CHECK(sh.find(77, mix64(77)) == 5);
  CHECK(sh.find(78, mix64(78)) == 3);
  CHECK(sh.counters.size.load() == 8);
  CHECK(sh.footprint_bytes() >= 8 * sizeof(RowMeta) + 8 * sizeof(Slot));
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
      CHECK(fast_range32(mix64(id), 256) == 0 || fast_range32(mix64(id), 256) == 255 ||
            id == 0 || id >= kMaxId - 1);
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
        CHECK_MSG(got == (it == model.end() ? kNoRow : it->second),
                  std::string(when) + ": rows=" + std::to_string(rows) + " id=" + std::to_string(id));
      }
      CHECK(sh.counters.size.load() == model.size());
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
        const uint32_t row = sh.unlink_and_free(id, mix64(id));
        CHECK(row == model[id]);
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
  // A pinned row (aux set) is skipped and keeps its reference bit.
  sh.reference(2);
  sh.meta(2).aux = 0;
  CHECK(sh.clock_victim() == 3);
  CHECK(sh.referenced(2));
  // Every row pinned: no victim.
  for (uint32_t r = 0; r < 4; ++r) sh.meta(r).aux = r;
  CHECK(sh.clock_victim() == kNoRow);
  for (uint32_t r = 0; r < 4; ++r) sh.meta(r).aux = kNoRow;
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
  const uint64_t held = row == kNoRow ? id : sh.meta(row).id;
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
  for (int round = 0; round < 20000; ++round) {
    if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(300)) break;
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
          sh.meta(row).id != index.slots[pos].id) {
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

// =======================================================================================
// CLOCK on a one-shard table (docs/semantics.md "Eviction")
// =======================================================================================

TEST_CASE(clock_scripted_sequences) {
  // ids: 0 and 2^64-1 are ordinary.
  const uint64_t a = 0, b = kMaxId, c = 7, d = 1234567, e = 1ULL << 63, f = 99, g = 5, h = 6,
                 i = 8, j = 9, k = 10;
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
      for (uint64_t id = 0; id < 3 * capacity + 2; ++id) universe.push_back(id * 0x9E3779B97F4A7C15ULL);
      universe.push_back(kMaxId);
      auto pick = [&](size_t n) {
        Ids keys(n);
        for (uint64_t& id : keys) id = universe[rng() % universe.size()];
        return keys;
      };
      for (int op = 0; op < 400; ++op) {
        const std::string where = "capacity=" + std::to_string(capacity) + " seed=" +
                                  std::to_string(seed) + " op=" + std::to_string(op);
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
        CHECK_MSG(got == ref.ids(), where + ": present " + describe(got) + " reference " +
                                        describe(ref.ids()));
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
  CHECK_MSG(lost == 0, std::to_string(lost) + " of " + std::to_string(reps) + " rotations: " + detail);
}

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
  CHECK_FLOATS_EQ(lookup_sum(t, {}, Offsets{0, 0, 0, 0}, nullptr, PoolMode::kMean), Floats(9, 0.0f));
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
  CHECK_THROWS(std::invalid_argument, t.lookup_sum(keys.data(), keys.size(), nullptr, 2,
                                                   nullptr, PoolMode::kSum, true, out.data()));
  auto bad_offsets = [&](const Offsets& off) {
    Floats o((off.size() - 1) * 2, kNaN);
    CHECK_THROWS(std::invalid_argument, t.lookup_sum(keys.data(), keys.size(), off.data(),
                                                     off.size() - 1, nullptr, PoolMode::kSum,
                                                     true, o.data()));
    const Floats g((off.size() - 1) * 2, 1.0f);
    CHECK_THROWS(std::invalid_argument,
                 t.apply_gradients(keys.data(), keys.size(), g.data(), off.data(),
                                   off.size() - 1, nullptr, PoolMode::kMean));
  };
  bad_offsets({1, 2, 4});     // offsets[0] != 0
  bad_offsets({0, 3, 2, 4});  // decreasing
  bad_offsets({0, 2, 3});     // offsets[-1] != len(keys)
  bad_offsets({0, 2, 5});     // offsets[-1] > len(keys)
  bad_offsets({0, -1, 4});    // negative
  // Non-finite gradients (the bad element last, so a partial apply would show) and weights.
  for (float bad : {kNaN, std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    Floats g = grads_ok;
    g.back() = bad;
    CHECK_THROWS(std::invalid_argument, apply(t, keys, g));
    CHECK_THROWS(std::invalid_argument,
                 apply_pooled(t, keys, Floats{1, 1, 1, bad}, Offsets{0, 2, 4}, nullptr,
                              PoolMode::kSum));
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
        lookup(t, Ids(order.begin() + static_cast<std::ptrdiff_t>(lo),
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
        const Floats s1 = lookup_sum(t1, keys, off, &w, mode), s4 = lookup_sum(t4, keys, off, &w, mode);
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
        first_difference = "two 1-thread tables (different task order) differ in round " +
                           std::to_string(round);
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

Ids range_ids(uint64_t lo, uint64_t hi) {
  Ids out;
  for (uint64_t k = lo; k < hi; ++k) out.push_back(k * 0x9E3779B97F4A7C15ULL + 1);
  return out;
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
      CHECK(u.import_rows(ids.data(), ids.size(), rows.data(), steps.data(),
                          ImportMode::kRestore, placed.data()) == 300);
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
      CHECK_MSG(image_diff(before.rows, during.rows).empty(),
                image_diff(before.rows, during.rows));
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
  CHECK_THROWS(CapacityError, none.import_rows(ids.data(), 5, rows.data(), nullptr,
                                              ImportMode::kUpsert, nullptr));
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

int main(int argc, char** argv) {
  using embstore_test::registry;
  std::vector<std::string> filters, excludes;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--list") == 0) {
      for (const auto& c : registry()) std::printf("%s\n", c.name);
      return 0;
    }
    if (argv[i][0] == '-' && argv[i][1] != '\0') {
      excludes.emplace_back(argv[i] + 1);
    } else {
      filters.emplace_back(argv[i]);
    }
  }
  int failed = 0, ran = 0;
  std::vector<std::string> failures;
  for (const auto& c : registry()) {
    bool selected = filters.empty();
    for (const std::string& f : filters) selected = selected || std::strstr(c.name, f.c_str());
    for (const std::string& f : excludes) selected = selected && !std::strstr(c.name, f.c_str());
    if (!selected) continue;
    ++ran;
    std::printf("[ RUN  ] %s\n", c.name);
    std::fflush(stdout);
    bool ok = false;
    try {
      c.fn();
      ok = true;
    } catch (const embstore_test::CheckFailure&) {
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: unexpected exception: %s\n", c.name, e.what());
    } catch (...) {
      std::fprintf(stderr, "%s: unexpected non-standard exception\n", c.name);
    }
    std::printf("[ %s ] %s\n", ok ? " OK " : "FAIL", c.name);
    std::fflush(stdout);
    if (!ok) {
      ++failed;
      failures.emplace_back(c.name);
    }
  }
  std::printf("%d of %d test cases passed\n", ran - failed, ran);
  for (const std::string& f : failures) std::printf("FAILED: %s\n", f.c_str());
  if (ran == 0) {
    std::fprintf(stderr, "no test case matched\n");
    return 2;
  }
  return failed == 0 ? 0 : 1;
}
