// File: python/metrics_bindings.cpp
//
// Python access to the named layer timers (embstore/scoped_timer.hpp) and to raw histogram
// buckets, so a server can ship them (the PS Stats RPC, a Ray actor's stats) and a client can
// add the snapshots of several processes bucket by bucket (an average of P99s is not a P99)
// and summarise them with the same percentile rule the tables use.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::vector, std::pair, std::string conversions

#include <algorithm>  // std::max
#include <cstdint>  // uint64_t
#include <cstring>    // std::memcpy
#include <memory>     // std::unique_ptr
#include <string>     // std::string
#include <utility>  // std::pair
#include <vector>   // std::vector

#include "embstore/metrics.hpp"       // LatencyHistogram, HistogramSnapshot, timer_name
#include "embstore/scoped_timer.hpp"  // metrics::histogram, snapshot_all, reset_all
#include "embstore/table.hpp"         // Table::timers

#include "python/bindings.hpp"  // bind_* declarations
#include "python/latency.hpp"   // summary_dict

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

py::tuple snapshot_state(const HistogramSnapshot& s) {
  return py::make_tuple(py::bytes(reinterpret_cast<const char*>(s.counts.data()), kCountBytes),
                        s.sum_ns, s.max_ns, s.resets);
}

HistogramSnapshot snapshot_from_state(const py::tuple& t) {
  if (t.size() != 4) throw py::value_error("HistogramSnapshot state: expected 4 fields");
  return snapshot_from(t[0].cast<py::bytes>(), t[1].cast<uint64_t>(), t[2].cast<uint64_t>(),
                       t[3].cast<uint64_t>());
}

// One histogram of everything the parts recorded: buckets and sums added, the largest max.
HistogramSnapshot merge(const std::vector<HistogramSnapshot>& parts) {
  HistogramSnapshot out;
  for (const HistogramSnapshot& p : parts) {
    for (size_t b = 0; b < out.counts.size(); ++b) out.counts[b] += p.counts[b];
    out.sum_ns += p.sum_ns;
    out.max_ns = std::max(out.max_ns, p.max_ns);
    out.resets += p.resets;
  }
  return out;
}

// A registry histogram (borrowed; recording from Python obeys the metrics switch, like the
// core's scoped timers) or a standalone one (owned; records unconditionally, for client-side
// layers that keep their own histograms outside the process-wide registry).
class PyHistogram {
 public:
  PyHistogram() : owned_(std::make_unique<LatencyHistogram>()), h_(owned_.get()) {}
  explicit PyHistogram(LatencyHistogram& shared) : h_(&shared) {}

  void record(uint64_t ns) {
    if (owned_ || embstore::metrics_enabled()) h_->record(ns);
  }
  HistogramSnapshot snapshot() const { return h_->snapshot(); }

 private:
  std::unique_ptr<LatencyHistogram> owned_;
  LatencyHistogram* h_;
};

py::dict summarize(const HistogramSnapshot& before, const HistogramSnapshot& now) {
  return embstore_py::summary_dict(LatencyHistogram::summarize(before, now));
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
      .def_readonly("resets", &HistogramSnapshot::resets)
      .def(py::pickle(&snapshot_state, &snapshot_from_state));

  py::class_<PyHistogram>(m, "LatencyHistogram")
      .def(py::init<>())
      .def("record", &PyHistogram::record, py::arg("ns"))
      .def("snapshot", &PyHistogram::snapshot);

  m.def(
      "named_histogram",
      [](const std::string& name) { return PyHistogram(embstore::metrics::histogram(name)); },
      py::arg("name"));
  m.def("named_histograms", &embstore::metrics::snapshot_all);
  m.def("reset_named_histograms", &embstore::metrics::reset_all);
  m.def("table_histograms", &table_histograms, py::arg("table"));
  m.def("merge_histograms", &merge, py::arg("parts"));
  m.def("summarize_histograms", &summarize, py::arg("before"), py::arg("now"));
}

}  // namespace embstore_py
