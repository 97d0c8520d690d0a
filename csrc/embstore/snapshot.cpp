#include "embstore/snapshot.hpp"

#include <cstring>    // std::memcpy
#include <mutex>      // std::unique_lock, std::lock_guard
#include <stdexcept>  // std::logic_error, std::out_of_range
#include <string>     // std::to_string

namespace embstore {

Snapshot::Snapshot(Table& table, SnapshotMode mode)
    : t_(table), mode_(mode), width_(table.row_width()), start_(std::chrono::steady_clock::now()) {
  const size_t S = t_.shards_.size();
  done_.assign(S, 0);
  removed_.resize(S);
  sketch_.resize(S);
  std::unique_lock<std::mutex> hold(t_.snapshot_mutex_);
  t_.snapshot_cv_.wait(hold, [&] { return !t_.snapshot_busy_; });
  t_.snapshot_busy_ = true;
  gen_ = t_.snapshot_gen_.load(std::memory_order_relaxed) + 1;
  t_.active_gen_ = gen_;
  step_ = t_.step();
  track_ = t_.step_tracking();
  lr_ = t_.lr();
  parent_id_ = t_.checkpoint_id();
  t_.snapshot_bookkeeping_.store(mode_ != SnapshotMode::kExport, std::memory_order_relaxed);
  t_.snapshot_gen_.store(gen_, std::memory_order_seq_cst);  // the snapshot's instant T
}

Snapshot::~Snapshot() { abort(); }

bool Snapshot::active() const {
  std::lock_guard<std::mutex> hold(t_.snapshot_mutex_);
  return !finished_ && t_.active_gen_ == gen_;
}

size_t Snapshot::next(size_t s, uint64_t* ids, float* rows, uint32_t* steps, size_t cap) {
  if (s >= done_.size()) {
    throw std::out_of_range("shard " + std::to_string(s) + " out of range");
  }
  if (!active()) throw std::logic_error("the snapshot is finished");
  Shard& sh = *t_.shards_[s];
  const auto lock = sh.lock();
  if (done_[s]) return 0;  // read under the lock: another thread may be finishing it
  // An abort on another thread abandoned this shard (same generation, nothing pending):
  // writing it again would hand its removed-ids log to a dead snapshot.
  if (sh.snapshot_gen() == gen_ && !sh.snapshot_pending()) {
    throw std::logic_error("the snapshot was aborted");
  }
  if (sh.snapshot_gen() != gen_) sh.open_snapshot(gen_, mode_ != SnapshotMode::kExport);
  const bool delta = mode_ == SnapshotMode::kDelta;
  const bool bookkeeping = mode_ != SnapshotMode::kExport;
  const size_t bytes = width_ * sizeof(float);
  size_t n = 0;
  // 1. Rows in ring order, skipping those born after T and those whose pre-image was kept.
  uint32_t cursor = sh.snapshot_cursor();
  const uint32_t end = sh.claimed_rows();
  while (cursor < end && n < cap) {
    const uint32_t row = cursor++;
    if (!sh.occupied(row) || sh.born_after(row) || sh.captured(row)) continue;
    const bool dirty = sh.dirty(row);
    if (delta && !dirty) continue;
    ids[n] = sh.id_of(row);
    steps[n] = sh.last_step(row);
    std::memcpy(rows + n * width_, t_.row_ptr(sh, row), bytes);
    ++n;
    if (bookkeeping && dirty) sh.take_dirty(row);
  }
  sh.set_snapshot_cursor(cursor);  // rows before it are written: writers no longer keep them
  if (cursor < end) return n;
  // 2. Then the pre-images writers preserved (no more can come: every row is written).
  PreImages& pre = t_.preimages_[s];
  while (pre.emitted < pre.size() && n < cap) {
    const size_t k = pre.emitted++;
    if (delta && pre.dirty[k] == 0) continue;
    ids[n] = pre.ids[k];
    steps[n] = pre.steps[k];
    std::memcpy(rows + n * width_, pre.row(k), bytes);
    ++n;
  }
  if (pre.emitted == pre.size()) finish_shard(s);
  return n;
}

void Snapshot::finish_shard(size_t s) {
  Shard& sh = *t_.shards_[s];
  if (mode_ != SnapshotMode::kExport) {
    sh.mark_saved_rows();  // before close_snapshot clears the born-after bits
    std::vector<uint64_t>& log = sh.removed_log();
    const size_t mark = sh.removed_mark();
    removed_[s].assign(log.begin(), log.begin() + static_cast<std::ptrdiff_t>(mark));
    log.erase(log.begin(), log.begin() + static_cast<std::ptrdiff_t>(mark));
    sh.set_removed_mark(0);
  }
  if (!t_.sketches_.empty()) sketch_[s] = t_.sketches_[s].counters();
  sh.close_snapshot();
  t_.preimages_[s].clear();
  done_[s] = 1;
}

std::string Table::checkpoint_id() const {
  std::lock_guard<std::mutex> hold(checkpoint_id_mutex_);
  return checkpoint_id_;
}

void Table::set_checkpoint_id(const std::string& id) {
  std::lock_guard<std::mutex> hold(checkpoint_id_mutex_);
  checkpoint_id_ = id;
}

void Snapshot::commit(const std::string& checkpoint_id) {
  if (!active()) throw std::logic_error("the snapshot is finished");
  for (size_t s = 0; s < done_.size(); ++s) {
    if (!done_[s]) {
      throw std::logic_error("commit: shard " + std::to_string(s) + " was not written");
    }
  }
  if (mode_ != SnapshotMode::kExport) {
    for (auto& sh : t_.shards_) {
      const auto lock = sh->lock();
      sh->commit_dirty();
    }
  }
  if (mode_ != SnapshotMode::kExport) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start_)
                        .count();
    t_.record_latency(Timer::kSave, static_cast<uint64_t>(ns));
    t_.set_checkpoint_id(checkpoint_id);  // before release: the next snapshot reads it
  }
  release();
}

void Snapshot::abort() noexcept {
  {
    std::lock_guard<std::mutex> hold(t_.snapshot_mutex_);
    if (finished_ || t_.active_gen_ != gen_) {
      finished_ = true;
      return;
    }
  }
  const bool bookkeeping = mode_ != SnapshotMode::kExport;
  for (size_t s = 0; s < done_.size(); ++s) {
    Shard& sh = *t_.shards_[s];
    const auto lock = sh.lock();
    if (!done_[s]) t_.abandon_snapshot_locked(s, gen_);
    if (!bookkeeping) continue;
    sh.restore_dirty();
    if (done_[s]) {  // the ids it took from the removed log go back (they came first)
      std::vector<uint64_t>& log = sh.removed_log();
      log.insert(log.begin(), removed_[s].begin(), removed_[s].end());
    }
  }
  release();
}

void Snapshot::release() noexcept {
  std::lock_guard<std::mutex> hold(t_.snapshot_mutex_);
  finished_ = true;
  if (t_.active_gen_ == gen_) {
    t_.active_gen_ = 0;
    t_.snapshot_busy_ = false;
    t_.snapshot_cv_.notify_all();
  }
}

}  // namespace embstore
