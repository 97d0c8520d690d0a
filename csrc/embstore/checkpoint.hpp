// File: embstore/checkpoint.hpp
//
// Checkpoints of tables, written and read by the core in the format of docs/checkpoint.md
// (the Python package's format: files either writes, the other reads; the pure-numpy reader
// embstore.checkpoint.read reads them all).
//
//   std::string id = embstore::save(table, "user.ckpt");   // full: every row
//   embstore::save_delta(table, "user.1.ckpt");             // rows changed since the last one
//   embstore::LoadedTable t = embstore::load("user.ckpt", {"user.1.ckpt"});
//
// Guarantees (docs/checkpoint.md): a save is a point-in-time snapshot of the table (other
// threads may keep calling every operation, and wait at most one chunk copy under one shard
// lock); the file is written to a temporary file in the same directory, fsynced, renamed
// over the path, and the directory fsynced, so a crash leaves the old file or the new one;
// every section carries a CRC-32; rows stream in bounded chunks (a few MiB of buffers).
// One save of a table at a time (a second waits for the first).
//
// Errors: CheckpointError (errors.hpp) for a file that is not a checkpoint, truncated,
// corrupted, of another format version, or a delta chain that does not fit (the message
// starts with the path); CapacityError when the rows do not fit the new capacity (unless
// keep_recent); std::system_error for I/O failures (a missing file: ENOENT);
// std::invalid_argument for bad options. A failed save leaves the previous file at the path
// and the table's checkpoint bookkeeping unchanged; a failed load returns no table.
#pragma once

#include <cstddef>     // size_t
#include <cstdint>     // uint64_t, uint32_t, int64_t
#include <functional>  // std::function
#include <memory>      // std::unique_ptr
#include <optional>    // std::optional
#include <string>      // std::string
#include <utility>     // std::pair
#include <vector>      // std::vector

#include "embstore/config.hpp"  // TableConfig, Eviction
#include "embstore/table.hpp"   // Table

namespace embstore {

// What a checkpoint header records beyond the table's configuration (the Python facade's
// constructor arguments). Both are informational for a C++ program.
struct TableLabel {
  std::optional<std::string> name;  // null: an automatic name
  std::optional<size_t> num_threads;  // as given to the constructor (null: the machine's)
  // The Python facade's padding id (its 64 bits; the core itself ignores it).
  std::optional<int64_t> padding_id;
};

// Writes every row (ids, weights, optimizer state, last step), the configuration and the
// admission counters to `path`; starts a new delta chain. Returns the new checkpoint id
// (32 hex digits).
std::string save(Table& table, const std::string& path, const TableLabel& label = {});
// Writes the rows changed since the table's previous save/save_delta (or since it was
// loaded) plus the ids removed since then. CheckpointError when the table has no previous
// checkpoint (call save first).
std::string save_delta(Table& table, const std::string& path, const TableLabel& label = {});

// The route of the scale-out design: (splitmix64(id ^ salt) * num_shards) >> 64, a
// multiply-shift into [0, num_shards).
uint32_t route_of(uint64_t id, uint64_t salt, uint32_t num_shards) noexcept;

struct LoadOptions {
  // Overrides of the saved configuration (rows are re-hashed into the new shards). By
  // default the saved num_shards is kept, or chosen afresh when it exceeds a smaller
  // capacity override.
  std::optional<size_t> capacity, num_shards, num_threads;
  std::optional<Eviction> eviction;
  bool stage_evicted = false;  // TableConfig::stage_evicted of the new table
  // When the rows exceed the capacity: false -> CapacityError; true -> keep the `capacity`
  // rows with the largest last step (ties in file order).
  bool keep_recent = false;
  // Keep only the rows whose id satisfies it (nullptr: every row). Called from the loading
  // thread only; rows it rejects are never held (the file streams through). Capacity is
  // checked after filtering.
  std::function<bool(uint64_t)> keep_id;
};

// A keep_id predicate: route_of(id, salt, num_shards) == shard.
std::function<bool(uint64_t)> keep_route(uint64_t salt, uint32_t num_shards, uint32_t shard);

struct LoadedTable {
  std::unique_ptr<Table> table;
  TableLabel label;            // as saved in the last file
  std::string checkpoint_id;   // the chain it continues ("" when rows were dropped)
  size_t rows = 0;             // rows loaded
  size_t dropped = 0;          // rows of the chain left out (keep_recent, keep_id, no room)
};

// A new table from a full checkpoint and the deltas that follow it, in order (checked
// before anything is imported: base full, every delta a delta of the file before it, same
// dim and optimizer). The configuration (capacity, learning rate, step, ...) is the last
// file's. The table continues the chain: its next save_delta follows the last file, unless
// rows were dropped (then it needs a save first).
LoadedTable load(const std::string& path, const std::vector<std::string>& deltas = {},
                 const LoadOptions& options = {});

// The header of a checkpoint (JSON text, checked: preamble, header and trailer).
std::string read_header(const std::string& path);

// Groups (the Python TableGroup's directory format): one full checkpoint per table,
// `tNNN-<12 hex>.ckpt`, then MANIFEST.json written atomically (the commit point); files of
// older saves and stray temporary files are removed after. The tables' snapshots begin back
// to back before any is written (their instants are microseconds apart, not one instant).
// Names must be distinct. `labels` (empty, or one per table) supply what a header records
// beyond the configuration; each file's name is the table's name in the group.
void save_group(const std::vector<std::pair<std::string, Table*>>& tables,
                const std::string& directory, const std::vector<TableLabel>& labels = {});
// Loads every table the manifest names, in its order (options apply to each table;
// keep_id too, so a group can be resharded).
std::vector<std::pair<std::string, LoadedTable>> load_group(const std::string& directory,
                                                            const LoadOptions& options = {});

}  // namespace embstore
