// File: python/route_bindings.cpp
//
// Binding of the id routing (embstore/route.hpp) for embstore.ray: the arrays are checked
// and their pointers taken with the GIL held; then, with the GIL released, every table of a
// batch is validated and split by route (in one pass into outputs allocated first for two
// routes, else counted, then scattered into outputs allocated in between); and the shards'
// partial sums of every table are added up in one call (reduce_partials).
#include <pybind11/numpy.h>     // py::array, py::array_t
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>       // std::vector, std::string conversions

#include <algorithm>  // std::copy, std::max
#include <cstdint>    // uint64_t, int64_t
#include <cstring>    // std::memcmp
#include <string>   // std::string
#include <utility>  // std::move, std::pair
#include <vector>   // std::vector

#include "embstore/buffer_pool.hpp"  // BufferPool
#include "embstore/route.hpp"        // RouteRequest, split_two_routes, reduce_partials_many
#include "embstore/thread_pool.hpp"  // ThreadPool

#include "python/arrays.hpp"    // new_rows
#include "python/bindings.hpp"  // bind_* declarations

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
    throw py::value_error(std::string(name) + ": expected a C-contiguous " + std::to_string(ndim) +
                          "-D array");
  }
  if ((rows >= 0 && a.shape(0) != rows) || (ndim == 2 && cols >= 0 && a.shape(1) != cols)) {
    throw py::value_error(std::string(name) + ": wrong shape");
  }
  return static_cast<const T*>(a.data());
}

// A new 1-D array of `n` T whose memory comes from the output pool and returns there when
// the array is freed: a batch's split reuses mapped pages instead of faulting in fresh ones
// (a W1 batch's split is ~3 MB).
template <typename T>
py::array_t<T> pooled_array(size_t n) {
  void* data = embstore::BufferPool::global().acquire(std::max<size_t>(1, n) * sizeof(T));
  py::capsule owner(data, [](void* p) { embstore::BufferPool::global().release(p); });
  return py::array_t<T>(static_cast<py::ssize_t>(n), static_cast<T*>(data), owner);
}

