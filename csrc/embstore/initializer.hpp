// File: embstore/initializer.hpp
//
// Deterministic initial rows: the value of element j of id k depends only on
// (initializer, seed, k, j) — never on insertion order, shard count, thread count or
// capacity. The exact formulas are in docs/semantics.md ("Initializers").
#pragma once

#include <cstddef>  // size_t
#include <cstdint>  // uint64_t

#include "embstore/config.hpp"  // InitializerConfig

namespace embstore {

// Writes the initial row of `id` into out[0, dim).
void initial_row(const InitializerConfig& init, uint64_t id, float* out,  // (dim) out
                 size_t dim) noexcept;

}  // namespace embstore
