#include "embstore/metrics.hpp"

#include <algorithm>  // std::min
#include <cstdlib>  // std::getenv
#include <cstring>  // std::strcmp
#include <new>      // std::nothrow

namespace embstore {
namespace {

std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> flag{[] {
    const char* env = std::getenv("EMBSTORE_METRICS");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }()};
  return flag;
}

}  // namespace

bool metrics_enabled() noexcept { return enabled_flag().load(std::memory_order_relaxed); }
void set_metrics_enabled(bool on) noexcept { enabled_flag().store(on, std::memory_order_relaxed); }

size_t LatencyHistogram::bucket_of(uint64_t ns) noexcept {
  if (ns < (uint64_t{1} << kMinExp)) return 0;
  const int exp = 63 - __builtin_clzll(ns);
  if (exp >= kMaxExp) return kBuckets - 1;
  const size_t sub = static_cast<size_t>((ns >> (exp - kSubBits)) & ((1u << kSubBits) - 1));
  return 1 + static_cast<size_t>(exp - kMinExp) * (1u << kSubBits) + sub;
}

double LatencyHistogram::bucket_upper_ns(size_t bucket) noexcept {
  if (bucket == 0) return static_cast<double>(uint64_t{1} << kMinExp);
  const size_t k = bucket - 1;
  const int exp = kMinExp + static_cast<int>(k >> kSubBits);
  const double sub = static_cast<double>(k & ((1u << kSubBits) - 1));
  const double base = static_cast<double>(uint64_t{1} << exp);
  return base + (sub + 1.0) * base / (1 << kSubBits);
}

void LatencyHistogram::record(uint64_t ns) noexcept {
  buckets_[bucket_of(ns)].fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(ns, std::memory_order_relaxed);
  uint64_t seen = max_ns_.load(std::memory_order_relaxed);
  while (ns > seen && !max_ns_.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
  }
}

HistogramSnapshot LatencyHistogram::snapshot() const noexcept {
  HistogramSnapshot snap;
  for (size_t b = 0; b < kBuckets; ++b)
    snap.counts[b] = buckets_[b].load(std::memory_order_relaxed);
  snap.sum_ns = sum_ns_.load(std::memory_order_relaxed);
  snap.max_ns = max_ns_.load(std::memory_order_relaxed);
  snap.resets = resets_.load(std::memory_order_relaxed);
  return snap;
}

LatencySummary LatencyHistogram::summary() const noexcept {
  return summarize(HistogramSnapshot{}, snapshot());
}

LatencySummary LatencyHistogram::summarize(const HistogramSnapshot& before,
                                           const HistogramSnapshot& now) noexcept {
  LatencySummary s;
  std::array<uint64_t, kBuckets> counts;
  uint64_t total = 0, highest = 0;
  bool was_reset = now.resets != before.resets;
  for (size_t b = 0; b < kBuckets; ++b) was_reset = was_reset || now.counts[b] < before.counts[b];
  const HistogramSnapshot empty;
  const HistogramSnapshot& base = was_reset ? empty : before;  // reset() between: all is new
  for (size_t b = 0; b < kBuckets; ++b) {
    counts[b] = now.counts[b] - base.counts[b];
    total += counts[b];
    if (counts[b] != 0) highest = b;
  }
  s.count = total;
  if (total == 0) return s;
  // The largest value of the window: exact when it raised the running maximum, else the
  // upper bound of the highest bucket the window filled (never above the running maximum).
  const double running_max = static_cast<double>(now.max_ns);
  const double max_ns =
      now.max_ns > base.max_ns ? running_max : std::min(bucket_upper_ns(highest), running_max);
  // The q-quantile is the upper bound of the bucket holding the ceil(q * total)-th value,
  // capped by the largest value seen.
  auto quantile = [&](double q) {
    const uint64_t rank = static_cast<uint64_t>(q * static_cast<double>(total) + 0.999999);
    uint64_t cumulative = 0;
    for (size_t b = 0; b < kBuckets; ++b) {
      cumulative += counts[b];
      if (cumulative >= rank) {
        const double v = bucket_upper_ns(b);
        return (v < max_ns ? v : max_ns) / 1000.0;
      }
    }
    return max_ns / 1000.0;
  };
  s.p50_us = quantile(0.50);
  s.p95_us = quantile(0.95);
  s.p99_us = quantile(0.99);
  s.max_us = max_ns / 1000.0;
  s.mean_us = static_cast<double>(now.sum_ns - base.sum_ns) / static_cast<double>(total) / 1000.0;
  return s;
}

void LatencyHistogram::reset() noexcept {
  resets_.fetch_add(1, std::memory_order_relaxed);
  for (auto& b : buckets_) b.store(0, std::memory_order_relaxed);
  sum_ns_.store(0, std::memory_order_relaxed);
  max_ns_.store(0, std::memory_order_relaxed);
}

TimerSet::~TimerSet() {
  for (auto& slot : slots_) delete slot.load(std::memory_order_relaxed);
}

const LatencyHistogram& TimerSet::operator[](size_t k) const noexcept {
  static const LatencyHistogram* const empty = new LatencyHistogram();  // never destroyed
  const LatencyHistogram* h = slots_[k].load(std::memory_order_acquire);
  return h != nullptr ? *h : *empty;
}

LatencyHistogram* TimerSet::make(size_t k) noexcept {
  auto* made = new (std::nothrow) LatencyHistogram();
  if (made == nullptr) return nullptr;  // this record is lost; the next one tries again
  LatencyHistogram* seen = nullptr;
  if (slots_[k].compare_exchange_strong(seen, made, std::memory_order_acq_rel)) return made;
  delete made;  // another thread's came first
  return seen;
}

void TimerSet::reset() noexcept {
  for (auto& slot : slots_) {
    if (LatencyHistogram* h = slot.load(std::memory_order_acquire)) h->reset();
  }
}

const char* timer_name(Timer t) noexcept {
  switch (t) {
    case Timer::kLookup: return "lookup";
    case Timer::kLookupSum: return "lookup_sum";
    case Timer::kApplyGradients: return "apply_gradients";
    case Timer::kContains: return "contains";
    case Timer::kErase: return "erase";
    case Timer::kGroupLookupSum: return "group.lookup_sum";
    case Timer::kGroupApplyGradients: return "group.apply_gradients";
    case Timer::kSave: return "save";
    case Timer::kLoad: return "load";
    case Timer::kStageValidate: return "stage.validate";
    case Timer::kStagePlan: return "stage.plan";
    case Timer::kStageGather: return "stage.gather";
    case Timer::kStageLockedGather: return "stage.locked_gather";
    case Timer::kStagePool: return "stage.pool";
    case Timer::kStageUpdate: return "stage.update";
    case Timer::kStageWait: return "stage.wait";
    case Timer::kCount: break;
  }
  return "?";
}

}  // namespace embstore
