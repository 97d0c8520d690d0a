// File: table_checkpoint.cpp
//
// Table's checkpoint support: pre-images a pending snapshot needs (copy-on-write), the
// last-step bookkeeping of lookups, the fork child's reset, import_rows (a checkpoint load,
// or Table.import_) and the admission sketches' save and restore.
#include <atomic>              // std::atomic
#include <condition_variable>  // std::condition_variable
#include <cstring>             // std::memcpy
#include <new>                 // placement new
#include <vector>              // std::vector

#include "embstore/errors.hpp"                 // CapacityError
#include "embstore/hash.hpp"                   // mix64
#include "embstore/internal/batch_common.hpp"  // workspace, rotation, choose_workers
#include "embstore/internal/batch_runner.hpp"  // BatchRunner::plan
#include "embstore/table.hpp"                  // Table, PreImages
#include "embstore/thread_pool.hpp"            // ThreadPool

namespace embstore {

using detail::choose_workers;
using detail::rotation;
using detail::Workspace;
using detail::workspace;

void PreImages::add(uint64_t id, uint32_t step, bool was_dirty, const float* row) {
  const size_t k = ids.size();
  if (k / kChunkRows == chunks.size()) chunks.emplace_back(new float[kChunkRows * width]);
  std::memcpy(chunks[k / kChunkRows].get() + (k % kChunkRows) * width, row, width * sizeof(float));
  ids.push_back(id);
  steps.push_back(step);
  dirty.push_back(was_dirty ? 1 : 0);
}

void PreImages::clear() noexcept {
  std::vector<uint64_t>().swap(ids);
  std::vector<uint32_t>().swap(steps);
  std::vector<uint8_t>().swap(dirty);
  std::vector<std::unique_ptr<float[]>>().swap(chunks);
  emitted = 0;
}

void Table::preserve(size_t s, uint32_t row) {
  Shard& sh = *shards_[s];
  if (!sh.needs_preimage(row)) return;
  preimages_[s].add(sh.id_of(row), sh.last_step(row), sh.dirty(row), row_ptr(sh, row));
  sh.set_captured(row);
}

void Table::touch_step(size_t s, uint32_t row, uint32_t step, bool cow) {
  Shard& sh = *shards_[s];
  if (sh.last_step(row) == step) return;
  if (cow) preserve(s, row);
  sh.touch(row, step);
  sh.mark_dirty(row);
}

void Table::abandon_snapshot_locked(size_t s, uint64_t gen) {
  Shard& sh = *shards_[s];
  if (sh.snapshot_gen() != gen) sh.open_snapshot(gen, false);  // so no writer joins it later
  sh.close_snapshot();
  preimages_[s].clear();
}

void Table::reset_snapshot_after_fork() {
  // Runs in the fork child with every lock of the table held by this (the only) thread.
  new (&snapshot_cv_) std::condition_variable();  // no thread of the child waits on it
  if (!snapshot_busy_) return;
  const uint64_t gen = snapshot_gen_.load(std::memory_order_relaxed);
  for (size_t s = 0; s < shards_.size(); ++s) {
    abandon_snapshot_locked(s, gen);
    shards_[s]->restore_dirty();
  }
  snapshot_busy_ = false;
  active_gen_ = 0;
}

size_t Table::import_rows(const uint64_t* ids, size_t n, const float* rows, const uint32_t* steps,
                          ImportMode mode, uint8_t* placed) {
  const size_t width = row_width();
  const bool restore = mode == ImportMode::kRestore;
  const bool track = track_steps_.load(std::memory_order_relaxed);
  const uint32_t now = track ? step() : 0;
  Workspace& ws = workspace(0);
  BatchRunner::plan(*this, ids, n, ws);
  std::atomic<size_t> stored{0};
  const size_t rot = rotation();
  ThreadPool::global().run(
      shards_.size(), choose_workers(n, config_.num_threads), [&](size_t task) {
        const size_t s = (task + rot) % shards_.size();
        const uint32_t b = ws.shard_begin[s], e = ws.shard_begin[s + 1];
        if (b == e) return;
        Shard& sh = *shards_[s];
        uint64_t inserts = 0, evictions = 0;
        size_t count = 0;
        const auto lock = sh.lock();
        const Shard::WriteScope writing(sh);
        const bool cow = snapshot_join(sh);
        for (uint32_t j = b; j < e; ++j) {
          const uint32_t i = ws.order[j];
          const uint64_t id = ids[i];
          const uint64_t hash = mix64(id);
          const uint32_t last = steps != nullptr ? steps[i] : now;
          uint32_t row = sh.find(id, hash);
          if (row == kNoRow) {
            if (restore) {  // never evicts: a fresh table has room unless it is too small
              if (sh.has_unclaimed_row() && (sh.size() < sh.quota() || try_borrow())) {
                row = sh.claim_unused_row();
              }
            } else {
              row = claim_row_locked(s, evictions);
            }
            if (row == kNoRow) {
              if (restore) {
                if (placed != nullptr) placed[i] = 0;
                continue;
              }
              ShardCounters::add(sh.counters.inserts, inserts);
              ShardCounters::add(sh.counters.evictions, evictions);
              throw CapacityError(no_row_message(id, s));
            }
            std::memcpy(row_ptr(sh, row), rows + static_cast<size_t>(i) * width,
                        width * sizeof(float));
            sh.link(id, hash, row, last);
            ++inserts;
          } else {
            if (cow) preserve(s, row);
            std::memcpy(row_ptr(sh, row), rows + static_cast<size_t>(i) * width,
                        width * sizeof(float));
            sh.touch(row, last);
            sh.reference(row);
          }
          if (restore) {
            sh.clear_dirty(row);  // equal to the checkpoint it came from
            sh.set_saved(row);
          } else {
            sh.mark_dirty(row);
          }
          if (placed != nullptr) placed[i] = 1;
          ++count;
        }
        if (!restore) {
          ShardCounters::add(sh.counters.inserts, inserts);
          ShardCounters::add(sh.counters.evictions, evictions);
        }
        stored.fetch_add(count, std::memory_order_relaxed);
      });
  return stored.load();
}

std::vector<uint16_t> Table::sketch_counters(size_t s) {
  if (sketches_.empty()) return {};
  const auto lock = shards_[s]->lock();
  return sketches_[s].counters();
}

bool Table::restore_sketch(size_t s, const uint16_t* counters, size_t count) {
  if (sketches_.empty() || s >= sketches_.size()) return false;
  const auto lock = shards_[s]->lock();
  std::vector<uint16_t>& mine = sketches_[s].counters();
  if (mine.size() != count) return false;
  std::memcpy(mine.data(), counters, count * sizeof(uint16_t));
  return true;
}

}  // namespace embstore
