// File: python/checkpoint_bindings.cpp
//
// The checkpoint calls of the core (embstore/checkpoint.hpp) for Python: save and load
// tables and groups in C++, with the GIL released for the whole call. Errors:
// embstore::CheckpointError becomes embstore.checkpoint.CheckpointError (the package's
// existing class), std::system_error an OSError of its errno (FileNotFoundError for a
// missing file), CapacityError the module's CapacityError (registered in bindings.cpp).
#include <pybind11/numpy.h>  // py::array_t
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::optional, std::vector, std::string, std::pair

#include <cstdint>       // uint64_t, uint32_t
#include <memory>        // std::shared_ptr
#include <optional>      // std::optional
#include <string>        // std::string
#include <system_error>  // std::system_error
#include <tuple>         // std::tuple
#include <utility>       // std::pair
#include <vector>        // std::vector

#include "embstore/checkpoint.hpp"  // save, save_delta, load, save_group, load_group
#include "embstore/errors.hpp"      // CheckpointError
#include "embstore/table.hpp"       // Table

#include "python/bindings.hpp"  // bind_* declarations

namespace py = pybind11;

namespace {

using Route = std::tuple<uint64_t, uint32_t, uint32_t>;  // salt, num_shards, shard

py::dict loaded_dict(embstore::LoadedTable&& t) {
  py::dict d;
  d["table"] = std::shared_ptr<embstore::Table>(std::move(t.table));
  d["name"] = t.label.name;
  d["num_threads"] = t.label.num_threads;
  d["padding_id"] = t.label.padding_id;
  d["checkpoint_id"] = t.checkpoint_id.empty() ? py::none() : py::cast(t.checkpoint_id);
  d["rows"] = t.rows;
  d["dropped"] = t.dropped;
  return d;
}

embstore::LoadOptions load_options(std::optional<size_t> capacity, std::optional<size_t> num_shards,
                                   std::optional<size_t> num_threads, std::optional<int> eviction,
                                   bool stage_evicted, bool keep_recent,
                                   const std::optional<Route>& keep_route) {
  embstore::LoadOptions o;
  o.capacity = capacity;
  o.num_shards = num_shards;
  o.num_threads = num_threads;
  if (eviction) {
    if (*eviction != 0 && *eviction != 1) throw py::value_error("eviction: must be 0 or 1");
    o.eviction = static_cast<embstore::Eviction>(*eviction);
  }
  o.stage_evicted = stage_evicted;
  o.keep_recent = keep_recent;
  if (keep_route) {
    const auto [salt, n, k] = *keep_route;
    o.keep_id = embstore::keep_route(salt, n, k);
  }
  return o;
}

// CheckpointError -> embstore.CheckpointError; std::system_error -> OSError by errno.
void register_checkpoint_errors() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const embstore::CheckpointError& e) {
      const py::object cls = py::module_::import("embstore.checkpoint").attr("CheckpointError");
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const std::system_error& e) {
      // OSError(errno, message) is constructed as its subclass (FileNotFoundError, ...).
      PyErr_SetObject(PyExc_OSError, py::make_tuple(e.code().value(), e.what()).ptr());
    }
  });
}

}  // namespace

