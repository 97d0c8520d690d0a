// File: python/table_bindings.cpp
//
// _core.TableConfig (a table's construction settings, readwrite fields) and _core.Table.
#include <pybind11/numpy.h>     // py::array
#include <pybind11/pybind11.h>

#include <cstdint>  // uint64_t
#include <memory>   // std::shared_ptr
#include <string>   // std::string
#include <utility>  // std::move
#include <vector>   // std::vector

#include "embstore/config.hpp"  // TableConfig
#include "embstore/table.hpp"   // Table
#include "python/arrays.hpp"    // checked_data, keys_data, to_numpy
#include "python/bindings.hpp"  // bind_table
#include "python/latency.hpp"   // summary_dict, take_snapshot, timer_by_name

namespace embstore_py {
namespace {

using embstore::PoolMode;
using embstore::Table;
using embstore::TableConfig;

// A readwrite field of the config, seen from Python as `T` (enums as their int codes).
#define EMBSTORE_FIELD(T, name, member, type)                              \
  c.def_property(                                                          \
      name, [](const TableConfig& t) { return static_cast<T>(t.member); }, \
      [](TableConfig& t, T v) { t.member = static_cast<type>(v); })

void bind_table_config(py::module_& m) {
  py::class_<TableConfig> c(m, "TableConfig");
  // TableConfig(**fields): the defaults of config.hpp, then each named field set.
  c.def(py::init([](const py::kwargs& fields) {
    TableConfig config;
    py::object self = py::cast(&config, py::return_value_policy::reference);
    for (const auto& item : fields) {
      const std::string name = py::str(item.first);
      if (name.empty() || name[0] == '_' || !py::hasattr(self, name.c_str())) {
        throw py::type_error("TableConfig: unknown field '" + name + "'");
      }
      py::setattr(self, name.c_str(), item.second);
    }
    return config;
  }));
  EMBSTORE_FIELD(size_t, "dim", dim, size_t);
  EMBSTORE_FIELD(size_t, "capacity", capacity, size_t);
  EMBSTORE_FIELD(size_t, "num_shards", num_shards, size_t);
  EMBSTORE_FIELD(size_t, "num_threads", num_threads, size_t);
  EMBSTORE_FIELD(int, "eviction", eviction, embstore::Eviction);
  EMBSTORE_FIELD(int, "optimizer", optimizer.kind, embstore::OptimizerKind);
  EMBSTORE_FIELD(float, "lr", optimizer.lr, float);
  EMBSTORE_FIELD(float, "eps", optimizer.eps, float);
  EMBSTORE_FIELD(float, "initial_accumulator", optimizer.initial_accumulator, float);
  EMBSTORE_FIELD(float, "momentum", optimizer.momentum, float);
  EMBSTORE_FIELD(float, "beta1", optimizer.beta1, float);
  EMBSTORE_FIELD(float, "beta2", optimizer.beta2, float);
  EMBSTORE_FIELD(float, "weight_decay", optimizer.weight_decay, float);
  EMBSTORE_FIELD(float, "ftrl_beta", optimizer.ftrl_beta, float);
  EMBSTORE_FIELD(float, "l1", optimizer.l1, float);
  EMBSTORE_FIELD(float, "l2", optimizer.l2, float);
  EMBSTORE_FIELD(int, "initializer", initializer.kind, embstore::InitializerKind);
  EMBSTORE_FIELD(double, "init_a", initializer.a, double);
  EMBSTORE_FIELD(double, "init_b", initializer.b, double);
  EMBSTORE_FIELD(uint64_t, "seed", initializer.seed, uint64_t);
  EMBSTORE_FIELD(uint32_t, "admission_min_count", admission.min_count, uint32_t);
  EMBSTORE_FIELD(size_t, "admission_width", admission.width, size_t);
  EMBSTORE_FIELD(size_t, "admission_depth", admission.depth, size_t);
  EMBSTORE_FIELD(bool, "stage_evicted", stage_evicted, bool);
}

#undef EMBSTORE_FIELD

std::shared_ptr<Table> make_table(const TableConfig& config) {
  py::gil_scoped_release release;  // large tables: allocation may take a while
  return std::make_shared<Table>(config);
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

// {"ids": uint64 [k], "rows": float32 [k, width]}
py::dict removed_rows_dict(embstore::RemovedRows&& removed, size_t width) {
  const auto k = static_cast<py::ssize_t>(removed.ids.size());
  py::dict d;
  d["ids"] = to_numpy(std::move(removed.ids), {k});
  d["rows"] = to_numpy(std::move(removed.rows), {k, static_cast<py::ssize_t>(width)});
  return d;
}

py::dict evict_older_than(Table& t, uint64_t step, bool with_state) {
  embstore::RemovedRows removed;
  {
    py::gil_scoped_release release;
    t.evict_older_than(step, with_state, removed);
  }
  const size_t width = with_state ? t.dim() + t.state_width() : t.dim();
  return removed_rows_dict(std::move(removed), width);
}

py::dict drain_evicted(Table& t) {
  embstore::RemovedRows removed;
  {
    py::gil_scoped_release release;
    t.drain_evicted(removed);
  }
  return removed_rows_dict(std::move(removed), t.dim());
}

size_t import_rows(Table& t, const py::array& ids, const py::array& rows, const py::object& steps,
                   bool restore, const py::object& placed) {
  const uint64_t* k = checked_data<uint64_t>(ids, "ids", -1, 0, false);
  const auto n = ids.shape(0);
  const float* r =
      checked_data<float>(rows, "rows", n, static_cast<py::ssize_t>(t.row_width()), false);
  const uint32_t* st = steps.is_none()
                           ? nullptr
                           : checked_data<uint32_t>(steps.cast<py::array>(), "steps", n, 0, false);
  uint8_t* pl = placed.is_none()
                    ? nullptr
                    : checked_data<uint8_t>(placed.cast<py::array>(), "placed", n, 0, true);
  const auto mode = restore ? embstore::ImportMode::kRestore : embstore::ImportMode::kUpsert;
  py::gil_scoped_release release;
  return t.import_rows(k, static_cast<size_t>(n), r, st, mode, pl);
}

py::array_t<uint16_t> sketch_counters(Table& t, size_t s) {
  if (s >= t.num_shards()) throw py::index_error("shard out of range");
  std::vector<uint16_t> c;
  {
    py::gil_scoped_release release;
    c = t.sketch_counters(s);
  }
  return vector_copy(c);
}

bool restore_sketch(Table& t, size_t s, const py::array& counters) {
  if (s >= t.num_shards()) throw py::index_error("shard out of range");
  const uint16_t* c = checked_data<uint16_t>(counters, "counters", -1, 0, false);
  const auto n = static_cast<size_t>(counters.shape(0));
  py::gil_scoped_release release;
  return t.restore_sketch(s, c, n);
}

void lookup(Table& t, const py::array& keys, bool insert, const py::array& out) {
  const uint64_t* k = keys_data(keys);
  const auto n = keys.shape(0);
  float* o = checked_data<float>(out, "out", n, static_cast<py::ssize_t>(t.dim()), true);
  py::gil_scoped_release release;
  t.lookup(k, static_cast<size_t>(n), insert, o);
}

void lookup_sum(Table& t, const py::array& keys, const py::array& offsets,
                const py::object& weights, int mode, bool insert, const py::array& out) {
  const uint64_t* k = keys_data(keys);
  const auto n = keys.shape(0);
  py::ssize_t bags = 0;
  const int64_t* off = optional_offsets(offsets, bags);
  const float* w = optional_weights(weights, n);
  float* o = checked_data<float>(out, "out", bags, static_cast<py::ssize_t>(t.dim()), true);
  const PoolMode pm = to_mode(mode);
  py::gil_scoped_release release;
  t.lookup_sum(k, static_cast<size_t>(n), off, static_cast<size_t>(bags), w, pm, insert, o);
}

void apply_gradients(Table& t, const py::array& keys, const py::array& grads,
                     const py::object& offsets, const py::object& weights, int mode) {
  const uint64_t* k = keys_data(keys);
  const auto n = keys.shape(0);
  py::ssize_t bags = 0;
  const int64_t* off = optional_offsets(offsets, bags);
  const float* w = optional_weights(weights, n);
  const float* g =
      checked_data<float>(grads, "grads", off ? bags : n, static_cast<py::ssize_t>(t.dim()), false);
  const PoolMode pm = to_mode(mode);
  py::gil_scoped_release release;
  t.apply_gradients(k, static_cast<size_t>(n), g, off, static_cast<size_t>(bags), w, pm);
}

void contains(Table& t, const py::array& keys, const py::array& out) {
  const uint64_t* k = keys_data(keys);
  const auto n = keys.shape(0);
  bool* o = checked_data<bool>(out, "out", n, 0, true);
  py::gil_scoped_release release;
  t.contains(k, static_cast<size_t>(n), o);
}

size_t erase(Table& t, const py::array& keys) {
  const uint64_t* k = keys_data(keys);
  const auto n = keys.shape(0);
  py::gil_scoped_release release;
  return t.erase(k, static_cast<size_t>(n));
}

void initial_values(const Table& t, const py::array& keys, const py::array& out) {
  const uint64_t* k = keys_data(keys);
  const auto n = keys.shape(0);
  float* o = checked_data<float>(out, "out", n, static_cast<py::ssize_t>(t.dim()), true);
  py::gil_scoped_release release;
  t.initial_values(k, static_cast<size_t>(n), o);
}

void record_latency(Table& t, const std::string& name, uint64_t ns) {
  t.record_latency(timer_by_name(name), ns);
}

}  // namespace

void bind_table(py::module_& m) {
  bind_table_config(m);
  py::class_<Table, std::shared_ptr<Table>>(m, "Table")
      .def(py::init(&make_table), py::arg("config"))
      .def_property_readonly("dim", &Table::dim)
      .def_property_readonly("capacity", &Table::capacity)
      .def_property_readonly("num_shards", &Table::num_shards)
      .def_property_readonly("num_threads", &Table::num_threads)
      .def_property_readonly("state_width", &Table::state_width)
      .def_property_readonly("row_width", &Table::row_width)
      .def_property_readonly("step", &Table::step)
      .def_property_readonly("step_tracking", &Table::step_tracking)
      .def_property_readonly("evicted_pending", &Table::evicted_pending)
      .def_property_readonly("lr", &Table::lr)
      .def("__len__", &Table::size)
      .def("set_step", &Table::set_step, py::arg("step"))
      .def("set_lr", &Table::set_lr, py::arg("lr"))
      .def("stats", &stats_dict)
      .def("reset_timers", &Table::reset_timers)
      .def("timer_snapshot", &take_snapshot)
      .def("record_latency", &record_latency, py::arg("name"), py::arg("ns"))
      .def("lookup", &lookup, py::arg("keys"), py::arg("insert"), py::arg("out"))
      .def("lookup_sum", &lookup_sum, py::arg("keys"), py::arg("offsets"), py::arg("weights"),
           py::arg("mode"), py::arg("insert"), py::arg("out"))
      .def("apply_gradients", &apply_gradients, py::arg("keys"), py::arg("grads"),
           py::arg("offsets"), py::arg("weights"), py::arg("mode"))
      .def("contains", &contains, py::arg("keys"), py::arg("out"))
      .def("erase", &erase, py::arg("keys"))
      .def("initial_values", &initial_values, py::arg("keys"), py::arg("out"))
      .def("evict_older_than", &evict_older_than, py::arg("step"), py::arg("with_state"))
      .def("drain_evicted", &drain_evicted)
      .def("import_rows", &import_rows, py::arg("ids"), py::arg("rows"), py::arg("steps"),
           py::arg("restore"), py::arg("placed"))
      .def("sketch_counters", &sketch_counters, py::arg("shard"))
      .def("restore_sketch", &restore_sketch, py::arg("shard"), py::arg("counters"));
}

}  // namespace embstore_py
