// File: bindings.cpp
//
// The thin pybind11 layer over the C++ core. The Python facade (src/embstore/table.py)
// normalises arguments (dtypes, contiguity, defaults) and raises the user-facing errors;
// this file re-checks only what memory safety needs (dtype, ndim, shape, contiguity,
// writability), collects raw pointers while holding the GIL, then releases the GIL for the
// whole computation. No Python object is touched while the GIL is released.
#include <pybind11/numpy.h>    // py::array, py::array_t
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>      // std::vector, std::string conversions

#include <cstdint>  // uint64_t, int64_t
#include <cstring>  // std::memcpy
#include <memory>   // std::shared_ptr
#include <optional>  // std::optional
#include <string>   // std::string
#include <vector>   // std::vector

#include "embstore/buffer_pool.hpp"  // BufferPool
#include "embstore/errors.hpp"       // CapacityError
#include "embstore/metrics.hpp"      // Timer, metrics_enabled
#include "embstore/simd.hpp"         // simd_level, set_simd_level
#include "embstore/snapshot.hpp"     // Snapshot, SnapshotMode
#include "embstore/table.hpp"        // Table, lookup_sum_many, apply_gradients_many
#include "embstore/thread_pool.hpp"  // ThreadPool

namespace py = pybind11;
using embstore::PoolMode;

void bind_checkpoint(py::module_& m);  // python/checkpoint_bindings.cpp
using embstore::Snapshot;
using embstore::Table;