namespace embstore_py {

void bind_checkpoint(py::module_& m) {
  register_checkpoint_errors();
  m.def(
      "checkpoint_save",
      [](const std::shared_ptr<embstore::Table>& table, const std::string& path, bool delta,
         std::optional<std::string> name, std::optional<size_t> num_threads,
         std::optional<int64_t> padding_id) {
        embstore::TableLabel label{std::move(name), num_threads, padding_id};
        py::gil_scoped_release release;
        return delta ? embstore::save_delta(*table, path, label)
                     : embstore::save(*table, path, label);
      },
      py::arg("table"), py::arg("path"), py::kw_only(), py::arg("delta") = false,
      py::arg("name") = py::none(), py::arg("num_threads") = py::none(),
      py::arg("padding_id") = py::none(),
      "Writes a full checkpoint (or a delta) of the table at path; returns its id.");
  m.def(
      "checkpoint_load",
      [](const std::string& path, const std::vector<std::string>& deltas,
         std::optional<size_t> capacity, std::optional<size_t> num_shards,
         std::optional<size_t> num_threads, std::optional<int> eviction, bool stage_evicted,
         bool keep_recent, std::optional<Route> keep_route) {
        const embstore::LoadOptions o = load_options(capacity, num_shards, num_threads, eviction,
                                                     stage_evicted, keep_recent, keep_route);
        embstore::LoadedTable t;
        {
          py::gil_scoped_release release;
          t = embstore::load(path, deltas, o);
        }
        return loaded_dict(std::move(t));
      },
      py::arg("path"), py::arg("deltas") = std::vector<std::string>{}, py::kw_only(),
      py::arg("capacity") = py::none(), py::arg("num_shards") = py::none(),
      py::arg("num_threads") = py::none(), py::arg("eviction") = py::none(),
      py::arg("stage_evicted") = false, py::arg("keep_recent") = false,
      py::arg("keep_route") = py::none(),
      "Loads a table from a full checkpoint and its deltas; returns a dict (table, name, "
      "num_threads, checkpoint_id, rows, dropped).");
  m.def(
      "checkpoint_save_group",
      [](const std::vector<std::pair<std::string, std::shared_ptr<embstore::Table>>>& tables,
         const std::string& directory,
         const std::vector<std::pair<std::optional<size_t>, std::optional<int64_t>>>& labels) {
        std::vector<std::pair<std::string, embstore::Table*>> raw;
        for (const auto& [name, t] : tables) raw.emplace_back(name, t.get());
        std::vector<embstore::TableLabel> l;
        for (const auto& [threads, padding] : labels) l.push_back({std::nullopt, threads, padding});
        py::gil_scoped_release release;
        embstore::save_group(raw, directory, l);
      },
      py::arg("tables"), py::arg("directory"), py::kw_only(),
      py::arg("labels") = std::vector<std::pair<std::optional<size_t>, std::optional<int64_t>>>{},
      "Saves tables as a group; labels: empty or (num_threads, padding_id) per table.");
  m.def(
      "checkpoint_load_group",
      [](const std::string& directory, std::optional<size_t> num_threads) {
        embstore::LoadOptions o;
        o.num_threads = num_threads;
        std::vector<std::pair<std::string, embstore::LoadedTable>> tables;
        {
          py::gil_scoped_release release;
          tables = embstore::load_group(directory, o);
        }
        py::list out;
        for (auto& [name, t] : tables) out.append(py::make_tuple(name, loaded_dict(std::move(t))));
        return out;
      },
      py::arg("directory"), py::arg("num_threads") = py::none());
  m.def(
      "table_checkpoint_id",
      [](const embstore::Table& t) {
        const std::string id = t.checkpoint_id();
        return id.empty() ? py::none() : py::cast(id);
      },
      py::arg("table"),
      "The id of the checkpoint the core last saved the table to or loaded it from (the "
      "parent of its next core delta), or None.");
  m.def(
      "checkpoint_read_header",
      [](const std::string& path) {
        py::gil_scoped_release release;
        return embstore::read_header(path);
      },
      py::arg("path"), "The checked JSON header of a checkpoint, as text.");
  m.def(
      "route",
      [](const py::array_t<uint64_t, py::array::c_style>& ids, uint64_t salt, uint32_t n) {
        if (n == 0) throw py::value_error("num_shards: must be positive");
        py::array_t<uint32_t> out(ids.size());
        const uint64_t* in = ids.data();
        uint32_t* o = out.mutable_data();
        for (py::ssize_t i = 0; i < ids.size(); ++i) o[i] = embstore::route_of(in[i], salt, n);
        return out;
      },
      py::arg("ids"), py::arg("salt"), py::arg("num_shards"),
      "route(id) = (splitmix64(id ^ salt) * num_shards) >> 64 for each id.");
}

}  // namespace embstore_py
