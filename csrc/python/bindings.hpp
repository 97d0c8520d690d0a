// File: python/bindings.hpp
//
// The pybind11 module embstore._core, the thin layer over the C++ core. Each feature binds
// itself in its own file, csrc/python/<feature>_bindings.cpp, through one function
// `void bind_<feature>(py::module_&)` declared here; module.cpp calls them in order. To add
// a feature: write its file and function, declare it here, call it from module.cpp, list the
// file in CMakeLists.txt and describe what it adds in src/embstore/_core.pyi.
//
// The Python package normalises arguments (dtypes, contiguity, defaults) and raises the
// user-facing errors; the bindings re-check only what memory safety needs (arrays.hpp),
// collect raw pointers while holding the GIL, then release it for the whole computation.
#pragma once

#include <pybind11/pybind11.h>

namespace embstore_py {

namespace py = pybind11;

void bind_table(py::module_& m);     // TableConfig, Table (table_bindings.cpp)
void bind_snapshot(py::module_& m);  // Snapshot, begin_snapshot (snapshot_bindings.cpp)
void bind_group(py::module_& m);     // group_lookup_sum, group_apply_gradients
void bind_runtime(py::module_& m);   // output pool, thread pool, metrics, SIMD (module.cpp)
void bind_timers(py::module_& m);  // named layer timers, histogram snapshots (metrics_bindings.cpp)
void bind_checkpoint(
    py::module_& m);  // checkpoint save/load, CheckpointError (checkpoint_bindings.cpp)
void bind_route(py::module_& m);  // route_batches, route_ids, add_rows (route_bindings.cpp)

}  // namespace embstore_py
