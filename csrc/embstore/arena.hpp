// File: embstore/arena.hpp
//
// RowArena: one preallocated, 64-byte-aligned block holding every row of a table at a fixed
// stride (weights followed by optimizer state). Allocated once at construction; pages the
// table never uses are never touched, so resident memory follows the rows actually stored
// and stays flat once the table is full. Not synchronised: shards own disjoint row ranges.
//
// ZeroedBuffer<T>: a calloc'ed array whose zero pages are materialised lazily (used for the
// index, whose empty slot is all-zero bits).
#pragma once

#include <cstddef>  // size_t
#include <cstdlib>  // std::aligned_alloc, std::calloc, std::free
#include <memory>   // std::unique_ptr
#include <new>      // std::bad_alloc

namespace embstore {

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

constexpr size_t kCacheLine = 64;

// Floats per row: weights + state, rounded up to 4 floats so rows are 16-byte aligned
// (the width of an SSE load) without padding small rows to a whole cache line.
inline size_t row_stride(size_t dim, size_t state_width) noexcept {
  return (dim + state_width + 3) / 4 * 4;
}

class RowArena {
 public:
  RowArena(size_t rows, size_t stride) : rows_(rows), stride_(stride) {
    size_t bytes = rows * stride * sizeof(float);
    bytes = (bytes + kCacheLine - 1) / kCacheLine * kCacheLine;  // aligned_alloc needs a multiple
    if (bytes == 0) bytes = kCacheLine;
    data_.reset(static_cast<float*>(std::aligned_alloc(kCacheLine, bytes)));
    if (!data_) throw std::bad_alloc();
  }

  float* row(size_t r) noexcept { return data_.get() + r * stride_; }
  const float* row(size_t r) const noexcept { return data_.get() + r * stride_; }
  size_t stride() const noexcept { return stride_; }
  size_t rows() const noexcept { return rows_; }

 private:
  size_t rows_;
  size_t stride_;
  std::unique_ptr<float, FreeDeleter> data_;
};

template <typename T>
class ZeroedBuffer {
 public:
  explicit ZeroedBuffer(size_t n) : n_(n) {
    data_.reset(static_cast<T*>(std::calloc(n == 0 ? 1 : n, sizeof(T))));
    if (!data_) throw std::bad_alloc();
  }
  T* get() noexcept { return data_.get(); }
  const T* get() const noexcept { return data_.get(); }
  size_t size() const noexcept { return n_; }

 private:
  size_t n_;
  std::unique_ptr<T, FreeDeleter> data_;
};

}  // namespace embstore
