// File: tests/cpp/helpers.hpp
//
// Helpers of the core's unit tests: table configs, the batch calls on std::vector, the
// initializer formulas of docs/semantics.md written independently of the core, and the
// one window into Table's internals the tests use (TableTestAccess).
#pragma once

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

#include "harness.hpp"    // CHECK, fail
#include "test_util.hpp"  // Ids, Floats, Offsets, random_offsets

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

inline OptimizerConfig sgd(float lr) {
  OptimizerConfig o;
  o.kind = OptimizerKind::kSgd;
  o.lr = lr;
  return o;
}

inline OptimizerConfig adagrad(float lr, float eps = 1e-8f, float initial_accumulator = 0.0f) {
  OptimizerConfig o;
  o.kind = OptimizerKind::kAdagrad;
  o.lr = lr;
  o.eps = eps;
  o.initial_accumulator = initial_accumulator;
  return o;
}

inline InitializerConfig init_of(InitializerKind kind, double a, double b, uint64_t seed) {
  InitializerConfig i;
  i.kind = kind;
  i.a = a;
  i.b = b;
  i.seed = seed;
  return i;
}
inline InitializerConfig zeros() { return init_of(InitializerKind::kZeros, 0, 0, 0); }
inline InitializerConfig uniform(double lo, double hi, uint64_t seed) {
  return init_of(InitializerKind::kUniform, lo, hi, seed);
}
inline InitializerConfig normal(double mean, double std, uint64_t seed) {
  return init_of(InitializerKind::kNormal, mean, std, seed);
}
inline InitializerConfig truncated(double mean, double std, uint64_t seed) {
  return init_of(InitializerKind::kTruncatedNormal, mean, std, seed);
}

inline TableConfig config(size_t dim, size_t capacity, size_t shards,
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
inline Floats lookup(Table& t, const Ids& keys, bool insert = true) {
  Floats out(keys.size() * t.dim(), kNaN);
  t.lookup(keys.data(), keys.size(), insert, out.data());
  return out;
}

inline Floats lookup_sum(Table& t, const Ids& keys, const Offsets& offsets, const Floats* weights,
                         PoolMode mode, bool insert = true) {
  Floats out((offsets.size() - 1) * t.dim(), kNaN);
  t.lookup_sum(keys.data(), keys.size(), offsets.data(), offsets.size() - 1,
               weights ? weights->data() : nullptr, mode, insert, out.data());
  return out;
}

inline void apply(Table& t, const Ids& keys, const Floats& grads) {
  t.apply_gradients(keys.data(), keys.size(), grads.data(), nullptr, 0, nullptr, PoolMode::kSum);
}

inline void apply_pooled(Table& t, const Ids& keys, const Floats& grads, const Offsets& offsets,
                         const Floats* weights, PoolMode mode) {
  t.apply_gradients(keys.data(), keys.size(), grads.data(), offsets.data(), offsets.size() - 1,
                    weights ? weights->data() : nullptr, mode);
}

inline std::vector<bool> contains(Table& t, const Ids& keys) {
  std::unique_ptr<bool[]> buf(new bool[keys.size() + 1]);
  t.contains(keys.data(), keys.size(), buf.get());
  return std::vector<bool>(buf.get(), buf.get() + keys.size());
}

// The ids of `universe` present in the table (contains: no side effects).
inline std::set<uint64_t> present(Table& t, const Ids& universe) {
  std::vector<bool> c = contains(t, universe);
  std::set<uint64_t> out;
  for (size_t i = 0; i < universe.size(); ++i) {
    if (c[i]) out.insert(universe[i]);
  }
  return out;
}

inline Floats initial(const Table& t, const Ids& keys) {
  Floats out(keys.size() * t.dim(), kNaN);
  t.initial_values(keys.data(), keys.size(), out.data());
  return out;
}

inline Floats slice(const Floats& rows, size_t i, size_t dim) {
  return Floats(rows.begin() + static_cast<std::ptrdiff_t>(i * dim),
                rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * dim));
}

inline std::string describe(const std::set<uint64_t>& s) {
  std::string out = "{";
  for (uint64_t id : s) out += std::to_string(id) + ",";
  return out + "}";
}

// ---- docs/semantics.md "Initializers", written independently of the core -------------

inline uint64_t doc_splitmix64(uint64_t x) {  // all arithmetic mod 2^64
  x = x + 0x9E3779B97F4A7C15ULL;
  uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline double doc_u(uint64_t seed, uint64_t id, uint64_t j) {
  const uint64_t row_seed = doc_splitmix64(id ^ doc_splitmix64(seed));
  return static_cast<double>(doc_splitmix64(row_seed + j) >> 11) * (1.0 / 9007199254740992.0);
}

inline double doc_gaussian(uint64_t seed, uint64_t id, uint64_t j, uint64_t attempt) {
  const uint64_t p = j / 2, base = attempt << 32;
  const double u1 = 1.0 - doc_u(seed, id, 2 * p + base);
  const double u2 = doc_u(seed, id, 2 * p + 1 + base);
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double two_pi = 6.283185307179586476925286766559;
  return j % 2 == 0 ? r * std::cos(two_pi * u2) : r * std::sin(two_pi * u2);
}

inline Floats doc_initial_row(const InitializerConfig& init, uint64_t id, size_t dim) {
  Floats row(dim);
  for (size_t j = 0; j < dim; ++j) {
    switch (init.kind) {
      case InitializerKind::kZeros: row[j] = 0.0f; break;
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

inline Floats random_floats(std::mt19937_64& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  Floats v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Ids whose mixed hash has its low 32 bits below 2^24 ("low": home slot 0 in any index of at
// most 256 slots) or at least 2^32 - 2^24 ("high": home slot num_slots - 1), found by scanning
// ids in order from `start`.
inline Ids colliding_ids(size_t count, bool high, uint64_t start) {
  Ids out;
  for (uint64_t id = start; out.size() < count; ++id) {
    const uint32_t lo32 = static_cast<uint32_t>(mix64(id));
    if (!high && lo32 < (1u << 24)) out.push_back(id);
    if (high && lo32 >= 0xFFFFFFFFu - (1u << 24) + 1) out.push_back(id);
  }
  return out;
}

inline Ids range_ids(uint64_t lo, uint64_t hi) {
  Ids out;
  for (uint64_t k = lo; k < hi; ++k) out.push_back(k * 0x9E3779B97F4A7C15ULL + 1);
  return out;
}

}  // namespace
