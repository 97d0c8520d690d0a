// File: python/latency.hpp
//
// A table's latency histograms as Python dicts: summaries, timer snapshots and the
// difference between two of them.
#pragma once

#include <pybind11/pybind11.h>

#include <string>  // std::string
#include <vector>  // std::vector

#include "embstore/metrics.hpp"  // LatencyHistogram, HistogramSnapshot, Timer
#include "embstore/table.hpp"    // Table

namespace embstore_py {

namespace py = pybind11;

inline py::dict summary_dict(const embstore::LatencySummary& l) {
  py::dict e;
  e["count"] = l.count;
  e["p50_us"] = l.p50_us;
  e["p95_us"] = l.p95_us;
  e["p99_us"] = l.p99_us;
  e["max_us"] = l.max_us;
  e["mean_us"] = l.mean_us;
  return e;
}

// Every timer of a table at one moment (opaque to Python: handed back to latency_between).
struct TimerSnapshot {
  std::vector<embstore::HistogramSnapshot> timers;
};

inline TimerSnapshot take_snapshot(const embstore::Table& t) {
  TimerSnapshot snap;
  const embstore::TimerSet& timers = t.timers();
  for (size_t k = 0; k < timers.size(); ++k) snap.timers.push_back(timers[k].snapshot());
  return snap;
}

// name -> summary of what each timer recorded between two snapshots (names with none left out).
inline py::dict latency_between(const TimerSnapshot& before, const TimerSnapshot& now) {
  py::dict latency;
  const embstore::HistogramSnapshot empty;
  for (size_t k = 0; k < now.timers.size(); ++k) {
    const embstore::LatencySummary l = embstore::LatencyHistogram::summarize(
        k < before.timers.size() ? before.timers[k] : empty, now.timers[k]);
    if (l.count == 0) continue;
    latency[embstore::timer_name(static_cast<embstore::Timer>(k))] = summary_dict(l);
  }
  return latency;
}

inline embstore::Timer timer_by_name(const std::string& name) {
  for (size_t k = 0; k < static_cast<size_t>(embstore::Timer::kCount); ++k) {
    const auto t = static_cast<embstore::Timer>(k);
    if (name == embstore::timer_name(t)) return t;
  }
  throw py::value_error("unknown timer '" + name + "'");
}

}  // namespace embstore_py
