// File: embstore/buffer_pool.hpp
//
// BufferPool: recycles the memory of batch results (lookup outputs) between calls. A [B, D]
// result is hundreds of KiB to many MiB, so the system allocator serves it with fresh pages
// (glibc: mmap above its threshold, or a heap top it trims when the result is freed), and
// writing it page-faults on every 4 KiB (a large share of a one-hot forward, until something
// else in the process happens to raise glibc's thresholds). A buffer released here is
// handed to the next request of the same size, its pages still mapped.
//
// Buffers are 64-byte aligned. The pool keeps at most limit() bytes of released buffers, and
// none larger than a quarter of it (a release beyond that frees the memory), so a one-off
// huge result is not held for the life of the process. Thread-safe.
#pragma once

#include <cstddef>        // size_t
#include <mutex>          // std::mutex
#include <unordered_map>  // std::unordered_map
#include <vector>         // std::vector

namespace embstore {

class BufferPool {
 public:
  static constexpr size_t kDefaultLimit = size_t{64} << 20;

  // The process-wide pool (never destroyed: results may outlive static destruction order).
  static BufferPool& global();

  explicit BufferPool(size_t limit = kDefaultLimit) : limit_(limit) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `bytes` bytes (contents unspecified). Throws std::bad_alloc.
  void* acquire(size_t bytes);
  // Returns a buffer from acquire() (of any pool: each remembers its size; nullptr is ignored).
  void release(void* data) noexcept;

  size_t pooled_bytes() const;  // bytes held in released buffers
  size_t limit() const;
  void set_limit(size_t bytes);  // frees released buffers beyond the new limit

 private:
  void trim_locked(size_t limit) noexcept;

  mutable std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // released buffers by size class
  size_t pooled_ = 0;
  size_t limit_;
};

}  // namespace embstore
