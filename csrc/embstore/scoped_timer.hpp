// File: embstore/scoped_timer.hpp
//
// Named, process-wide latency histograms for the layers around the store (trainer, client,
// RPC, server): `embstore::metrics::histogram("server.Lookup.Handle")` returns the one
// histogram of that name (created on first use, never freed, so a reference may be cached),
// and `embstore::metrics::ScopedTimer` times a scope into it. Recording is the same
// lock-free LatencyHistogram the tables use; only the first lookup of a name takes a lock.
#pragma once

#include <cstdint>  // uint64_t
#include <string>   // std::string
#include <utility>  // std::pair
#include <vector>   // std::vector

#include "embstore/metrics.hpp"  // LatencyHistogram, HistogramSnapshot, metrics_enabled

namespace embstore::metrics {

// The histogram named `name`, of the form "<layer>.<rest>" (e.g. "server.Lookup.Handle").
// Throws std::invalid_argument for a name without a non-empty layer and rest.
LatencyHistogram& histogram(const std::string& name);

// Every named histogram at one moment, sorted by name.
std::vector<std::pair<std::string, HistogramSnapshot>> snapshot_all();

// Clear every named histogram (a new window, like the tables' reset_timers).
void reset_all() noexcept;

// Times a scope into a named histogram when metrics are enabled (embstore::ScopedTimer,
// also given a histogram by name).
class ScopedTimer : public embstore::ScopedTimer {
 public:
  explicit ScopedTimer(LatencyHistogram& h) noexcept : embstore::ScopedTimer(&h) {}
  // Looks the name up on every construction: cache histogram(name) on hot paths.
  explicit ScopedTimer(const std::string& name) : ScopedTimer(histogram(name)) {}
};

}  // namespace embstore::metrics
