// File: embstore/snapshot.hpp
//
// Snapshot: copies a table out, shard by shard and in bounded chunks, exactly as it was at
// one instant, while other threads keep calling every operation on it. The checkpoint
// writer (src/embstore/checkpoint.py) streams the chunks to a file; Table.export collects
// them.
//
// Point-in-time guarantee. The snapshot's instant T is the moment the constructor publishes
// a new generation (Table::snapshot_gen_). Every critical section that may change rows
// (a batch's part in one shard, an erase, an import, ...) reads the generation once, under
// the shard lock, before changing anything (Table::snapshot_join): a section that read an
// older generation is before T and its writes are in the snapshot; a section that reads the
// new one is after T and joins the snapshot for that shard, so every row it changes, evicts
// or erases first has its pre-image (id, row, last step, dirty bit) preserved, once per row
// (Table::preserve), and every row it links is marked born-after and left out. Per shard
// the sections are ordered by the lock and generation reads are monotonic, so "before T"
// sections precede "after T" ones: the snapshot is the state of the whole table after
// exactly the sections that read the generation before T, i.e. a consistent cut. Every call
// that returned before the snapshot began is in it; no call that began after it is; a call
// running across T may be in it for some shards and not others, as a reader at T would see.
// Writers never wait for the snapshot beyond one chunk copy under a shard lock.
//
// Cost: writers pay one atomic load per critical section and one predictable branch per
// row write while no snapshot is pending; during one, the first write to each not yet
// written row copies it once. Extra memory: the caller's chunk buffer, plus the pre-images
// of rows changed in shards not yet written (none when nothing writes during the snapshot).
//
// Checkpoint bookkeeping (kFull, kDelta): rows written lose their dirty bit (kept aside and
// given back if the checkpoint is aborted), shards log the ids later removed, and kDelta
// writes only the rows dirty at T plus the ids removed since the previous checkpoint.
// commit() makes that final once the file is durable; abort() (or destruction without
// commit) undoes it. kExport changes no bookkeeping. One snapshot of a table at a time:
// the constructor waits for a running one to finish.
#pragma once

#include <chrono>   // std::chrono::steady_clock
#include <cstddef>  // size_t
#include <cstdint>  // uint64_t, uint32_t, uint16_t
#include <string>   // std::string
#include <vector>   // std::vector

#include "embstore/table.hpp"  // Table

namespace embstore {

enum class SnapshotMode : uint8_t { kFull = 0, kDelta = 1, kExport = 2 };

class Snapshot {
 public:
  Snapshot(Table& table, SnapshotMode mode);  // blocks while another snapshot of table runs
  ~Snapshot();                                // abort() unless committed or aborted
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;

  SnapshotMode mode() const noexcept { return mode_; }
  size_t num_shards() const noexcept { return done_.size(); }
  size_t row_width() const noexcept { return width_; }
  // Table settings read when the snapshot began.
  uint32_t step() const noexcept { return step_; }
  bool step_tracking() const noexcept { return track_; }
  float lr() const noexcept { return lr_; }

  // Copies up to `cap` more rows of shard s, as they were at T: ids[k], rows[k * row_width()
  // ...] (weights then optimizer state) and steps[k] (last step). Returns how many; when the
  // shard is complete done(s) turns true (the call that completes it may return 0 or more
  // rows). Shards may be taken in any order.
  size_t next(size_t s, uint64_t* ids, float* rows, uint32_t* steps, size_t cap);
  bool done(size_t s) const { return done_.at(s) != 0; }
  // Once done(s): kDelta: the ids removed from shard s between the previous checkpoint and
  // T; every mode: shard s's admission sketch counters (empty without admission).
  const std::vector<uint64_t>& removed(size_t s) const { return removed_.at(s); }
  const std::vector<uint16_t>& sketch(size_t s) const { return sketch_.at(s); }

  // The table's checkpoint id when the snapshot began (Table::checkpoint_id): the parent
  // of a delta written from this snapshot.
  const std::string& parent_id() const noexcept { return parent_id_; }

  // Checkpoints: call once the file is durable (every shard must be done); records the
  // table's "save" latency. kFull/kDelta: the table's checkpoint id becomes `checkpoint_id`
  // (the file's; empty: unknown to the core, so the next delta needs a full save first).
  void commit(const std::string& checkpoint_id = std::string());
  // Gives up: rows keep their dirty bits and removed ids stay logged for the next
  // checkpoint. Safe to call more than once.
  void abort() noexcept;
  bool finished() const noexcept { return finished_; }

 private:
  bool active() const;  // this snapshot is still the table's running one
  void finish_shard(size_t s);  // shard lock held
  void release() noexcept;

  Table& t_;
  SnapshotMode mode_;
  uint64_t gen_ = 0;
  size_t width_;
  uint32_t step_ = 0;
  bool track_ = false;
  float lr_ = 0;
  std::string parent_id_;
  bool finished_ = false;
  std::vector<char> done_;
  std::vector<std::vector<uint64_t>> removed_;
  std::vector<std::vector<uint16_t>> sketch_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace embstore
