// File: python/group_bindings.cpp
//
// TableGroup's batched calls: one (keys, offsets[, grads][, weights]) tuple per table, in the
// core's canonical format (arrays.hpp: CanonicalBatch), else a TypeError naming the table
// and the argument (strict), or None and nothing done (not strict: the Python package then
// converts the entries and calls again), so there is one way across the boundary. The
// tuples are held while the GIL is released, so their arrays outlive the call even if
// another thread changes the list.
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

// Every entry parsed by `parse(k)`; false if one is not canonical and the call is not strict
// (nothing has run yet), else its TypeError.
template <typename Parse>
bool parse_all(size_t count, bool strict, const Parse& parse) {
  try {
    for (size_t k = 0; k < count; ++k) parse(k);
  } catch (const py::type_error&) {
    if (strict) throw;
    return false;
  }
  return true;
}

// Returns the pooled outputs, float32 [bags, dim] per table, from the output pool (None if
// an entry is not canonical and `strict` is false).
py::object group_lookup_sum(const Tables& tables, const py::list& features, int mode, bool insert,
                            const std::vector<std::string>& labels, bool strict) {
  const size_t R = tables.size();
  if (features.size() != R || labels.size() != R) {
    throw py::value_error("group_lookup_sum: argument lists differ in length");
  }
  const PoolMode pm = to_mode(mode);
  std::vector<embstore::LookupSumRequest> requests(R);
  const std::vector<py::object> held = hold(features);
  const bool parsed = parse_all(R, strict, [&](size_t k) {
    const CanonicalBatch b = canonical_batch(held[k], false, 0, labels[k]);
    requests[k] = {tables[k].get(), b.keys, b.n,    b.offsets, b.num_bags,
                   b.weights,       pm,     insert, nullptr,   labels[k]};
  });
  if (!parsed) return py::none();
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

// False (nothing applied) if an entry is not canonical and `strict` is false.
bool group_apply_gradients(const Tables& tables, const py::list& grads, int mode,
                           const std::vector<std::string>& labels, bool strict) {
  const size_t R = tables.size();
  if (grads.size() != R || labels.size() != R) {
    throw py::value_error("group_apply_gradients: argument lists differ in length");
  }
  const PoolMode pm = to_mode(mode);
  std::vector<embstore::ApplyRequest> requests(R);
  const std::vector<py::object> held = hold(grads);
  const bool parsed = parse_all(R, strict, [&](size_t k) {
    const CanonicalBatch b =
        canonical_batch(held[k], true, static_cast<py::ssize_t>(tables[k]->dim()), labels[k]);
    requests[k] = {tables[k].get(), b.keys,    b.n, b.grads,  b.offsets,
                   b.num_bags,      b.weights, pm,  labels[k]};
  });
  if (!parsed) return false;
  py::gil_scoped_release release;
  embstore::apply_gradients_many(requests, embstore::Timer::kGroupApplyGradients);
  return true;
}

}  // namespace

void bind_group(py::module_& m) {
  m.def("group_lookup_sum", &group_lookup_sum, py::arg("tables"), py::arg("features"),
        py::arg("mode"), py::arg("insert"), py::arg("labels"), py::arg("strict") = true);
  m.def("group_apply_gradients", &group_apply_gradients, py::arg("tables"), py::arg("grads"),
        py::arg("mode"), py::arg("labels"), py::arg("strict") = true);
}

}  // namespace embstore_py
