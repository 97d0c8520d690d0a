// File: embstore/buffer_pool.cpp
#include "embstore/buffer_pool.hpp"

#include <cstdlib>   // std::aligned_alloc, std::free
#include <iterator>  // std::next
#include <new>       // std::bad_alloc

namespace embstore {
namespace {

// Each buffer starts with a 64-byte header holding its size class, so release() needs only
// the data pointer (a numpy array's deleter gets nothing else) and the data stays aligned.
constexpr size_t kHeader = 64;
// Size classes: whole 4 KiB pages, so results of nearly equal sizes share buffers.
constexpr size_t kGranule = 4096;

size_t size_class(size_t bytes) noexcept { return (bytes + kGranule - 1) / kGranule * kGranule; }
size_t& header(void* data) noexcept {
  return *reinterpret_cast<size_t*>(static_cast<char*>(data) - kHeader);
}

}  // namespace

BufferPool& BufferPool::global() {
  static BufferPool* pool = new BufferPool();
  return *pool;
}

BufferPool::~BufferPool() {
  for (auto& [cls, list] : free_) {
    for (void* data : list) std::free(static_cast<char*>(data) - kHeader);
  }
}

void* BufferPool::acquire(size_t bytes) {
  const size_t cls = size_class(bytes);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(cls);
    if (it != free_.end() && !it->second.empty()) {
      void* data = it->second.back();
      it->second.pop_back();
      pooled_ -= cls;
      return data;
    }
  }
  void* base = std::aligned_alloc(kHeader, kHeader + cls);
  if (base == nullptr) throw std::bad_alloc();
  void* data = static_cast<char*>(base) + kHeader;
  header(data) = cls;
  return data;
}

void BufferPool::release(void* data) noexcept {
  if (data == nullptr) return;
  const size_t cls = header(data);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (cls != 0 && cls <= limit_ / 4 && pooled_ + cls <= limit_) {
      try {
        free_[cls].push_back(data);
        pooled_ += cls;
        return;
      } catch (...) {  // no memory for the list entry: free the buffer instead
      }
    }
  }
  std::free(static_cast<char*>(data) - kHeader);
}

size_t BufferPool::pooled_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pooled_;
}

size_t BufferPool::limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limit_;
}

void BufferPool::set_limit(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = bytes;
  trim_locked(bytes);
}

void BufferPool::trim_locked(size_t limit) noexcept {
  for (auto it = free_.begin(); it != free_.end() && pooled_ > limit;) {
    std::vector<void*>& list = it->second;
    while (!list.empty() && pooled_ > limit) {
      std::free(static_cast<char*>(list.back()) - kHeader);
      list.pop_back();
      pooled_ -= it->first;
    }
    it = list.empty() ? free_.erase(it) : std::next(it);
  }
}

}  // namespace embstore
