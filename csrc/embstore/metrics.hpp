// File: embstore/metrics.hpp
//
// Latency histograms cheap enough to leave on: log-linear buckets (8 per power of two, so
// a percentile is exact to within 12.5%) of relaxed atomic counters. Recording is one
// clock read per stage and one fetch_add, lock-free; reading merges nothing but the
// buckets, so a snapshot taken while others record is approximate but never torn per bucket.
// A process-wide switch (EMBSTORE_METRICS=0 at start, or set_metrics_enabled) turns every
// timer into a no-op.
#pragma once

#include <array>    // std::array
#include <atomic>   // std::atomic
#include <chrono>   // std::chrono::steady_clock
#include <cstddef>  // size_t
#include <cstdint>  // uint64_t

namespace embstore {

bool metrics_enabled() noexcept;
void set_metrics_enabled(bool on) noexcept;

struct LatencySummary {
  uint64_t count = 0;
  double p50_us = 0, p95_us = 0, p99_us = 0, max_us = 0, mean_us = 0;
};

class LatencyHistogram;

// A copy of a histogram's counters at one moment: two of them give a window's summary.
struct HistogramSnapshot {
  std::array<uint64_t, 1 + (40 - 7) * 8> counts{};  // LatencyHistogram::kBuckets
  uint64_t sum_ns = 0, max_ns = 0;
  uint64_t resets = 0;  // reset() calls so far: a window spanning one starts from zero
};

class LatencyHistogram {
 public:
  static constexpr int kSubBits = 3;                 // 8 sub-buckets per power of two
  static constexpr int kMinExp = 7;                  // below 128 ns: bucket 0
  static constexpr int kMaxExp = 40;                 // ~18 minutes: last bucket
  static constexpr size_t kBuckets = 1 + (kMaxExp - kMinExp) * (1 << kSubBits);

  void record(uint64_t ns) noexcept;
  LatencySummary summary() const noexcept;  // since the last reset
  HistogramSnapshot snapshot() const noexcept;
  // The values recorded between two snapshots (all of `now` if a reset came between).
  static LatencySummary summarize(const HistogramSnapshot& before,
                                  const HistogramSnapshot& now) noexcept;
  void reset() noexcept;

  // Bucket of a duration, and the upper bound of a bucket (the value percentiles report).
  static size_t bucket_of(uint64_t ns) noexcept;
  static double bucket_upper_ns(size_t bucket) noexcept;

 private:
  std::array<std::atomic<uint64_t>, kBuckets> buckets_{};
  std::atomic<uint64_t> sum_ns_{0}, max_ns_{0}, resets_{0};
};
static_assert(sizeof(HistogramSnapshot::counts) / sizeof(uint64_t) == LatencyHistogram::kBuckets,
              "HistogramSnapshot holds every bucket");

// What a table times: its operations, then the stages of a batch.
enum class Timer : uint8_t {
  kLookup,
  kLookupSum,
  kApplyGradients,
  kContains,
  kErase,
  kGroupLookupSum,        // TableGroup.lookup_sum (recorded in every table of the call)
  kGroupApplyGradients,   // TableGroup.apply_gradients
  kSave,                  // a checkpoint written (save / save_delta), begin to commit
  kLoad,                  // a table loaded from a checkpoint (recorded by the loader)
  kStageValidate,  // argument checks (offsets, finite values)
  kStagePlan,      // grouping ids by shard (apply; lookups on the locked path)
  kStageGather,    // lookups: lock-free index probe + row read + per-bag sums
  kStageLockedGather,  // lookups that insert (or raced): rows copied under the shard locks
  kStagePool,      // ... and their per-bag sums
  kStageUpdate,    // apply: duplicate sums + fused optimizer, under the shard locks
  kStageWait,      // the caller waiting for helper threads after its own tasks (imbalance)
  kCount
};
const char* timer_name(Timer t) noexcept;

// A table's histograms, one per Timer, each allocated on its first record: a table sees a
// few kinds of call, and 16 eager histograms (2.1 KiB each) were most of a small table.
class TimerSet {
 public:
  static constexpr size_t kSize = static_cast<size_t>(Timer::kCount);
  TimerSet() = default;
  ~TimerSet();
  TimerSet(const TimerSet&) = delete;
  TimerSet& operator=(const TimerSet&) = delete;

  size_t size() const noexcept { return kSize; }
  // Histogram k, or an empty one if nothing was recorded there yet.
  const LatencyHistogram& operator[](size_t k) const noexcept;
  // Histogram k, allocated if needed; nullptr only if that allocation failed.
  LatencyHistogram* get(size_t k) noexcept {
    LatencyHistogram* h = slots_[k].load(std::memory_order_acquire);
    return h != nullptr ? h : make(k);
  }
  void reset() noexcept;

 private:
  LatencyHistogram* make(size_t k) noexcept;
  std::array<std::atomic<LatencyHistogram*>, kSize> slots_{};
};

// Times a scope into `histogram` when metrics are enabled (one steady_clock read each end).
class ScopedTimer {
 public:
  explicit ScopedTimer(LatencyHistogram* histogram) noexcept
      : histogram_(metrics_enabled() ? histogram : nullptr),
        start_(histogram_ ? std::chrono::steady_clock::now()
                          : std::chrono::steady_clock::time_point{}) {}
  ~ScopedTimer() {
    if (histogram_ != nullptr) {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - start_)
                          .count();
      histogram_->record(static_cast<uint64_t>(ns));
    }
  }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  LatencyHistogram* histogram_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace embstore
