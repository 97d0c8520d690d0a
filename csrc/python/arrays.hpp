// File: python/arrays.hpp
//
// numpy arrays at the binding's edge: the checks memory safety needs (dtype, ndim, shape,
// C-contiguity, writability) before a raw pointer is taken, a TableGroup call's canonical
// per-table tuple, and arrays handed to Python without a copy. Raw pointers are collected
// while the GIL is held; no Python object is touched once it is released.
#pragma once

#include <pybind11/numpy.h>  // py::array, py::array_t
#include <pybind11/pybind11.h>

#include <cstdint>  // uint64_t, int64_t
#include <cstring>  // std::memcpy
#include <string>   // std::string
#include <utility>  // std::move
#include <vector>   // std::vector

#include "embstore/buffer_pool.hpp"  // BufferPool
#include "embstore/table.hpp"        // PoolMode

namespace embstore_py {

namespace py = pybind11;

// Returns a's data after checking dtype T, C-contiguity, shape and (if asked) writability.
// rows / cols of -1 are not checked; cols == 0 means "1-D".
template <typename T>
T* checked_data(const py::array& a, const char* name, py::ssize_t rows, py::ssize_t cols,
                bool writable) {
  if (!py::isinstance<py::array_t<T>>(a)) {
    throw py::type_error(std::string(name) + ": expected dtype " +
                         std::string(py::str(py::dtype::of<T>())) + ", got " +
                         std::string(py::str(a.dtype())));
  }
  const py::ssize_t ndim = cols == 0 ? 1 : 2;
  if (a.ndim() != ndim) {
    throw py::value_error(std::string(name) + ": expected a " + std::to_string(ndim) +
                          "-D array, got " + std::to_string(a.ndim()) + "-D");
  }
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(name) + ": array must be C-contiguous");
  }
  if ((rows >= 0 && a.shape(0) != rows) || (cols > 0 && a.shape(1) != cols)) {
    throw py::value_error(std::string(name) + ": wrong shape");
  }
  if (writable && !a.writeable()) {
    throw py::value_error(std::string(name) + ": array must be writeable");
  }
  return static_cast<T*>(const_cast<void*>(a.data()));
}

inline const uint64_t* keys_data(const py::array& keys) {
  return checked_data<uint64_t>(keys, "keys", -1, 0, false);
}

inline const float* optional_weights(const py::object& weights, py::ssize_t n) {
  if (weights.is_none()) return nullptr;
  return checked_data<float>(weights.cast<py::array>(), "weights", n, 0, false);
}

inline const int64_t* optional_offsets(const py::object& offsets, py::ssize_t& num_bags) {
  if (offsets.is_none()) return nullptr;
  py::array a = offsets.cast<py::array>();
  const int64_t* data = checked_data<int64_t>(a, "offsets", -1, 0, false);
  if (a.shape(0) < 1) throw py::value_error("offsets: must hold at least one element");
  num_bags = a.shape(0) - 1;
  return data;
}

inline embstore::PoolMode to_mode(int mode) {
  if (mode != 0 && mode != 1) throw py::value_error("mode: must be 0 (sum) or 1 (mean)");
  return static_cast<embstore::PoolMode>(mode);
}

// A new float32 [rows, dim] array whose memory comes from the output pool (and returns there
// when the array is freed), so the next batch's result reuses mapped pages.
inline py::array_t<float> new_rows(py::ssize_t rows, py::ssize_t dim) {
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(dim) * sizeof(float);
  void* data = embstore::BufferPool::global().acquire(bytes);
  py::capsule owner(data, [](void* p) { embstore::BufferPool::global().release(p); });
  return py::array_t<float>({rows, dim}, static_cast<float*>(data), owner);
}

// Hands a vector's buffer to numpy without copying: the array owns the moved vector.
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* owner = new std::vector<T>(std::move(v));
  py::capsule free_owner(owner, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(std::move(shape), owner->data(), free_owner);
}