namespace {

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

const uint64_t* keys_data(const py::array& keys) {
  return checked_data<uint64_t>(keys, "keys", -1, 0, false);
}

const float* optional_weights(const py::object& weights, py::ssize_t n) {
  if (weights.is_none()) return nullptr;
  return checked_data<float>(weights.cast<py::array>(), "weights", n, 0, false);
}

const int64_t* optional_offsets(const py::object& offsets, py::ssize_t& num_bags) {
  if (offsets.is_none()) return nullptr;
  py::array a = offsets.cast<py::array>();
  const int64_t* data = checked_data<int64_t>(a, "offsets", -1, 0, false);
  if (a.shape(0) < 1) throw py::value_error("offsets: must hold at least one element");
  num_bags = a.shape(0) - 1;
  return data;
}

PoolMode to_mode(int mode) {
  if (mode != 0 && mode != 1) throw py::value_error("mode: must be 0 (sum) or 1 (mean)");
  return static_cast<PoolMode>(mode);
}

// A new float32 [rows, dim] array whose memory comes from the output pool (and returns there
// when the array is freed), so the next batch's result reuses mapped pages.
py::array_t<float> new_rows(py::ssize_t rows, py::ssize_t dim) {
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(dim) * sizeof(float);
  void* data = embstore::BufferPool::global().acquire(bytes);
  py::capsule owner(data, [](void* p) { embstore::BufferPool::global().release(p); });
  return py::array_t<float>({rows, dim}, static_cast<float*>(data), owner);
}

// The data of `h` if it is a C-contiguous numpy array of dtype T (or of T2, same width) with
// `ndim` dimensions, else nullptr; its shape goes to shape[0..ndim).
template <typename T, typename T2 = T>
const T* array_as_is(py::handle h, py::ssize_t ndim, py::ssize_t* shape) {
  if (!py::array_t<T>::check_(h) && !py::array_t<T2>::check_(h)) return nullptr;
  const auto a = py::reinterpret_borrow<py::array>(h);
  if (a.ndim() != ndim || !(a.flags() & py::array::c_style)) return nullptr;
  for (py::ssize_t d = 0; d < ndim; ++d) shape[d] = a.shape(d);
  return static_cast<const T*>(a.data());
}

// References to a list's items, kept while the GIL is released (the list may change).
std::vector<py::object> hold(const py::list& items) {
  std::vector<py::object> held;
  held.reserve(items.size());
  for (const py::handle item : items) held.push_back(py::reinterpret_borrow<py::object>(item));
  return held;
}

// One table's part of a TableGroup call as TableGroup's arrays module would pass it on
// unchanged: (keys, offsets[, grads][, weights]) with keys uint64 or int64 [n], offsets int64
// [bags + 1], grads float32 [bags, dim], weights float32 [n] or None; all C-contiguous.
struct CanonicalBatch {
  const uint64_t* keys;
  size_t n;
  const int64_t* offsets;
  size_t num_bags;
  const float* grads;
  const float* weights;
};

// `h` as a CanonicalBatch, or nullopt when it is anything else (then TableGroup converts its
// arrays, or raises the error that names what is wrong). `arrays`: the tuple's length without
// weights (2 for a lookup, 3 with grads [bags, dim] for an apply).
std::optional<CanonicalBatch> canonical_batch(py::handle h, size_t arrays, bool with_grads,
                                              py::ssize_t dim) {
  if (!PyTuple_CheckExact(h.ptr())) return std::nullopt;
  const auto items = py::reinterpret_borrow<py::tuple>(h);
  if (items.size() != arrays && items.size() != arrays + 1) return std::nullopt;
  py::ssize_t shape[2];
  CanonicalBatch b{};
  b.keys = array_as_is<uint64_t, int64_t>(items[0], 1, shape);  // int64 ids keep their bits
  if (b.keys == nullptr) return std::nullopt;
  b.n = static_cast<size_t>(shape[0]);
  b.offsets = array_as_is<int64_t>(items[1], 1, shape);
  if (b.offsets == nullptr || shape[0] < 1) return std::nullopt;
  b.num_bags = static_cast<size_t>(shape[0] - 1);
  if (with_grads) {
    b.grads = array_as_is<float>(items[2], 2, shape);
    if (b.grads == nullptr || shape[0] != static_cast<py::ssize_t>(b.num_bags) || shape[1] != dim) {
      return std::nullopt;
    }
  }
  if (items.size() == arrays + 1 && !items[arrays].is_none()) {  // (None: no weights)
    b.weights = array_as_is<float>(items[arrays], 1, shape);
    if (b.weights == nullptr || shape[0] != static_cast<py::ssize_t>(b.n)) return std::nullopt;
  }
  return b;
}

std::shared_ptr<Table> make_table(size_t dim, size_t capacity, size_t num_shards,
                                  size_t num_threads, int eviction, int optimizer, float lr,
                                  float eps, float initial_accumulator, float momentum,
                                  float beta1, float beta2, float weight_decay, float ftrl_beta,
                                  float l1, float l2, int initializer, double init_a,
                                  double init_b, uint64_t seed, uint32_t admission_min_count,
                                  size_t admission_width, size_t admission_depth,
                                  bool stage_evicted) {
  embstore::TableConfig c;
  c.dim = dim;
  c.capacity = capacity;
  c.num_shards = num_shards;
  c.num_threads = num_threads;
  c.eviction = static_cast<embstore::Eviction>(eviction);
  c.optimizer.kind = static_cast<embstore::OptimizerKind>(optimizer);
  c.optimizer.lr = lr;
  c.optimizer.eps = eps;
  c.optimizer.initial_accumulator = initial_accumulator;
  c.optimizer.momentum = momentum;
  c.optimizer.beta1 = beta1;
  c.optimizer.beta2 = beta2;
  c.optimizer.weight_decay = weight_decay;
  c.optimizer.ftrl_beta = ftrl_beta;
  c.optimizer.l1 = l1;
  c.optimizer.l2 = l2;
  c.initializer.kind = static_cast<embstore::InitializerKind>(initializer);
  c.initializer.a = init_a;
  c.initializer.b = init_b;
  c.initializer.seed = seed;
  c.admission.min_count = admission_min_count;
  c.admission.width = admission_width;
  c.admission.depth = admission_depth;
  c.stage_evicted = stage_evicted;
  py::gil_scoped_release release;  // large tables: allocation may take a while
  return std::make_shared<Table>(c);
}

py::dict summary_dict(const embstore::LatencySummary& l) {
  py::dict e;
  e["count"] = l.count;
  e["p50_us"] = l.p50_us;
  e["p95_us"] = l.p95_us;
  e["p99_us"] = l.p99_us;
  e["max_us"] = l.max_us;
  e["mean_us"] = l.mean_us;
  return e;
}

// Every timer of a table at one moment (opaque to Python: handed back to latency_between).
struct TimerSnapshot {
  std::vector<embstore::HistogramSnapshot> timers;
};

TimerSnapshot take_snapshot(const Table& t) {
  TimerSnapshot snap;
  for (const auto& h : t.timers()) snap.timers.push_back(h.snapshot());
  return snap;
}

// name -> summary of what each timer recorded between two snapshots (names with none left out).
py::dict latency_between(const TimerSnapshot& before, const TimerSnapshot& now) {
  py::dict latency;
  const embstore::HistogramSnapshot empty;
  for (size_t k = 0; k < now.timers.size(); ++k) {
    const embstore::LatencySummary l = embstore::LatencyHistogram::summarize(
        k < before.timers.size() ? before.timers[k] : empty, now.timers[k]);
    if (l.count == 0) continue;
    latency[embstore::timer_name(static_cast<embstore::Timer>(k))] = summary_dict(l);
  }
  return latency;
}

py::dict stats_dict(const Table& t) {
  const embstore::TableStats s = t.stats();
  py::dict d;
  d["size"] = s.size;
  d["capacity"] = s.capacity;
  d["dim"] = s.dim;
  d["num_shards"] = s.num_shards;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["inserts"] = s.inserts;
  d["evictions"] = s.evictions;
  d["erased"] = s.erased;
  d["admitted"] = s.admitted;
  d["rejected"] = s.rejected;
  d["lock_waits"] = s.lock_waits;
  d["lock_wait_us"] = static_cast<double>(s.lock_wait_ns) / 1000.0;
  d["reused_rows"] = s.reused_rows;
  d["read_retries"] = s.read_retries;
  d["arena_bytes_in_use"] = s.arena_bytes_in_use;
  d["row_stride"] = s.row_stride;
  d["bytes_per_row"] = s.bytes_per_row;
  py::dict latency;  // only what was recorded since the last reset
  for (size_t k = 0; k < static_cast<size_t>(embstore::Timer::kCount); ++k) {
    const embstore::LatencySummary l = t.timers()[k].summary();
    if (l.count == 0) continue;
    latency[embstore::timer_name(static_cast<embstore::Timer>(k))] = summary_dict(l);
  }
  d["latency"] = latency;
  return d;
}

// Hands a vector's buffer to numpy without copying: the array owns the moved vector.
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* owner = new std::vector<T>(std::move(v));
  py::capsule free_owner(owner, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(std::move(shape), owner->data(), free_owner);
}

// {"ids": uint64 [k], "rows": float32 [k, width]}
py::dict removed_rows_dict(embstore::RemovedRows&& removed, size_t width) {
  const auto k = static_cast<py::ssize_t>(removed.ids.size());
  py::dict d;
  d["ids"] = to_numpy(std::move(removed.ids), {k});
  d["rows"] = to_numpy(std::move(removed.rows), {k, static_cast<py::ssize_t>(width)});
  return d;
}

// A Snapshot that keeps its table alive (the Python object may outlive the facade's table).
struct PySnapshot {
  std::shared_ptr<Table> table;
  std::unique_ptr<Snapshot> snap;
};

std::shared_ptr<PySnapshot> begin_snapshot(const std::shared_ptr<Table>& t, int mode) {
  if (mode < 0 || mode > 2) throw py::value_error("mode: must be 0 (full), 1 (delta) or 2 (export)");
  auto out = std::make_shared<PySnapshot>();
  out->table = t;
  py::gil_scoped_release release;  // waits while another snapshot of the table runs
  out->snap = std::make_unique<Snapshot>(*t, static_cast<embstore::SnapshotMode>(mode));
  return out;
}

template <typename T>
py::array_t<T> vector_copy(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

embstore::Timer timer_by_name(const std::string& name) {
  for (size_t k = 0; k < static_cast<size_t>(embstore::Timer::kCount); ++k) {
    const auto t = static_cast<embstore::Timer>(k);
    if (name == embstore::timer_name(t)) return t;
  }
  throw py::value_error("unknown timer '" + name + "'");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "embstore C++ core (private: use the embstore package)";
  py::register_exception<embstore::CapacityError>(m, "CapacityError", PyExc_RuntimeError);

  py::class_<TimerSnapshot>(m, "TimerSnapshot").def(py::init<>());  // empty: before anything
  m.def("latency_between", &latency_between, py::arg("before"), py::arg("now"));

  py::class_<Table, std::shared_ptr<Table>>(m, "Table")
      .def(py::init(&make_table), py::arg("dim"), py::arg("capacity"), py::arg("num_shards"),
           py::arg("num_threads"), py::arg("eviction"), py::arg("optimizer"), py::arg("lr"),
           py::arg("eps"), py::arg("initial_accumulator"), py::arg("momentum"),
           py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("ftrl_beta"),
           py::arg("l1"), py::arg("l2"), py::arg("initializer"), py::arg("init_a"),
           py::arg("init_b"), py::arg("seed"), py::arg("admission_min_count"),
           py::arg("admission_width"), py::arg("admission_depth"), py::arg("stage_evicted"))
      .def_property_readonly("step", &Table::step)
      .def("set_step", &Table::set_step, py::arg("step"))
      .def_property_readonly("state_width", &Table::state_width)
      .def_property_readonly("evicted_pending", &Table::evicted_pending)
      .def(
          "evict_older_than",
          [](Table& t, uint64_t step, bool with_state) {
            embstore::RemovedRows removed;
            {
              py::gil_scoped_release release;
              t.evict_older_than(step, with_state, removed);
            }
            const size_t width = with_state ? t.dim() + t.state_width() : t.dim();
            return removed_rows_dict(std::move(removed), width);
          },
          py::arg("step"), py::arg("with_state"))
      .def("drain_evicted",
           [](Table& t) {
             embstore::RemovedRows removed;
             {
               py::gil_scoped_release release;
               t.drain_evicted(removed);
             }
             return removed_rows_dict(std::move(removed), t.dim());
           })
      .def_property_readonly("step_tracking", &Table::step_tracking)
      .def_property_readonly("row_width", &Table::row_width)
      .def(
          "import_rows",
          [](Table& t, const py::array& ids, const py::array& rows, const py::object& steps,
             bool restore, const py::object& placed) {
            const uint64_t* k = checked_data<uint64_t>(ids, "ids", -1, 0, false);
            const auto n = ids.shape(0);
            const float* r = checked_data<float>(rows, "rows", n,
                                                 static_cast<py::ssize_t>(t.row_width()), false);
            const uint32_t* st = steps.is_none()
                                     ? nullptr
                                     : checked_data<uint32_t>(steps.cast<py::array>(),
                                                              "steps", n, 0, false);
            uint8_t* pl = placed.is_none() ? nullptr
                                           : checked_data<uint8_t>(placed.cast<py::array>(),
                                                                   "placed", n, 0, true);
            const auto mode = restore ? embstore::ImportMode::kRestore
                                      : embstore::ImportMode::kUpsert;
            py::gil_scoped_release release;
            return t.import_rows(k, static_cast<size_t>(n), r, st, mode, pl);
          },
          py::arg("ids"), py::arg("rows"), py::arg("steps"), py::arg("restore"),
          py::arg("placed"))
      .def(
          "sketch_counters",
          [](Table& t, size_t s) {
            if (s >= t.num_shards()) throw py::index_error("shard out of range");
            std::vector<uint16_t> c;
            {
              py::gil_scoped_release release;
              c = t.sketch_counters(s);
            }
            return vector_copy(c);
          },
          py::arg("shard"))
      .def(
          "restore_sketch",
          [](Table& t, size_t s, const py::array& counters) {
            if (s >= t.num_shards()) throw py::index_error("shard out of range");
            const uint16_t* c = checked_data<uint16_t>(counters, "counters", -1, 0, false);
            const auto n = static_cast<size_t>(counters.shape(0));
            py::gil_scoped_release release;
            return t.restore_sketch(s, c, n);
          },
          py::arg("shard"), py::arg("counters"))
      .def(
          "record_latency",
          [](Table& t, const std::string& name, uint64_t ns) {
            t.record_latency(timer_by_name(name), ns);
          },
          py::arg("name"), py::arg("ns"))
      .def_property_readonly("dim", &Table::dim)
      .def_property_readonly("capacity", &Table::capacity)
      .def_property_readonly("num_shards", &Table::num_shards)
      .def_property_readonly("num_threads", &Table::num_threads)
      .def("__len__", &Table::size)
      .def_property_readonly("lr", &Table::lr)
      .def("set_lr", &Table::set_lr, py::arg("lr"))
      .def("stats", &stats_dict)
      .def("reset_timers", &Table::reset_timers)
      .def("timer_snapshot", &take_snapshot)
      .def(
          "lookup",
          [](Table& t, const py::array& keys, bool insert, const py::array& out) {
            const uint64_t* k = keys_data(keys);
            const auto n = keys.shape(0);
            float* o = checked_data<float>(out, "out", n, static_cast<py::ssize_t>(t.dim()), true);
            py::gil_scoped_release release;
            t.lookup(k, static_cast<size_t>(n), insert, o);
          },
          py::arg("keys"), py::arg("insert"), py::arg("out"))
      .def(
          "lookup_sum",
          [](Table& t, const py::array& keys, const py::array& offsets, const py::object& weights,
             int mode, bool insert, const py::array& out) {
            const uint64_t* k = keys_data(keys);
            const auto n = keys.shape(0);
            py::ssize_t bags = 0;
            const int64_t* off = optional_offsets(offsets, bags);
            const float* w = optional_weights(weights, n);
            float* o = checked_data<float>(out, "out", bags, static_cast<py::ssize_t>(t.dim()), true);
            const PoolMode pm = to_mode(mode);
            py::gil_scoped_release release;
            t.lookup_sum(k, static_cast<size_t>(n), off, static_cast<size_t>(bags), w, pm, insert, o);
          },
          py::arg("keys"), py::arg("offsets"), py::arg("weights"), py::arg("mode"),
          py::arg("insert"), py::arg("out"))
      .def(
          "apply_gradients",
          [](Table& t, const py::array& keys, const py::array& grads, const py::object& offsets,
             const py::object& weights, int mode) {
            const uint64_t* k = keys_data(keys);
            const auto n = keys.shape(0);
            py::ssize_t bags = 0;
            const int64_t* off = optional_offsets(offsets, bags);
            const float* w = optional_weights(weights, n);
            const float* g = checked_data<float>(grads, "grads", off ? bags : n,
                                                 static_cast<py::ssize_t>(t.dim()), false);
            const PoolMode pm = to_mode(mode);
            py::gil_scoped_release release;
            t.apply_gradients(k, static_cast<size_t>(n), g, off, static_cast<size_t>(bags), w, pm);
          },
          py::arg("keys"), py::arg("grads"), py::arg("offsets"), py::arg("weights"),
          py::arg("mode"))
      .def(
          "contains",
          [](Table& t, const py::array& keys, const py::array& out) {
            const uint64_t* k = keys_data(keys);
            const auto n = keys.shape(0);
            bool* o = checked_data<bool>(out, "out", n, 0, true);
            py::gil_scoped_release release;
            t.contains(k, static_cast<size_t>(n), o);
          },
          py::arg("keys"), py::arg("out"))
      .def(
          "erase",
          [](Table& t, const py::array& keys) {
            const uint64_t* k = keys_data(keys);
            const auto n = keys.shape(0);
            py::gil_scoped_release release;
            return t.erase(k, static_cast<size_t>(n));
          },
          py::arg("keys"))
      .def(
          "initial_values",
          [](const Table& t, const py::array& keys, const py::array& out) {
            const uint64_t* k = keys_data(keys);
            const auto n = keys.shape(0);
            float* o = checked_data<float>(out, "out", n, static_cast<py::ssize_t>(t.dim()), true);
            py::gil_scoped_release release;
            t.initial_values(k, static_cast<size_t>(n), o);
          },
          py::arg("keys"), py::arg("out"));

  py::class_<PySnapshot, std::shared_ptr<PySnapshot>>(m, "Snapshot")
      .def_property_readonly("num_shards", [](const PySnapshot& p) { return p.snap->num_shards(); })
      .def_property_readonly("row_width", [](const PySnapshot& p) { return p.snap->row_width(); })
      .def_property_readonly("step", [](const PySnapshot& p) { return p.snap->step(); })
      .def_property_readonly("step_tracking",
                             [](const PySnapshot& p) { return p.snap->step_tracking(); })
      .def_property_readonly("lr", [](const PySnapshot& p) { return p.snap->lr(); })
      .def_property_readonly("finished", [](const PySnapshot& p) { return p.snap->finished(); })
      .def(
          "next",
          [](PySnapshot& p, size_t s, const py::array& ids, const py::array& rows,
             const py::array& steps) {
            uint64_t* k = checked_data<uint64_t>(ids, "ids", -1, 0, true);
            const auto cap = ids.shape(0);
            float* r = checked_data<float>(rows, "rows", cap,
                                           static_cast<py::ssize_t>(p.snap->row_width()), true);
            uint32_t* st = checked_data<uint32_t>(steps, "steps", cap, 0, true);
            py::gil_scoped_release release;
            return p.snap->next(s, k, r, st, static_cast<size_t>(cap));
          },
          py::arg("shard"), py::arg("ids"), py::arg("rows"), py::arg("steps"))
      .def("done", [](const PySnapshot& p, size_t s) { return p.snap->done(s); }, py::arg("shard"))
      .def("removed", [](const PySnapshot& p, size_t s) { return vector_copy(p.snap->removed(s)); },
           py::arg("shard"))
      .def("sketch", [](const PySnapshot& p, size_t s) { return vector_copy(p.snap->sketch(s)); },
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

  // TableGroup's batched calls: one tuple per table, taken exactly as given. A tuple whose
  // arrays are not already in the core's dtypes and layout makes the call return None (False
  // for the apply) before anything runs: TableGroup then converts them (or raises its own
  // error) and calls again. Returns the pooled outputs, from the output pool. The tuples are
  // held while the GIL is released, so their arrays outlive the call even if another thread
  // changes the list.
  m.def(
      "group_lookup_sum",
      [](const std::vector<std::shared_ptr<Table>>& tables, const py::list& features, int mode,
         bool insert, const std::vector<std::string>& labels) -> py::object {
        const size_t R = tables.size();
        if (features.size() != R || labels.size() != R) {
          throw py::value_error("group_lookup_sum: argument lists differ in length");
        }
        const PoolMode pm = to_mode(mode);
        std::vector<embstore::LookupSumRequest> requests(R);
        const std::vector<py::object> held = hold(features);
        for (size_t k = 0; k < R; ++k) {
          const std::optional<CanonicalBatch> b = canonical_batch(held[k], 2, false, 0);
          if (!b) return py::none();
          requests[k] = {tables[k].get(), b->keys, b->n, b->offsets, b->num_bags,
                         b->weights,      pm,      insert, nullptr,  labels[k]};
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
        return std::move(outs);
      },
      py::arg("tables"), py::arg("features"), py::arg("mode"), py::arg("insert"),
      py::arg("labels"));

  m.def(
      "group_apply_gradients",
      [](const std::vector<std::shared_ptr<Table>>& tables, const py::list& grads, int mode,
         const std::vector<std::string>& labels) {
        const size_t R = tables.size();
        if (grads.size() != R || labels.size() != R) {
          throw py::value_error("group_apply_gradients: argument lists differ in length");
        }
        const PoolMode pm = to_mode(mode);
        std::vector<embstore::ApplyRequest> requests(R);
        const std::vector<py::object> held = hold(grads);
        for (size_t k = 0; k < R; ++k) {
          const std::optional<CanonicalBatch> b =
              canonical_batch(held[k], 3, true, static_cast<py::ssize_t>(tables[k]->dim()));
          if (!b) return false;
          requests[k] = {tables[k].get(), b->keys,    b->n,  b->grads, b->offsets,
                         b->num_bags,     b->weights, pm,    labels[k]};
        }
        py::gil_scoped_release release;
        embstore::apply_gradients_many(requests, embstore::Timer::kGroupApplyGradients);
        return true;
      },
      py::arg("tables"), py::arg("grads"), py::arg("mode"), py::arg("labels"));

  // A new float32 [rows, dim] array for a batch result, its memory from the output pool: it
  // returns there when the array is freed, so the next batch's result reuses mapped pages.
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
      "set_pool_spin_us",
      [](uint32_t us) { embstore::ThreadPool::global().set_spin_us(us); },
      py::arg("us"));
  m.def("metrics_enabled", &embstore::metrics_enabled);
  m.def("set_metrics_enabled", &embstore::set_metrics_enabled, py::arg("on"));
  m.def("simd_level", [] { return std::string(embstore::simd_level_name(embstore::simd_level())); });
  m.def(
      "set_simd_level",
      [](const std::string& name) {
        // Test and benchmark seam: the kernels' instruction set (results are the same bits).
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
      },
      py::arg("level"));
  m.def(
      "histogram_summary",
      [](const std::vector<uint64_t>& values_ns) {
        // Test seam: the percentile summary of given durations, as the tables compute it.
        embstore::LatencyHistogram h;
        for (uint64_t v : values_ns) h.record(v);
        return summary_dict(h.summary());
      },
      py::arg("values_ns"));
  bind_checkpoint(m);
}
