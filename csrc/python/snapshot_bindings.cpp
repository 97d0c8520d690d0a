// File: python/snapshot_bindings.cpp
//
// _core.Snapshot: a point-in-time copy of a table, streamed out shard by shard (see
// embstore/snapshot.hpp), and begin_snapshot, which starts one.
#include <pybind11/numpy.h>  // py::array
#include <pybind11/pybind11.h>

#include <memory>  // std::shared_ptr, std::unique_ptr

#include "embstore/snapshot.hpp"  // Snapshot, SnapshotMode
#include "embstore/table.hpp"     // Table
#include "python/arrays.hpp"      // checked_data, vector_copy
#include "python/bindings.hpp"    // bind_snapshot

namespace embstore_py {
namespace {

using embstore::Snapshot;
using embstore::Table;

// A Snapshot that keeps its table alive (the Python object may outlive the facade's table).
struct PySnapshot {
  std::shared_ptr<Table> table;
  std::unique_ptr<Snapshot> snap;
};

std::shared_ptr<PySnapshot> begin_snapshot(const std::shared_ptr<Table>& t, int mode) {
  if (mode < 0 || mode > 2) {
    throw py::value_error("mode: must be 0 (full), 1 (delta) or 2 (export)");
  }
  auto out = std::make_shared<PySnapshot>();
  out->table = t;
  py::gil_scoped_release release;  // waits while another snapshot of the table runs
  out->snap = std::make_unique<Snapshot>(*t, static_cast<embstore::SnapshotMode>(mode));
  return out;
}

size_t next(PySnapshot& p, size_t s, const py::array& ids, const py::array& rows,
            const py::array& steps) {
  uint64_t* k = checked_data<uint64_t>(ids, "ids", -1, 0, true);
  const auto cap = ids.shape(0);
  float* r =
      checked_data<float>(rows, "rows", cap, static_cast<py::ssize_t>(p.snap->row_width()), true);
  uint32_t* st = checked_data<uint32_t>(steps, "steps", cap, 0, true);
  py::gil_scoped_release release;
  return p.snap->next(s, k, r, st, static_cast<size_t>(cap));
}

}  // namespace

void bind_snapshot(py::module_& m) {
  py::class_<PySnapshot, std::shared_ptr<PySnapshot>>(m, "Snapshot")
      .def_property_readonly("num_shards", [](const PySnapshot& p) { return p.snap->num_shards(); })
      .def_property_readonly("row_width", [](const PySnapshot& p) { return p.snap->row_width(); })
      .def_property_readonly("step", [](const PySnapshot& p) { return p.snap->step(); })
      .def_property_readonly("step_tracking",
                             [](const PySnapshot& p) { return p.snap->step_tracking(); })
      .def_property_readonly("lr", [](const PySnapshot& p) { return p.snap->lr(); })
      .def_property_readonly("finished", [](const PySnapshot& p) { return p.snap->finished(); })
      .def("next", &next, py::arg("shard"), py::arg("ids"), py::arg("rows"), py::arg("steps"))
      .def(
          "done", [](const PySnapshot& p, size_t s) { return p.snap->done(s); }, py::arg("shard"))
      .def(
          "removed", [](const PySnapshot& p, size_t s) { return vector_copy(p.snap->removed(s)); },
          py::arg("shard"))
      .def(
          "sketch", [](const PySnapshot& p, size_t s) { return vector_copy(p.snap->sketch(s)); },
          py::arg("shard"))
      .def("commit",
           [](PySnapshot& p) {
             py::gil_scoped_release release;
             p.snap->commit();
           })
      .def("abort", [](PySnapshot& p) {
        py::gil_scoped_release release;
        p.snap->abort();
      });
  m.def("begin_snapshot", &begin_snapshot, py::arg("table"), py::arg("mode"));
}

}  // namespace embstore_py
