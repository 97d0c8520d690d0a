// File: embstore/config.hpp
//
// Plain configuration values of a table: its optimizer, initializer and eviction policy.
// They are copied into the table at construction; only the learning rate may change later.
#pragma once

#include <cstddef>  // size_t
#include <cstdint>  // uint64_t

namespace embstore {

enum class OptimizerKind : uint8_t {
  kSgd = 0,
  kAdagrad = 1,
  kRowWiseAdagrad = 2,
  kAdam = 3,
  kFtrl = 4,
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float lr = 0.01f;                  // FTRL: alpha
  float eps = 1e-8f;                 // Adagrad, RowWiseAdagrad, Adam
  float initial_accumulator = 0.0f;  // Adagrad, RowWiseAdagrad
  float momentum = 0.0f;             // SGD
  float beta1 = 0.9f;                // Adam
  float beta2 = 0.999f;              // Adam
  float weight_decay = 0.0f;         // Adam (decoupled)
  float ftrl_beta = 1.0f;            // FTRL
  float l1 = 0.0f;                   // FTRL
  float l2 = 0.0f;                   // FTRL
};

enum class InitializerKind : uint8_t {
  kZeros = 0,
  kUniform = 1,
  kNormal = 2,
  kTruncatedNormal = 3
};

struct InitializerConfig {
  InitializerKind kind = InitializerKind::kZeros;
  double a = 0.0;  // Uniform: low;  Normal / TruncatedNormal: mean
  double b = 0.0;  // Uniform: high; Normal / TruncatedNormal: std
  uint64_t seed = 0;
};

enum class Eviction : uint8_t { kNone = 0, kClock = 1 };

// Admission filter (CountMinSketch): an id gets a row once seen `min_count` times.
// min_count <= 1 disables it.
struct AdmissionConfig {
  uint32_t min_count = 0;
  size_t width = 0;  // counters per sketch row, over the whole table
  size_t depth = 0;  // sketch rows (hash functions)
  bool enabled() const noexcept { return min_count > 1; }
};

struct TableConfig {
  size_t dim = 0;
  size_t capacity = 0;
  size_t num_shards = 0;   // 0: chosen from capacity (see Table)
  size_t num_threads = 0;  // 0: the machine's hardware threads
  Eviction eviction = Eviction::kClock;
  OptimizerConfig optimizer;
  InitializerConfig initializer;
  AdmissionConfig admission;
  // Keep the rows CLOCK evicts (id, weights) for Table::drain_evicted instead of dropping
  // them: a PS spills them, or the Python facade hands them to an on_evict callback.
  bool stage_evicted = false;
};

}  // namespace embstore
