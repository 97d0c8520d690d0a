// File: embstore/internal/batch_common.hpp
//
// Plumbing shared by the batch operations and their kernels: per-thread scratch
// (Workspace), prefetch helpers, worker counts, the shard rotation, flat task numbering and
// the stage clock. Internal: included by the core's .cpp files only.
#pragma once

#include <algorithm>  // std::min, std::max, std::upper_bound
#include <array>      // std::array
#include <atomic>     // std::atomic
#include <chrono>     // std::chrono::steady_clock
#include <cstddef>    // size_t
#include <cstdint>    // uint16_t, uint32_t, uint64_t
#include <string>     // std::string
#include <vector>     // std::vector

#include "embstore/arena.hpp"             // kCacheLine
#include "embstore/internal/tuning.hpp"   // kIdsPerWorker
#include "embstore/metrics.hpp"           // Timer, metrics_enabled
#include "embstore/resolution.hpp"        // RowResolution
#include "embstore/thread_pool.hpp"       // ThreadPool

namespace embstore::detail {

// "table 'label': " for error messages (empty without a label).
inline std::string prefix(const std::string& label) {
  return label.empty() ? std::string() : "table '" + label + "': ";
}

// Scratch reused across calls by each calling thread (no allocation per batch once warm).
struct Workspace {
  std::vector<uint32_t> order;        // (n) positions grouped by shard, stable
  std::vector<uint32_t> shard_begin;  // (S + 1)
  std::vector<uint32_t> cursor;       // (S)
  std::vector<uint16_t> shard_ids;    // (n)
  std::vector<uint32_t> bag_of;       // (n) apply with offsets
  std::vector<float> rows;            // (n, dim) gathered rows (lookups)
  bool one_hot = false;               // every bag holds exactly one id
  RowResolution resolution;           // a lookup's, to keep; or the one an apply took
  std::vector<uint64_t> pass;         // (S) a record-only locked pass's versions (gather_shard)
};

inline std::vector<Workspace>& thread_workspaces(size_t count) {
  thread_local std::vector<Workspace> spaces;
  if (spaces.size() < count) spaces.resize(count);
  return spaces;
}

inline Workspace& workspace(size_t k) { return thread_workspaces(k + 1)[k]; }

// The calling thread's workspaces for R requests, resolved before tasks run on helpers
// (whose own thread_local scratch is not the caller's).
inline std::vector<Workspace*> caller_workspaces(size_t count) {
  std::vector<Workspace>& spaces = thread_workspaces(count);
  std::vector<Workspace*> out(count);
  for (size_t k = 0; k < count; ++k) out[k] = &spaces[k];
  return out;
}

// Prefetches every cache line of [p, p + bytes), for reading or (kForWrite) for writing.
template <int kForWrite = 0, int kLocality = 3>
inline void prefetch_lines(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t off = 0; off < bytes; off += kCacheLine) {
    __builtin_prefetch(c + off, kForWrite, kLocality);
  }
}

inline size_t choose_workers(size_t total_ids, size_t max_threads) {
  return std::max<size_t>(1, std::min(max_threads, total_ids / kIdsPerWorker));
}

// Rotates each call's first shard so concurrent callers start on different locks.
inline size_t rotation() {
  static std::atomic<size_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed);
}

// Maps a flat task number over several requests to (request, task within it).
struct TaskSpace {
  std::vector<size_t> begin{0};
  void add(size_t tasks) { begin.push_back(begin.back() + tasks); }
  size_t total() const { return begin.back(); }
  size_t request_of(size_t task) const {
    return static_cast<size_t>(std::upper_bound(begin.begin(), begin.end(), task) - begin.begin()) -
           1;
  }
};

// Times the consecutive stages of one batch call (one clock read per stage, none when
// metrics are off) and records them, and the whole call, into every table of the call.
class StageClock {
 public:
  StageClock() : on_(metrics_enabled()) {
    if (!on_) return;
    start_ = last_ = std::chrono::steady_clock::now();
    ThreadPool::set_wait_sink(&ns_[static_cast<size_t>(Timer::kStageWait)]);
  }
  ~StageClock() {
    if (on_) ThreadPool::set_wait_sink(nullptr);
  }
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;
  void lap(Timer stage) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    ns_[static_cast<size_t>(stage)] += to_ns(now - last_);
    last_ = now;
  }
  template <typename Requests>
  void record(const Requests& requests, Timer op) const {
    if (!on_) return;
    const uint64_t total = to_ns(std::chrono::steady_clock::now() - start_);
    for (const auto& r : requests) {
      r.table->record_latency(op, total);
      for (size_t k = 0; k < ns_.size(); ++k) {
        if (ns_[k] != 0) r.table->record_latency(static_cast<Timer>(k), ns_[k]);
      }
    }
  }

 private:
  template <typename D>
  static uint64_t to_ns(D d) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  }
  bool on_;
  std::chrono::steady_clock::time_point start_, last_;
  std::array<uint64_t, static_cast<size_t>(Timer::kCount)> ns_{};
};

}  // namespace embstore::detail
