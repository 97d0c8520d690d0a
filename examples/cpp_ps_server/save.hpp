// File: save.hpp
//
// Save's file work, as the Python server does it (src/embstore/ps/server.py): the request's
// directory confined below --checkpoint-dir, a full save through embstore::save_group, and a
// delta save as every table's embstore::save_delta into DIR/tNNN.delta plus DELTAS.json
// naming them, written last and atomically.
#pragma once

#include <string>  // std::string
#include <vector>  // std::vector

#include "service.hpp"  // NamedTable

namespace embstore_ps {

// The directory a Save request writes: `given` itself when there is no checkpoint directory
// (then it must not be empty), else `given` joined below `checkpoint_dir` (an absolute,
// normalised path). std::invalid_argument naming `dir` when it leaves the directory.
std::string save_directory(const std::string& checkpoint_dir, const std::string& given);

// Every table's save_delta into `directory`/tNNN.delta (NNN: its position), then
// DELTAS.json {"format": "embstore.ps.deltas", "order": [...], "files": {name: file}}.
void save_group_delta(const std::vector<NamedTable>& tables, const std::string& directory);

}  // namespace embstore_ps
