// File: python/route_bindings.cpp
//
// Binding of the id routing (embstore/route.hpp) for embstore.ray: the arrays are checked
// and their pointers taken with the GIL held, then every table of a batch is validated and
// split in one GIL-released pass. Results are returned without a copy (each array owns the
// vector it wraps).
#include <pybind11/numpy.h>     // py::array, py::array_t
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>       // std::vector, std::string conversions

#include <cstdint>  // uint64_t, int64_t
#include <string>   // std::string
#include <utility>  // std::move
#include <vector>   // std::vector

#include "embstore/route.hpp"  // RouteRequest, RoutePlan, route_request

namespace py = pybind11;

namespace {

// a's data, after checking dtype T, C-contiguity and shape (rows / cols of -1: any).
template <typename T>
const T* array_data(const py::handle& h, const char* name, py::ssize_t ndim, py::ssize_t rows,
                    py::ssize_t cols) {
  if (!py::array_t<T>::check_(h)) {
    throw py::type_error(std::string(name) + ": expected a numpy array of dtype " +
                         std::string(py::str(py::dtype::of<T>())));
  }
  const auto a = py::reinterpret_borrow<py::array>(h);
  if (a.ndim() != ndim || !(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(name) + ": expected a C-contiguous " +
                          std::to_string(ndim) + "-D array");
  }
  if ((rows >= 0 && a.shape(0) != rows) || (ndim == 2 && cols >= 0 && a.shape(1) != cols)) {
    throw py::value_error(std::string(name) + ": wrong shape");
  }
  return static_cast<const T*>(a.data());
}

// A numpy array that owns `v` (moved to the heap; freed with the array).
template <typename T>
py::array_t<T> owning_array(std::vector<T>&& v) {
  auto* held = new std::vector<T>(std::move(v));
  py::capsule owner(held, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(static_cast<py::ssize_t>(held->size()), held->data(), owner);
}

// (keys uint64 [n], offsets int64 [bags + 1], weights float32 [n] | None,
//  grads float32 [bags, dim] | None) as a RouteRequest; the tuple is kept alive by the caller.
embstore::RouteRequest request_of(const py::handle& h, const std::string& label) {
  const auto t = h.cast<py::tuple>();
  if (t.size() != 4) throw py::value_error("route: each batch is (keys, offsets, weights, grads)");
  embstore::RouteRequest r;
  r.label = label;
  r.keys = array_data<uint64_t>(t[0], "keys", 1, -1, -1);
  r.n = static_cast<size_t>(py::reinterpret_borrow<py::array>(t[0]).shape(0));
  r.offsets = array_data<int64_t>(t[1], "offsets", 1, -1, -1);
  const py::ssize_t num_offsets = py::reinterpret_borrow<py::array>(t[1]).shape(0);
  if (num_offsets < 1) throw py::value_error("offsets: must hold at least one element");
  r.num_bags = static_cast<size_t>(num_offsets - 1);
  const auto n = static_cast<py::ssize_t>(r.n);
  if (!t[2].is_none()) r.weights = array_data<float>(t[2], "weights", 1, n, -1);
  if (!t[3].is_none()) {
    r.grads = array_data<float>(t[3], "grads", 2, num_offsets - 1, -1);
    r.dim = static_cast<size_t>(py::reinterpret_borrow<py::array>(t[3]).shape(1));
  }
  return r;
}

std::vector<embstore::RouteRequest> requests_of(const py::list& batches,
                                                const std::vector<std::string>& labels) {
  if (batches.size() != labels.size()) {
    throw py::value_error("route: batches and labels differ in length");
  }
  std::vector<embstore::RouteRequest> requests;
  requests.reserve(batches.size());
  for (size_t k = 0; k < batches.size(); ++k) requests.push_back(request_of(batches[k], labels[k]));
  return requests;
}

}  // namespace

void bind_route(py::module_& m) {
  m.attr("ROUTE_SALT") = py::int_(embstore::kRouteSalt);

  // Validates every batch as a group call would (the first error, in order), then splits each
  // by route. Returns per batch (order, keys, weights | None, coef | None, key_start, bags,
  // bag_start, offsets): see embstore::RoutePlan. The list holds the arrays alive meanwhile.
  m.def(
      "route_batches",
      [](const py::list& batches, const std::vector<std::string>& labels, uint32_t num_routes,
         uint64_t salt, bool mean, bool split) -> py::object {
        if (num_routes == 0) throw py::value_error("num_routes must be positive");
        const py::list held = batches;  // a reference: its tuples outlive the released GIL
        const std::vector<embstore::RouteRequest> requests = requests_of(held, labels);
        std::vector<embstore::RoutePlan> plans;
        {
          py::gil_scoped_release release;
          embstore::validate_route_requests(requests);
          if (split) {
            plans.reserve(requests.size());
            for (const auto& r : requests) {
              plans.push_back(embstore::route_request(r, num_routes, salt, mean));
            }
          }
        }
        if (!split) return py::none();
        py::list out;
        for (size_t k = 0; k < plans.size(); ++k) {
          embstore::RoutePlan& p = plans[k];
          const bool weighted = !held[k].cast<py::tuple>()[2].is_none();
          out.append(py::make_tuple(
              owning_array(std::move(p.order)), owning_array(std::move(p.keys)),
              weighted ? py::object(owning_array(std::move(p.weights))) : py::object(py::none()),
              mean ? py::object(owning_array(std::move(p.coef))) : py::object(py::none()),
              owning_array(std::move(p.key_start)), owning_array(std::move(p.bags)),
              owning_array(std::move(p.bag_start)), owning_array(std::move(p.offsets))));
        }
        return std::move(out);
      },
      py::arg("batches"), py::arg("labels"), py::arg("num_routes"), py::arg("salt"),
      py::arg("mean"), py::arg("split") = true);

  m.def(
      "route_ids",
      [](const py::array& keys, uint32_t num_routes, uint64_t salt) {
        if (num_routes == 0) throw py::value_error("num_routes must be positive");
        const uint64_t* k = array_data<uint64_t>(keys, "keys", 1, -1, -1);
        const auto n = keys.shape(0);
        py::array_t<uint32_t> out(n);
        uint32_t* o = out.mutable_data();
        {
          py::gil_scoped_release release;
          embstore::route_ids(k, static_cast<size_t>(n), salt, num_routes, o);
        }
        return out;
      },
      py::arg("keys"), py::arg("num_routes"), py::arg("salt"));
}
