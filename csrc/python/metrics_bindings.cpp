// File: python/metrics_bindings.cpp
//
// Python access to the named layer timers (embstore/scoped_timer.hpp) and to raw histogram
// buckets, so a server can ship them (the PS Stats RPC) and a client can summarise the
// difference of two snapshots with the same percentile rule the tables use.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::vector, std::pair, std::string conversions

#include <cstdint>  // uint64_t
#include <cstring>  // std::memcpy
#include <string>   // std::string
#include <utility>  // std::pair
#include <vector>   // std::vector

#include "embstore/metrics.hpp"       // LatencyHistogram, HistogramSnapshot, timer_name
#include "embstore/scoped_timer.hpp"  // metrics::histogram, snapshot_all, reset_all
#include "embstore/table.hpp"         // Table::timers

#include "python/bindings.hpp"  // bind_* declarations

namespace py = pybind11;
using embstore::HistogramSnapshot;
using embstore::LatencyHistogram;

namespace {

constexpr size_t kCountBytes = sizeof(HistogramSnapshot::counts);

HistogramSnapshot snapshot_from(const py::bytes& counts, uint64_t sum_ns, uint64_t max_ns,
                                uint64_t resets) {
  const std::string raw = counts;
  if (raw.size() != kCountBytes) {
    throw py::value_error("counts: expected " + std::to_string(kCountBytes) +
                          " bytes (little-endian uint64 buckets), got " +
                          std::to_string(raw.size()));
  }
  HistogramSnapshot s;
  std::memcpy(s.counts.data(), raw.data(), kCountBytes);
  s.sum_ns = sum_ns;
  s.max_ns = max_ns;
  s.resets = resets;
  return s;
}

py::dict summarize(const HistogramSnapshot& before, const HistogramSnapshot& now) {
  const embstore::LatencySummary l = LatencyHistogram::summarize(before, now);
  py::dict e;
  e["count"] = l.count;
  e["p50_us"] = l.p50_us;
  e["p95_us"] = l.p95_us;
  e["p99_us"] = l.p99_us;
  e["max_us"] = l.max_us;
  e["mean_us"] = l.mean_us;
  return e;
}

std::vector<std::pair<std::string, HistogramSnapshot>> table_histograms(const embstore::Table& t) {
  std::vector<std::pair<std::string, HistogramSnapshot>> out;
  const auto& timers = t.timers();
  for (size_t k = 0; k < timers.size(); ++k) {
    out.emplace_back(embstore::timer_name(static_cast<embstore::Timer>(k)), timers[k].snapshot());
  }
  return out;
}

}  // namespace

namespace embstore_py {

void bind_timers(py::module_& m) {
  py::class_<HistogramSnapshot>(m, "HistogramSnapshot")
      .def(py::init<>())
      .def(py::init(&snapshot_from), py::arg("counts"), py::arg("sum_ns"), py::arg("max_ns"),
           py::arg("resets"))
      .def_property_readonly("counts",
                             [](const HistogramSnapshot& s) {
                               return py::bytes(reinterpret_cast<const char*>(s.counts.data()),
                                                kCountBytes);
                             })
      .def_readonly("sum_ns", &HistogramSnapshot::sum_ns)
      .def_readonly("max_ns", &HistogramSnapshot::max_ns)
      .def_readonly("resets", &HistogramSnapshot::resets);

  // Owned by the process-wide registry, never freed: Python holds plain references.
  py::class_<LatencyHistogram, std::unique_ptr<LatencyHistogram, py::nodelete>>(m,
                                                                                "LatencyHistogram")
      .def(
          "record",
          [](LatencyHistogram& h, uint64_t ns) {
            if (embstore::metrics_enabled()) h.record(ns);
          },
          py::arg("ns"))
      .def("snapshot", &LatencyHistogram::snapshot);

  m.def("named_histogram", &embstore::metrics::histogram, py::arg("name"),
        py::return_value_policy::reference);
  m.def("named_histograms", &embstore::metrics::snapshot_all);
  m.def("reset_named_histograms", &embstore::metrics::reset_all);
  m.def("table_histograms", &table_histograms, py::arg("table"));
  m.def("summarize_histograms", &summarize, py::arg("before"), py::arg("now"));
}

}  // namespace embstore_py
