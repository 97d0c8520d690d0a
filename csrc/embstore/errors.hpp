// File: embstore/errors.hpp
//
// Exceptions thrown by the core's public entry points. Hot loops never throw: they record a
// status that the entry point turns into one of these once all workers have stopped.
// std::invalid_argument (bad input, raised before anything changes) is used as is.
#pragma once

#include <stdexcept>  // std::runtime_error

namespace embstore {

// A row was needed but the table (or one of its shards) is full and eviction is disabled,
// or every row of the shard is pinned by the batch in progress.
class CapacityError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A checkpoint file is not one, is truncated or corrupted, has an unsupported format
// version, or does not fit (a delta chain out of order, a delta of another table). The
// message starts with the file's path. (I/O failures are std::system_error.)
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace embstore
