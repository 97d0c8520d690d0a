// File: embstore/internal/channel.hpp (private: not installed)
//
// A bounded blocking queue between the two threads of a checkpoint save or load (one copies
// or imports rows, the other writes or reads the file), so copy and I/O overlap while the
// memory in flight stays bounded. close() wakes both sides: push then fails and pop drains
// what is left.
#pragma once

#include <condition_variable>  // std::condition_variable
#include <cstddef>             // size_t
#include <deque>               // std::deque
#include <mutex>               // std::mutex, std::unique_lock
#include <utility>             // std::move

namespace embstore::internal {

template <typename T>
class Channel {
 public:
  explicit Channel(size_t capacity) : capacity_(capacity) {}

  bool push(T value) {  // false once closed
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return closed_ || queue_.size() < capacity_; });
    if (closed_) return false;
    queue_.push_back(std::move(value));
    cv_.notify_all();
    return true;
  }
  bool pop(T& out) {  // false once closed and empty
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
    if (queue_.empty()) return false;
    out = std::move(queue_.front());
    queue_.pop_front();
    cv_.notify_all();
    return true;
  }
  void close() {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<T> queue_;
  size_t capacity_;
  bool closed_ = false;
};

// Rows per chunk: at most 4 MiB of rows (at least 1024), as the Python writer.
inline size_t chunk_rows(size_t row_width) {
  const size_t rows = (size_t{4} << 20) / (4 * row_width);
  return rows < 1024 ? 1024 : rows;
}

}  // namespace embstore::internal