py::array_t<int64_t> copy_of(const std::vector<int64_t>& v) {
  py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
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

// One request's split arrays from the output pool: keys (order, weights, coef) of
// `num_keys`, bags and offsets of the sizes given; `out` points into them.
struct SplitArrays {
  py::array_t<int64_t> bags, offsets;
  py::array_t<uint64_t> keys;
  py::object order = py::none(), weights = py::none(), coef = py::none();
  embstore::RouteOutput out{};
};

SplitArrays split_arrays(size_t num_keys, size_t num_bags, size_t num_offsets, bool with_order,
                         bool weighted, bool mean) {
  SplitArrays a;
  a.keys = pooled_array<uint64_t>(num_keys);
  a.bags = pooled_array<int64_t>(num_bags);
  a.offsets = pooled_array<int64_t>(num_offsets);
  a.out = {nullptr, a.keys.mutable_data(), nullptr,
           nullptr, a.bags.mutable_data(), a.offsets.mutable_data()};
  if (with_order) {
    auto o = pooled_array<int64_t>(num_keys);
    a.out.order = o.mutable_data();
    a.order = std::move(o);
  }
  if (weighted) {
    auto w = pooled_array<float>(num_keys);
    a.out.weights = w.mutable_data();
    a.weights = std::move(w);
  }
  if (mean) {
    auto cf = pooled_array<float>(num_keys);
    a.out.coef = cf.mutable_data();
    a.coef = std::move(cf);
  }
  return a;
}

// The plan tuple of a split (see route_batches); bags and offsets cut to what it used.
py::tuple plan_of(const SplitArrays& a, const embstore::RouteCounts& c, const py::object& kept) {
  const auto head = [](const py::array& v, size_t n) {
    return v.attr("__getitem__")(py::slice(0, static_cast<py::ssize_t>(n), 1));
  };
  return py::make_tuple(a.order, a.keys, a.weights, a.coef, copy_of(c.key_start),
                        head(a.bags, c.num_bags()), copy_of(c.bag_start),
                        head(a.offsets, c.num_offsets()), kept);
}

// Copies of every request's keys, offsets and weights (None if it has none), in the output
// pool, as a tuple per request: the sharded client keeps them to recognise the apply of a
// training forward (the caller may rewrite its own arrays meanwhile). Copied on the pool
// with the GIL released, while the split's reads have the keys in cache.
std::vector<py::object> copies_of(const std::vector<embstore::RouteRequest>& requests,
                                  size_t workers) {
  const size_t R = requests.size();
  std::vector<py::array_t<uint64_t>> keys(R);
  std::vector<py::array_t<int64_t>> offsets(R);
  std::vector<py::object> weights(R, py::none());
  std::vector<uint64_t*> kd(R);
  std::vector<int64_t*> od(R);
  std::vector<float*> w(R, nullptr);
  for (size_t k = 0; k < R; ++k) {
    keys[k] = pooled_array<uint64_t>(requests[k].n);
    kd[k] = keys[k].mutable_data();
    offsets[k] = pooled_array<int64_t>(requests[k].num_bags + 1);
    od[k] = offsets[k].mutable_data();
    if (requests[k].weights != nullptr) {
      auto a = pooled_array<float>(requests[k].n);
      w[k] = a.mutable_data();
      weights[k] = std::move(a);
    }
  }
  {
    py::gil_scoped_release release;
    embstore::ThreadPool::global().run(R, workers, [&](size_t k) {
      const embstore::RouteRequest& r = requests[k];
      std::copy(r.keys, r.keys + r.n, kd[k]);
      std::copy(r.offsets, r.offsets + r.num_bags + 1, od[k]);
      if (w[k] != nullptr) std::copy(r.weights, r.weights + r.n, w[k]);
    });
  }
  std::vector<py::object> out;
  out.reserve(R);
  for (size_t k = 0; k < R; ++k) out.push_back(py::make_tuple(keys[k], offsets[k], weights[k]));
  return out;
}

// Validates every batch as a group call would (the first error, in order), then splits each
// by route. Returns per batch (order | None, keys, weights | None, coef | None, key_start,
// bags, bag_start, offsets, kept | None): see embstore::RoutePlan; `order` only when asked
// for (only an exact lookup reads it); `kept` (copies_of) with `keep`. The list holds the
// arrays alive meanwhile. Without `split`: the checks only, and None.
// Two routes with bags of several ids take one pass into outputs of the largest size
// (split_two_routes); others count first, then scatter into outputs of the exact size.
py::object route_batches(const py::list& batches, const std::vector<std::string>& labels,
                         uint32_t num_routes, uint64_t salt, bool mean, bool split, bool with_order,
                         bool keep) {
  if (num_routes == 0) throw py::value_error("num_routes must be positive");
  const py::list held = batches;  // a reference: its tuples outlive the released GIL
  const std::vector<embstore::RouteRequest> requests = requests_of(held, labels);
  const size_t R = requests.size();
  const bool one_pass = split && embstore::split_in_one_pass(requests, num_routes);
  const auto weighted = [&](size_t k) { return !held[k].cast<py::tuple>()[2].is_none(); };
  std::vector<SplitArrays> arrays;
  std::vector<embstore::RouteOutput> outputs;
  for (size_t k = 0; one_pass && k < R; ++k) {
    const size_t nb = requests[k].num_bags;
    arrays.push_back(
        split_arrays(requests[k].n, 2 * nb, 2 * nb + 2, with_order, weighted(k), mean));
    outputs.push_back(arrays.back().out);
  }
  const size_t total = embstore::route_starts(requests).back();
  thread_local std::vector<uint32_t> route;  // reused: no page faults per batch
  if (split && !one_pass && route.size() < total) route.resize(total);
  std::vector<embstore::RouteCounts> counts;
  size_t workers = 1;
  {
    py::gil_scoped_release release;
    embstore::validate_route_requests(requests);
    if (split) workers = embstore::route_workers(requests);
    if (one_pass) {
      counts = embstore::split_two_routes_many(requests, salt, outputs, workers);
    } else if (split) {
      counts = embstore::count_routes_many(requests, num_routes, salt, route.data(), workers);
    }
  }
  if (!split) return py::none();
  if (!one_pass) {
    for (size_t k = 0; k < R; ++k) {
      const embstore::RouteCounts& c = counts[k];
      arrays.push_back(
          split_arrays(c.num_keys(), c.num_bags(), c.num_offsets(), with_order, weighted(k), mean));
      outputs.push_back(arrays.back().out);
    }
    py::gil_scoped_release release;
    embstore::fill_routes_many(requests, route.data(), counts, outputs, workers);
  }
  py::list out;
  const std::vector<py::object> kept =
      keep ? copies_of(requests, workers) : std::vector<py::object>(R, py::none());
  for (size_t k = 0; k < R; ++k) out.append(plan_of(arrays[k], counts[k], kept[k]));
  return std::move(out);
}

// Whether two C-contiguous buffers hold the same bytes (memcmp; numpy's array_equal builds
// an array of booleans first): how the sharded client compares an apply's batch with the
// copy it kept of its forward's.
bool same_bytes(const py::buffer& a, const py::buffer& b) {
  const py::buffer_info x = a.request(), y = b.request();
  const auto contiguous = [](const py::buffer_info& i) {
    py::ssize_t stride = i.itemsize;
    for (py::ssize_t d = i.ndim - 1; d >= 0; --d) {
      if (i.shape[d] > 1 && i.strides[d] != stride) return false;
      stride *= i.shape[d];
    }
    return true;
  };
  if (!contiguous(x) || !contiguous(y)) throw py::value_error("same_bytes: not C-contiguous");
  const size_t n = static_cast<size_t>(x.size * x.itemsize);
  if (n != static_cast<size_t>(y.size * y.itemsize)) return false;
  py::gil_scoped_release release;
  return n == 0 || std::memcmp(x.ptr, y.ptr, n) == 0;
}

// A copy of `bags` (int64 [count]) whose every value indexes one of `num_rows` rows, else
// ValueError. A copy: the caller reads it with the GIL released, when another thread could
// rewrite the array after the check.
std::vector<int64_t> checked_bags(const py::array& bags, py::ssize_t num_rows) {
  const int64_t* b = array_data<int64_t>(bags, "bags", 1, -1, -1);
  std::vector<int64_t> copy(static_cast<size_t>(bags.shape(0)));
  for (size_t j = 0; j < copy.size(); ++j) {
    const int64_t v = b[j];
    if (v < 0 || v >= num_rows) throw py::value_error("bags: index out of range");
    copy[j] = v;
  }
  return copy;
}

// rows[bags]: a new [count, dim] array from the output pool (numpy's take allocated fresh
// pages on every call: ~65 us a W1 table of 1,024 bags in the sharded client's step).
py::array_t<float> gather_rows_of(const py::array& rows, const py::array& bags) {
  const float* r = array_data<float>(rows, "rows", 2, -1, -1);
  const py::ssize_t dim = rows.shape(1);
  const std::vector<int64_t> b = checked_bags(bags, rows.shape(0));
  py::array_t<float> out = embstore_py::new_rows(static_cast<py::ssize_t>(b.size()), dim);
  float* o = out.mutable_data();
  py::gil_scoped_release release;
  embstore::gather_rows(o, static_cast<size_t>(dim), b.data(), b.size(), r);
  return out;
}

// Whether bytes [begin, end) meet any of `ranges` but the one at `self`.
bool overlaps_another(const std::vector<std::pair<const char*, const char*>>& ranges, size_t self) {
  for (size_t j = 0; j < ranges.size(); ++j) {
    if (j != self && ranges[j].first < ranges[self].second &&
        ranges[self].first < ranges[j].second) {
      return true;
    }
  }
  return false;
}

// Each table's pooled sums from its routes' partial sums: `tables` holds (num_bags, dim,
// parts) per table, a part being (bags int64 [count] | None for every bag, sums float32
// [count or num_bags, dim], C-contiguous). Parts with no bag are skipped. A first part that
// covers every bag, is writeable and shares no memory with any other part is added into in
// place and returned; other outputs come from the output pool. The parts are held and the
// bags copied as checked, so other threads cannot change them once the GIL is gone.
py::list reduce_partials_of(const py::list& tables) {
  std::vector<embstore::ReduceRequest> requests(tables.size());
  std::vector<std::vector<int64_t>> bags;  // the checked copies the requests point into
  std::vector<py::array> held;             // every sums array, alive until the end
  std::vector<size_t> first(requests.size());  // each table's first part in `held`
  std::vector<std::pair<const char*, const char*>> ranges;  // each held part's bytes
  for (size_t k = 0; k < requests.size(); ++k) {
    const auto t = tables[k].cast<py::tuple>();
    if (t.size() != 3) throw py::value_error("reduce: each table is (num_bags, dim, parts)");
    embstore::ReduceRequest& r = requests[k];
    const auto num_bags = t[0].cast<py::ssize_t>(), dim = t[1].cast<py::ssize_t>();
    if (num_bags < 0 || dim < 1) throw py::value_error("reduce: bad num_bags or dim");
    r.num_bags = static_cast<size_t>(num_bags);
    r.dim = static_cast<size_t>(dim);
    first[k] = held.size();
    for (const py::handle part : t[2].cast<py::list>()) {
      const auto p = part.cast<py::tuple>();
      if (p.size() != 2) throw py::value_error("reduce: each part is (bags, sums)");
      embstore::PartialSums ps;
      py::ssize_t rows = num_bags;
      ps.every_bag = p[0].is_none();
      if (!ps.every_bag) {
        bags.push_back(checked_bags(p[0].cast<py::array>(), num_bags));
        ps.bags = bags.back().data();
        ps.count = bags.back().size();
        rows = static_cast<py::ssize_t>(ps.count);
      }
      ps.sums = array_data<float>(p[1], "sums", 2, rows, dim);
      if (!ps.every_bag && ps.count == 0) continue;  // adds nothing
      held.push_back(py::reinterpret_borrow<py::array>(p[1]));
      const auto* bytes = reinterpret_cast<const char*>(ps.sums);
      ranges.emplace_back(bytes, bytes + held.back().nbytes());
      r.parts.push_back(ps);
    }
  }
  py::list outs;
  for (size_t k = 0; k < requests.size(); ++k) {
    embstore::ReduceRequest& r = requests[k];
    const bool in_place = !r.parts.empty() && r.parts[0].every_bag && held[first[k]].writeable() &&
                          !overlaps_another(ranges, first[k]);
    if (in_place) {
      r.out = const_cast<float*>(r.parts[0].sums);
      outs.append(held[first[k]]);
    } else {
      py::array_t<float> out = embstore_py::new_rows(static_cast<py::ssize_t>(r.num_bags),
                                                     static_cast<py::ssize_t>(r.dim));
      r.out = out.mutable_data();
      outs.append(std::move(out));
    }
  }
  {  // (a vector of `bags` keeps its buffer when the outer vector grows: the pointers hold)
    py::gil_scoped_release release;
    embstore::reduce_partials_many(requests, embstore::reduce_workers(requests));
  }
  return outs;
}

py::array_t<uint32_t> route_ids_of(const py::array& keys, uint32_t num_routes, uint64_t salt) {
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
}

}  // namespace

namespace embstore_py {

void bind_route(py::module_& m) {
  m.attr("ROUTE_SALT") = py::int_(embstore::kRouteSalt);

  // route_batches, gather_rows, reduce_partials, route_ids: see the functions above.
  m.def("route_batches", &route_batches, py::arg("batches"), py::arg("labels"),
        py::arg("num_routes"), py::arg("salt"), py::arg("mean"), py::arg("split") = true,
        py::arg("order") = true, py::arg("keep") = false);

  m.def("same_bytes", &same_bytes, py::arg("a"), py::arg("b"));
  m.def("gather_rows", &gather_rows_of, py::arg("rows"), py::arg("bags"));
  m.def("reduce_partials", &reduce_partials_of, py::arg("tables"));

  m.def("route_ids", &route_ids_of, py::arg("keys"), py::arg("num_routes"), py::arg("salt"));
}

}  // namespace embstore_py
