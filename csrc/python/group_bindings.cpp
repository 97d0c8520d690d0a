// File: python/group_bindings.cpp
//
// TableGroup's batched calls: one (keys, offsets[, grads][, weights]) tuple per table, in the
// core's canonical format (arrays.hpp: CanonicalBatch), else a TypeError naming the table
// and the argument; the Python package normalises before it calls, so there is one way
// across the boundary. The tuples are held while the GIL is released, so their arrays
// outlive the call even if another thread changes the list.
#include <pybind11/numpy.h>  // py::array_t
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>    // std::vector, std::string conversions

#include <memory>  // std::shared_ptr
#include <string>  // std::string
#include <vector>  // std::vector

#include "embstore/metrics.hpp"  // Timer
#include "embstore/table.hpp"    // Table, lookup_sum_many, apply_gradients_many
#include "python/arrays.hpp"     // canonical_batch, hold, new_rows, to_mode
#include "python/bindings.hpp"   // bind_group

namespace embstore_py {
namespace {

using embstore::PoolMode;
using embstore::Table;
using Tables = std::vector<std::shared_ptr<Table>>;

// Returns the pooled outputs, float32 [bags, dim] per table, from the output pool.
py::list group_lookup_sum(const Tables& tables, const py::list& features, int mode, bool insert,
                          const std::vector<std::string>& labels) {
  const size_t R = tables.size();
  if (features.size() != R || labels.size() != R) {
    throw py::value_error("group_lookup_sum: argument lists differ in length");
  }
  const PoolMode pm = to_mode(mode);
  std::vector<embstore::LookupSumRequest> requests(R);
  const std::vector<py::object> held = hold(features);
  for (size_t k = 0; k < R; ++k) {
    const CanonicalBatch b = canonical_batch(held[k], false, 0, labels[k]);
    requests[k] = {tables[k].get(), b.keys, b.n,    b.offsets, b.num_bags,
                   b.weights,       pm,     insert, nullptr,   labels[k]};
  }
  py::list outs(R);
  for (size_t k = 0; k < R; ++k) {
    py::array_t<float> out = new_rows(static_cast<py::ssize_t>(requests[k].num_bags),
                                      static_cast<py::ssize_t>(tables[k]->dim()));
    requests[k].out = out.mutable_data();
    outs[k] = std::move(out);
  }
  {
    py::gil_scoped_release release;
    embstore::lookup_sum_many(requests, embstore::Timer::kGroupLookupSum);
  }
  return outs;
}

void group_apply_gradients(const Tables& tables, const py::list& grads, int mode,
                           const std::vector<std::string>& labels) {
  const size_t R = tables.size();
  if (grads.size() != R || labels.size() != R) {
    throw py::value_error("group_apply_gradients: argument lists differ in length");
  }
  const PoolMode pm = to_mode(mode);
  std::vector<embstore::ApplyRequest> requests(R);
  const std::vector<py::object> held = hold(grads);
  for (size_t k = 0; k < R; ++k) {
    const CanonicalBatch b =
        canonical_batch(held[k], true, static_cast<py::ssize_t>(tables[k]->dim()), labels[k]);
    requests[k] = {tables[k].get(), b.keys,    b.n, b.grads,  b.offsets,
                   b.num_bags,      b.weights, pm,  labels[k]};
  }
  py::gil_scoped_release release;
  embstore::apply_gradients_many(requests, embstore::Timer::kGroupApplyGradients);
}

}  // namespace

void bind_group(py::module_& m) {
  m.def("group_lookup_sum", &group_lookup_sum, py::arg("tables"), py::arg("features"),
        py::arg("mode"), py::arg("insert"), py::arg("labels"));
  m.def("group_apply_gradients", &group_apply_gradients, py::arg("tables"), py::arg("grads"),
        py::arg("mode"), py::arg("labels"));
}

}  // namespace embstore_py