template <typename T>
py::array_t<T> vector_copy(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

// References to a list's items, kept while the GIL is released (the list may change).
inline std::vector<py::object> hold(const py::list& items) {
  std::vector<py::object> held;
  held.reserve(items.size());
  for (const py::handle item : items) held.push_back(py::reinterpret_borrow<py::object>(item));
  return held;
}

// One table's part of a TableGroup call, in the core's canonical format: keys uint64 or
// int64 [n] (int64 ids keep their bits), offsets int64 [bags + 1], grads float32
// [bags, dim], weights float32 [n] or None; all 1-D but grads, all C-contiguous.
struct CanonicalBatch {
  const uint64_t* keys = nullptr;
  size_t n = 0;
  const int64_t* offsets = nullptr;
  size_t num_bags = 0;
  const float* grads = nullptr;
  const float* weights = nullptr;
};

// `h` as a C-contiguous array of dtype T (or T2, of the same width) with `ndim` dimensions
// whose shape matches `expect` (-1: any), its shape to shape[0, ndim); else a TypeError
// naming the table, the argument and what it must be.
template <typename T, typename T2 = T>
const T* canonical_array(py::handle h, py::ssize_t ndim, const py::ssize_t* expect,
                         py::ssize_t* shape, const std::string& table, const char* name,
                         const char* must_be) {
  bool ok = py::array_t<T>::check_(h) || py::array_t<T2>::check_(h);
  if (ok) {
    const auto a = py::reinterpret_borrow<py::array>(h);
    ok = a.ndim() == ndim && (a.flags() & py::array::c_style);
    for (py::ssize_t d = 0; ok && d < ndim; ++d) {
      shape[d] = a.shape(d);
      ok = expect[d] < 0 || expect[d] == shape[d];
    }
    if (ok) return static_cast<const T*>(a.data());
  }
  std::string got = std::string(py::str(py::type::handle_of(h).attr("__name__")));
  if (py::isinstance<py::array>(h)) {
    const auto a = py::reinterpret_borrow<py::array>(h);
    got =
        "dtype " + std::string(py::str(a.dtype())) + ", shape " +
        std::string(py::str(py::cast(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim())))) +
        ((a.flags() & py::array::c_style) ? "" : ", not C-contiguous");
  }
  throw py::type_error("table '" + table + "': " + name + " must be " + must_be + ", got " + got);
}

// Parses `h`, the tuple (keys, offsets[, grads][, weights]) of the table named `table`
// (with_grads: an apply's, grads [bags, dim]). Raises TypeError naming the table and the
// argument for anything not canonical: the Python package normalises before it calls.
inline CanonicalBatch canonical_batch(py::handle h, bool with_grads, py::ssize_t dim,
                                      const std::string& table) {
  const size_t arrays = with_grads ? 3 : 2;
  const char* form =
      with_grads ? "(keys, offsets, grads[, weights])" : "(keys, offsets[, weights])";
  if (!PyTuple_CheckExact(h.ptr())) {
    throw py::type_error("table '" + table + "': expected a tuple " + form);
  }
  const auto items = py::reinterpret_borrow<py::tuple>(h);
  if (items.size() != arrays && items.size() != arrays + 1) {
    throw py::type_error("table '" + table + "': expected a tuple " + form + ", got " +
                         std::to_string(items.size()) + " items");
  }
  const py::ssize_t any[2] = {-1, -1};
  py::ssize_t shape[2];
  CanonicalBatch b;
  b.keys = canonical_array<uint64_t, int64_t>(items[0], 1, any, shape, table, "keys",
                                              "a 1-D C-contiguous uint64 or int64 array");
  b.n = static_cast<size_t>(shape[0]);
  b.offsets = canonical_array<int64_t>(items[1], 1, any, shape, table, "offsets",
                                       "a 1-D C-contiguous int64 array");
  if (shape[0] < 1) {
    throw py::type_error("table '" + table + "': offsets must hold at least one element");
  }
  b.num_bags = static_cast<size_t>(shape[0] - 1);
  if (with_grads) {
    const py::ssize_t expect[2] = {static_cast<py::ssize_t>(b.num_bags), dim};
    b.grads = canonical_array<float>(items[2], 2, expect, shape, table, "grads",
                                     "a C-contiguous float32 array [bags, dim]");
  }
  if (items.size() == arrays + 1 && !items[arrays].is_none()) {  // (None: no weights)
    const py::ssize_t expect[1] = {static_cast<py::ssize_t>(b.n)};
    b.weights = canonical_array<float>(items[arrays], 1, expect, shape, table, "weights",
                                       "None or a 1-D C-contiguous float32 array [n]");
  }
  return b;
}

}  // namespace embstore_py
