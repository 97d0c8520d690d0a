// File: embstore/internal/checkpoint_header.hpp (private: not installed)
//
// A checkpoint's JSON header <-> a table's configuration, with the names and settings the
// Python package writes (docs/checkpoint.md, "Header keys"): optimizers and initializers by
// their Python class names and dataclass fields, the state layout, step and step tracking.
#pragma once

#include <cstdint>  // uint32_t
#include <string>   // std::string

#include "embstore/checkpoint.hpp"                // TableLabel
#include "embstore/config.hpp"                    // TableConfig
#include "embstore/internal/checkpoint_file.hpp"  // FileReader
#include "embstore/internal/json.hpp"             // Json

namespace embstore {
class Snapshot;
class Table;
}  // namespace embstore

namespace embstore::internal {

std::string new_checkpoint_id();  // 32 random hex digits (a uuid4's hex)

Json make_header(const Table& table, const Snapshot& snap, const std::string& kind,
                 const std::string& checkpoint_id, const std::string& parent_id,
                 const TableLabel& label);

// A header's table configuration, checked (CheckpointError naming the file otherwise).
struct SavedTable {
  TableConfig config;  // num_threads: the label's, or 0
  TableLabel label;
  uint32_t step = 0;
  bool step_tracking = false;
  size_t row_width = 0;
  std::string kind;  // "full" or "delta"

  bool same_shape(const SavedTable& o) const noexcept;  // dim, optimizer, row width
};
SavedTable parse_header(const FileReader& reader);

}  // namespace embstore::internal
