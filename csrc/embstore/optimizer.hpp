// File: embstore/optimizer.hpp
//
// Fused optimizer kernels. A row in the arena is `dim` weights followed by the optimizer's
// state (`state_width(cfg, dim)` floats). `apply_update` performs ONE update with an
// already-summed gradient; the table sums duplicate ids of a batch before calling it.
// Formulas (docs/semantics.md, float32, no FMA):
//   SGD:     w = w - lr * g
//   Adagrad: acc = acc + g * g;  w = w - (lr * g) / (sqrt(acc) + eps)
#pragma once

#include <cmath>    // std::sqrt
#include <cstddef>  // size_t

#include "embstore/config.hpp"  // OptimizerConfig

namespace embstore {

inline size_t state_width(const OptimizerConfig& cfg, size_t dim) noexcept {
  switch (cfg.kind) {
    case OptimizerKind::kSgd:
      return 0;
    case OptimizerKind::kAdagrad:
      return dim;
  }
  return 0;
}

// Sets the optimizer state of a freshly inserted row.
inline void init_state(const OptimizerConfig& cfg, float* state, size_t dim) noexcept {
  const size_t width = state_width(cfg, dim);
  const float value = cfg.kind == OptimizerKind::kAdagrad ? cfg.initial_accumulator : 0.0f;
  for (size_t j = 0; j < width; ++j) state[j] = value;
}

// One optimizer step on `row` (weights, then state) with the summed gradient `g`.
inline void apply_update(const OptimizerConfig& cfg, float* __restrict row,  // (stride) in/out
                         const float* __restrict g,                            // (dim)
                         size_t dim) noexcept {
  const float lr = cfg.lr;
  switch (cfg.kind) {
    case OptimizerKind::kSgd:
      for (size_t j = 0; j < dim; ++j) row[j] = row[j] - lr * g[j];
      return;
    case OptimizerKind::kAdagrad: {
      float* __restrict acc = row + dim;
      const float eps = cfg.eps;
      for (size_t j = 0; j < dim; ++j) {
        const float a = acc[j] + g[j] * g[j];
        acc[j] = a;
        row[j] = row[j] - (lr * g[j]) / (std::sqrt(a) + eps);
      }
      return;
    }
  }
}

}  // namespace embstore
