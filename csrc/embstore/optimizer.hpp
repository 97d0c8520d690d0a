// File: embstore/optimizer.hpp
//
// Fused optimizer kernels. A row in the arena is `dim` weights followed by the optimizer's
// state (`state_width(cfg, dim)` floats). `apply_update` performs ONE update with an
// already-summed gradient; the table sums duplicate ids of a batch before calling it.
// The exact float32 formulas (no FMA) are in docs/semantics.md, "Optimizers":
//   SGD:            w = w - lr * g                      (momentum: buf = mu*buf + g; w -= lr*buf)
//   Adagrad:        acc = acc + g*g; w = w - (lr*g) / (sqrt(acc) + eps)
//   RowWiseAdagrad: acc = acc + sum(g*g)/dim (one float per row), same step with that acc
//   Adam:           per-row step count t; m, v per element; bias-corrected step; decoupled
//                   weight decay first
//   FTRL:           FTRL-Proximal with per-element z, n; w from the closed form
// State layouts: Adagrad [acc(dim)], RowWiseAdagrad [acc], SGD+momentum [buf(dim)],
// Adam [m(dim) v(dim) t], FTRL [z(dim) n(dim)]. Adam's t is a uint32 stored in a float slot.
#pragma once

#include <cmath>    // std::sqrt, std::pow, std::fabs
#include <cstddef>  // size_t
#include <cstdint>  // uint32_t
#include <cstring>  // std::memcpy

#include "embstore/config.hpp"  // OptimizerConfig

namespace embstore {

inline size_t state_width(const OptimizerConfig& cfg, size_t dim) noexcept {
  switch (cfg.kind) {
    case OptimizerKind::kSgd: return cfg.momentum > 0.0f ? dim : 0;
    case OptimizerKind::kAdagrad: return dim;
    case OptimizerKind::kRowWiseAdagrad: return 1;
    case OptimizerKind::kAdam: return 2 * dim + 1;
    case OptimizerKind::kFtrl: return 2 * dim;
  }
  return 0;
}

// Sets the optimizer state of a freshly inserted row.
inline void init_state(const OptimizerConfig& cfg, float* state, size_t dim) noexcept {
  const bool accumulates =
      cfg.kind == OptimizerKind::kAdagrad || cfg.kind == OptimizerKind::kRowWiseAdagrad;
  const float value = accumulates ? cfg.initial_accumulator : 0.0f;  // Adam: t = 0 is 0 bits
  const size_t width = state_width(cfg, dim);
  for (size_t j = 0; j < width; ++j) state[j] = value;
}

// One optimizer step on `row` (weights, then state) with the summed gradient `g`, using the
// learning rate `lr` (alpha for FTRL; the table's current value, read once per call).
inline void apply_update(const OptimizerConfig& cfg, float lr, float* __restrict row,  // (stride)
                         const float* __restrict g,  // (dim)
                         size_t dim) noexcept {
  switch (cfg.kind) {
    case OptimizerKind::kSgd: {
      if (cfg.momentum > 0.0f) {
        float* __restrict buf = row + dim;
        const float mu = cfg.momentum;
        for (size_t j = 0; j < dim; ++j) {
          buf[j] = mu * buf[j] + g[j];
          row[j] = row[j] - lr * buf[j];
        }
      } else {
        for (size_t j = 0; j < dim; ++j) row[j] = row[j] - lr * g[j];
      }
      return;
    }
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
    case OptimizerKind::kRowWiseAdagrad: {
      float sum = 0.0f;  // in order: the documented summation
      for (size_t j = 0; j < dim; ++j) sum = sum + g[j] * g[j];
      const float acc = row[dim] + sum / static_cast<float>(dim);
      row[dim] = acc;
      const float d = std::sqrt(acc) + cfg.eps;
      for (size_t j = 0; j < dim; ++j) row[j] = row[j] - (lr * g[j]) / d;
      return;
    }
    case OptimizerKind::kAdam: {
      float* __restrict m = row + dim;
      float* __restrict v = m + dim;
      uint32_t t;
      std::memcpy(&t, v + dim, sizeof t);
      ++t;
      std::memcpy(v + dim, &t, sizeof t);
      if (cfg.weight_decay != 0.0f) {
        const float decay = lr * cfg.weight_decay;
        for (size_t j = 0; j < dim; ++j) row[j] = row[j] - decay * row[j];
      }
      const float b1 = cfg.beta1, b2 = cfg.beta2, eps = cfg.eps;
      const float one_minus_b1 = 1.0f - b1, one_minus_b2 = 1.0f - b2;
      const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
      const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), t));
      for (size_t j = 0; j < dim; ++j) {
        m[j] = b1 * m[j] + one_minus_b1 * g[j];
        v[j] = b2 * v[j] + (one_minus_b2 * g[j]) * g[j];
        row[j] = row[j] - (lr * (m[j] / bc1)) / (std::sqrt(v[j] / bc2) + eps);
      }
      return;
    }
    case OptimizerKind::kFtrl: {
      float* __restrict z = row + dim;
      float* __restrict n = z + dim;
      const float alpha = lr, beta = cfg.ftrl_beta, l1 = cfg.l1, l2 = cfg.l2;
      for (size_t j = 0; j < dim; ++j) {
        const float gj = g[j];
        const float n2 = n[j] + gj * gj;
        const float sigma = (std::sqrt(n2) - std::sqrt(n[j])) / alpha;
        const float zj = (z[j] + gj) - sigma * row[j];
        z[j] = zj;
        n[j] = n2;
        if (std::fabs(zj) <= l1) {
          row[j] = 0.0f;
        } else {
          const float sign = zj < 0.0f ? -1.0f : 1.0f;
          row[j] = -(zj - sign * l1) / ((beta + std::sqrt(n2)) / alpha + l2);
        }
      }
      return;
    }
  }
}

}  // namespace embstore
