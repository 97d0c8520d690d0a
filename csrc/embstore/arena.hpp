// File: embstore/arena.hpp
//
// RowArena: one preallocated, 64-byte-aligned block holding every row of a table at a fixed
// stride (weights followed by optimizer state). Allocated once at construction; pages the
// table never uses are never touched, so resident memory follows the rows actually stored
// and stays flat once the table is full. Not synchronised: shards own disjoint row ranges.
//
// ZeroedBuffer<T>: a zero-filled array (a shard's bitmaps).
// BufferSlice<T>: a typed view of memory owned elsewhere (a shard's index and row links,
// carved from its table's one huge-page mapping; all-zero bits are an empty slot).
#pragma once

#include <cstddef>  // size_t
#include <cstdint>  // uintptr_t
#include <cstdlib>  // std::aligned_alloc, std::free
#include <cstring>  // std::memset
#include <new>      // std::bad_alloc
#include <utility>  // std::exchange

#if defined(__linux__)
#include <sys/mman.h>  // mmap, munmap, madvise
#endif

namespace embstore {

constexpr size_t kCacheLine = 64;

// Zero-filled memory for tables. From kMapThreshold up it comes from mmap, zero-filled on
// first touch, so pages a table never uses (rows beyond those stored, a shard's slack, the
// last steps of a table that sets none) cost no RAM. From kHugeThreshold up it also gets
// MADV_HUGEPAGE: the arena and index are read at random, so with 4 KiB pages nearly every
// row access also misses the TLB; 2 MiB pages cover a 1M-row table with a few hundred TLB
// entries. The mapping starts on a huge page but is not rounded up to one: the tail past the
// last whole huge page gets 4 KiB pages (resident only as touched), not up to 2 MiB more.
class LargeBuffer {
 public:
  static constexpr size_t kMapThreshold = size_t{16} << 10;
  static constexpr size_t kHugeThreshold = size_t{4} << 20;
  static constexpr size_t kHugePage = size_t{2} << 20;

  LargeBuffer() = default;
  explicit LargeBuffer(size_t bytes) : bytes_(bytes == 0 ? kCacheLine : bytes) {
#if defined(__linux__)
    if (bytes_ >= kMapThreshold) {
      bytes_ = (bytes_ + kPage - 1) / kPage * kPage;
      const bool huge = bytes_ >= kHugeThreshold;
      const size_t pad = huge ? kHugePage : 0;  // room to move the start onto a huge page
      void* p =
          mmap(nullptr, bytes_ + pad, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      char* start = static_cast<char*>(p);
      if (huge) {
        const uintptr_t at = reinterpret_cast<uintptr_t>(start);
        const size_t lead = (kHugePage - at % kHugePage) % kHugePage;
        if (lead != 0) munmap(start, lead);
        if (pad - lead != 0) munmap(start + lead + bytes_, pad - lead);
        start += lead;
        madvise(start, bytes_, MADV_HUGEPAGE);  // a hint: fine if THP is off
      }
      data_ = start;
      mapped_ = true;
      return;
    }
#endif
    bytes_ = (bytes_ + kCacheLine - 1) / kCacheLine * kCacheLine;  // aligned_alloc's rule
    data_ = std::aligned_alloc(kCacheLine, bytes_);
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(data_, 0, bytes_);
  }
  LargeBuffer(LargeBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(o.bytes_), mapped_(o.mapped_) {}
  LargeBuffer& operator=(LargeBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = o.bytes_;
      mapped_ = o.mapped_;
    }
    return *this;
  }
  LargeBuffer(const LargeBuffer&) = delete;
  LargeBuffer& operator=(const LargeBuffer&) = delete;
  ~LargeBuffer() { release(); }

  void* data() const noexcept { return data_; }

 private:
  void release() noexcept {
    if (data_ == nullptr) return;
#if defined(__linux__)
    if (mapped_) {
      munmap(data_, bytes_);
      data_ = nullptr;
      return;
    }
#endif
    std::free(data_);
    data_ = nullptr;
  }

  static constexpr size_t kPage = size_t{4} << 10;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool mapped_ = false;
};

// Floats per row: weights + state, rounded up to 4 floats so rows are 16-byte aligned
// (the width of an SSE load) without padding small rows to a whole cache line.
inline size_t row_stride(size_t dim, size_t state_width) noexcept {
  return (dim + state_width + 3) / 4 * 4;
}

class RowArena {
 public:
  RowArena(size_t rows, size_t stride)
      : rows_(rows), stride_(stride), buffer_(rows * stride * sizeof(float)) {}

  float* row(size_t r) noexcept { return data() + r * stride_; }
  const float* row(size_t r) const noexcept { return data() + r * stride_; }
  size_t stride() const noexcept { return stride_; }
  size_t rows() const noexcept { return rows_; }

 private:
  float* data() const noexcept { return static_cast<float*>(buffer_.data()); }
  size_t rows_;
  size_t stride_;
  LargeBuffer buffer_;
};

// A typed view of memory owned elsewhere (a shard's slice of its table's index buffer).
template <typename T>
class BufferSlice {
 public:
  BufferSlice() = default;
  BufferSlice(void* data, size_t n) : data_(static_cast<T*>(data)), n_(n) {}
  T* get() noexcept { return data_; }
  const T* get() const noexcept { return data_; }
  size_t size() const noexcept { return n_; }

 private:
  T* data_ = nullptr;
  size_t n_ = 0;
};

template <typename T>
class ZeroedBuffer {
 public:
  explicit ZeroedBuffer(size_t n) : n_(n), buffer_(n * sizeof(T)) {}
  T* get() noexcept { return static_cast<T*>(buffer_.data()); }
  const T* get() const noexcept { return static_cast<const T*>(buffer_.data()); }
  size_t size() const noexcept { return n_; }

 private:
  size_t n_;
  LargeBuffer buffer_;
};

}  // namespace embstore
