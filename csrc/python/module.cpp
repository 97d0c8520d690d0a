// File: python/module.cpp
//
// The embstore._core module: binds each feature (bindings.hpp: bind_<feature>) and the
// process-wide knobs (output pool, thread pool, metrics, SIMD level) defined here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::vector, std::string conversions

#include <cstdint>  // uint32_t, uint64_t
#include <string>   // std::string
#include <vector>   // std::vector

#include "embstore/buffer_pool.hpp"  // BufferPool
#include "embstore/errors.hpp"       // CapacityError
#include "embstore/metrics.hpp"      // metrics_enabled, LatencyHistogram
#include "embstore/simd.hpp"         // simd_level, set_simd_level
#include "embstore/thread_pool.hpp"  // ThreadPool
#include "python/arrays.hpp"         // new_rows
#include "python/bindings.hpp"       // bind_table, bind_snapshot, bind_group, bind_runtime
#include "python/latency.hpp"        // TimerSnapshot, latency_between, summary_dict

namespace py = pybind11;

namespace embstore_py {
namespace {

// Test and benchmark seam: the kernels' instruction set (results are the same bits).
void set_simd_level(const std::string& name) {
  embstore::SimdLevel level;
  if (name == "baseline") {
    level = embstore::SimdLevel::kBaseline;
  } else if (name == "avx2") {
    level = embstore::SimdLevel::kAvx2;
  } else {
    throw py::value_error("simd level must be 'baseline' or 'avx2', not '" + name + "'");
  }
  if (!embstore::set_simd_level(level)) {
    throw py::value_error("this CPU (or build) cannot run the '" + name + "' kernels");
  }
}

// Test seam: the percentile summary of given durations, as the tables compute it.
py::dict histogram_summary(const std::vector<uint64_t>& values_ns) {
  embstore::LatencyHistogram h;
  for (uint64_t v : values_ns) h.record(v);
  return summary_dict(h.summary());
}

}  // namespace

void bind_runtime(py::module_& m) {
  py::class_<TimerSnapshot>(m, "TimerSnapshot").def(py::init<>());  // empty: before anything
  m.def("latency_between", &latency_between, py::arg("before"), py::arg("now"));
  m.def("histogram_summary", &histogram_summary, py::arg("values_ns"));
  // A new float32 [rows, dim] array for a batch result, its memory from the output pool.
  m.def(
      "empty_rows",
      [](py::ssize_t rows, py::ssize_t dim) {
        if (rows < 0 || dim < 0) throw py::value_error("rows and dim must be >= 0");
        return new_rows(rows, dim);
      },
      py::arg("rows"), py::arg("dim"));
  m.def("output_pool_bytes", [] { return embstore::BufferPool::global().pooled_bytes(); });
  m.def("output_pool_limit", [] { return embstore::BufferPool::global().limit(); });
  m.def(
      "set_output_pool_limit",
      [](size_t bytes) { embstore::BufferPool::global().set_limit(bytes); }, py::arg("bytes"));
  m.def("hardware_threads", &embstore::ThreadPool::hardware_threads);
  m.def("pool_spin_us", [] { return embstore::ThreadPool::global().spin_us(); });
  m.def(
      "set_pool_spin_us", [](uint32_t us) { embstore::ThreadPool::global().set_spin_us(us); },
      py::arg("us"));
  m.def("metrics_enabled", &embstore::metrics_enabled);
  m.def("set_metrics_enabled", &embstore::set_metrics_enabled, py::arg("on"));
  m.def("simd_level",
        [] { return std::string(embstore::simd_level_name(embstore::simd_level())); });
  m.def("set_simd_level", &set_simd_level, py::arg("level"));
}

}  // namespace embstore_py

PYBIND11_MODULE(_core, m) {
  m.doc() = "embstore C++ core (private: use the embstore package)";
  py::register_exception<embstore::CapacityError>(m, "CapacityError", PyExc_RuntimeError);
  embstore_py::bind_runtime(m);
  embstore_py::bind_table(m);
  embstore_py::bind_snapshot(m);
  embstore_py::bind_group(m);
  embstore_py::bind_timers(m);
  embstore_py::bind_route(m);
  embstore_py::bind_checkpoint(m);
}
