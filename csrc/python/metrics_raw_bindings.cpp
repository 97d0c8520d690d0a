// File: python/metrics_raw_bindings.cpp
//
// The raw latency histograms (bucket counts, sum, max) of a table, and the summary of a
// histogram given that way: so histograms of several processes (the shards of a sharded
// store) can be added bucket by bucket before percentiles are taken (an average of P99s is
// not a P99). Percentiles are computed by the core's own summarize().
#include <pybind11/numpy.h>     // py::array_t
#include <pybind11/pybind11.h>

#include <cstdint>  // uint64_t
#include <cstring>  // std::memcpy
#include <memory>   // std::shared_ptr

#include "embstore/metrics.hpp"  // LatencyHistogram, HistogramSnapshot, timer_name
#include "embstore/table.hpp"    // Table

#include "python/bindings.hpp"  // bind_* declarations

namespace py = pybind11;

namespace embstore_py {

void bind_metrics_raw(py::module_& m) {
  using embstore::HistogramSnapshot;
  using embstore::LatencyHistogram;
  m.attr("LATENCY_BUCKETS") = py::int_(LatencyHistogram::kBuckets);

  // name -> (counts uint64 [LATENCY_BUCKETS], sum_ns, max_ns) since the last reset, for every
  // timer that recorded something.
  m.def(
      "timer_buckets",
      [](const std::shared_ptr<embstore::Table>& t) {
        py::dict out;
        for (size_t k = 0; k < t->timers().size(); ++k) {
          const HistogramSnapshot s = t->timers()[k].snapshot();
          uint64_t total = 0;
          for (uint64_t c : s.counts) total += c;
          if (total == 0) continue;
          py::array_t<uint64_t> counts(static_cast<py::ssize_t>(s.counts.size()));
          std::memcpy(counts.mutable_data(), s.counts.data(), sizeof(s.counts));
          out[embstore::timer_name(static_cast<embstore::Timer>(k))] =
              py::make_tuple(counts, s.sum_ns, s.max_ns);
        }
        return out;
      },
      py::arg("table"));

  // The summary ({count, p50_us, p95_us, p99_us, max_us, mean_us}) of a histogram given by
  // its bucket counts, sum and max, exactly as Table.stats() summarises its own.
  m.def(
      "summarize_buckets",
      [](const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& counts,
         uint64_t sum_ns, uint64_t max_ns) {
        HistogramSnapshot s;
        if (counts.ndim() != 1 || static_cast<size_t>(counts.shape(0)) != s.counts.size()) {
          throw py::value_error("counts: expected LATENCY_BUCKETS bucket counts");
        }
        std::memcpy(s.counts.data(), counts.data(), sizeof(s.counts));
        s.sum_ns = sum_ns;
        s.max_ns = max_ns;
        const embstore::LatencySummary l = LatencyHistogram::summarize(HistogramSnapshot{}, s);
        py::dict d;
        d["count"] = l.count;
        d["p50_us"] = l.p50_us;
        d["p95_us"] = l.p95_us;
        d["p99_us"] = l.p99_us;
        d["max_us"] = l.max_us;
        d["mean_us"] = l.mean_us;
        return d;
      },
      py::arg("counts"), py::arg("sum_ns"), py::arg("max_ns"));

  m.def("latency_bucket_of", &LatencyHistogram::bucket_of, py::arg("ns"));
}

}  // namespace embstore_py
