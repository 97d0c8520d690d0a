// File: apply_kernel.cpp
//
// The fused apply: one task per (request, shard) sums the gradients of each distinct row of
// the shard (in id order), then applies one optimizer update per row, under the shard's
// lock. Ids resolve by probing the index, or from the training lookup's resolution when the
// call took one and the recorded row still holds the id.
#include <cstdint>      // uint32_t, uint64_t
#include <optional>     // std::optional
#include <type_traits>  // std::true_type, std::false_type
#include <vector>       // std::vector

#include "embstore/errors.hpp"                 // CapacityError
#include "embstore/hash.hpp"                   // mix64
#include "embstore/internal/batch_runner.hpp"  // BatchRunner
#include "embstore/internal/tuning.hpp"        // kRowAhead, kSlotAhead, kRing, kLongUpdate
#include "embstore/optimizer.hpp"              // apply_update

namespace embstore {
namespace {

using detail::kLongUpdate;
using detail::kRing;
using detail::kRowAhead;
using detail::kSlotAhead;
using detail::kToL2;
using detail::kWideRowBytes;
using detail::prefetch_lines;

// An apply task's per-row gradient sums and the rows they belong to, for one shard's ids of
// one request at a time, in scratch the worker thread reuses from task to task: it stays in
// cache (a region per request would be cold at every call).
struct ApplyScratch {
  float* acc;        // (ids, dim)
  uint32_t* unique;  // (ids)
};
ApplyScratch apply_scratch(size_t ids, size_t dim) {
  thread_local std::vector<float> acc;
  thread_local std::vector<uint32_t> unique;
  if (acc.size() < ids * dim) acc.resize(ids * dim);
  if (unique.size() < ids) unique.resize(ids);
  return {acc.data(), unique.data()};
}

}  // namespace

// One shard's part of one apply request, run under the shard's lock in three passes:
// resolve (every id already present is found and its gradient summed), insert (the missing
// ids, in order, then summed) and update (one optimizer step per distinct row). When inserts
// come, the rows summed so far are pinned first, so those cannot evict them. Specialised by
// width like the read kernel: the gradient sums and the row update run fixed-length loops.
template <size_t kDim>
class BatchRunner::ShardApply {
 public:
  ShardApply(Table& t, size_t s, const ApplyRequest& r, Workspace& ws)
      : t_(t),
        s_(s),
        r_(r),
        ws_(ws),
        sh_(*t.shards_[s]),
        b_(ws.shard_begin[s]),
        e_(ws.shard_begin[s + 1]),
        dim_(t.dim()),
        row_bytes_(t.arena_.stride() * sizeof(float)) {}

  void run(float lr) {
    if (b_ == e_) return;
    const ApplyScratch scratch = apply_scratch(e_ - b_, dim());
    acc_base_ = scratch.acc;
    unique_ = scratch.unique;
    const bool track = t_.track_steps_.load(std::memory_order_relaxed);
    const uint32_t step = t_.step();
    const auto lock = sh_.lock();
    places_ = ws_.resolution.valid ? ws_.resolution.places.data() : nullptr;
    exact_ = places_ != nullptr && ws_.resolution.exact(s_, sh_.version_locked());
    thread_local std::vector<uint32_t> slots;
    if (slots.size() < sh_.num_rows()) slots.resize(sh_.num_rows(), kNoRow);
    slot_of_ = slots.data();
    // The resolve pass changes nothing a lock-free reader sees (it reads the index and rows;
    // it sets no pins), so the shard's version turns odd only when the insert pass
    // or the update begins: readers racing this apply take their careful kernel for less long.
    std::optional<Shard::WriteScope> writing;
    const bool cow = t_.snapshot_join(sh_);  // checkpoint in progress: preserve before writing
    Unpin unpin{sh_, unique_, num_unique_, slot_of_, pinned_};
    const bool plain = r_.offsets != nullptr && r_.weights == nullptr && r_.mode == PoolMode::kSum;
    if (exact_ && plain) {
      resolve(std::true_type{});
    } else {
      resolve(std::false_type{});
    }
    ShardCounters::add(sh_.counters.reused, reused_);
    writing.emplace(sh_);
    insert_missing(step);
    update(lr, cow, track, step);
    add_counters(sh_, 0, 0, inserts_, evictions_, rejected_);
  }

 private:
  // The row width: a compile-time constant for the widths with a fixed-length kernel.
  size_t dim() const noexcept { return kDim != 0 ? kDim : dim_; }

  // Clears the pins of the rows summed so far: runs on success and on CapacityError alike.
  struct Unpin {
    Shard& sh;
    const uint32_t* rows;
    const uint32_t& count;
    uint32_t* slot_of;
    const bool& pinned;
    ~Unpin() {
      for (uint32_t k = 0; k < count; ++k) {
        slot_of[rows[k]] = kNoRow;
        if (pinned) sh.unpin(rows[k]);
      }
    }
  };

  // Adds id i's gradient to the sum of `row` (the first occurrence starts it: acc = 0 + g).
  // `fast` (std::true_type): the lookup's places are exact (no recorded row to check, no pins)
  // and the gradients are plain pooled sums (offsets, no weights, mode sum): the training
  // step, with those tests hoisted out of the per-id path.
  template <typename Fast>
  void accumulate(uint32_t i, uint32_t row, Fast) {
    constexpr bool kFast = Fast::value;
    const size_t dim = this->dim();
    // This occurrence's gradient: g = c * grads[bag] (pooled) or grads[i].
    const float* __restrict g;
    float c = 1.0f;
    bool scaled = false;
    if constexpr (kFast) {
      g = r_.grads + static_cast<size_t>(ws_.bag_of[i]) * dim;
    } else if (r_.offsets == nullptr) {
      g = r_.grads + static_cast<size_t>(i) * dim;
    } else {
      const uint32_t bag = ws_.bag_of[i];
      g = r_.grads + static_cast<size_t>(bag) * dim;
      if (r_.weights != nullptr) {
        c = r_.weights[i];
        scaled = true;
      }
      if (r_.mode == PoolMode::kMean) {
        c = c / static_cast<float>(r_.offsets[bag + 1] - r_.offsets[bag]);
        scaled = true;
      }
    }
    uint32_t& slot = slot_of_[row];
    const bool first = slot == kNoRow;
    if (first) {  // first occurrence: acc = 0 + g
      slot = num_unique_;
      if (!kFast && pinned_) sh_.pin(row);
      unique_[num_unique_] = row;
      // The update pass prefetches rows kRowAhead ahead, so its first ones would arrive
      // late (a shard may hold only a few dozen ids of a batch): fetch them now.
      if (num_unique_ < kRowAhead) prefetch_lines<1>(t_.row_ptr(sh_, row), row_bytes_);
      ++num_unique_;
    }
    // accumulate_row's restrict parameters let the compiler vectorise the fixed widths; with
    // restrict locals GCC unrolled the sum of a repeated id into 16 scalar adds at D = 16.
    float* acc = acc_base_ + static_cast<size_t>(slot) * dim;
    accumulate_row<kDim>(acc, g, !kFast && scaled ? &c : nullptr, first, dim);
  }

  // Id i's row if the lookup's recorded place still holds it, else kNoRow. Prefetches the
  // link and occupied bit of the row kRowAhead ids ahead (its id is read through the link).
  uint32_t recorded_row(uint32_t j, uint32_t i) {
    if (j + kRowAhead < e_) {
      const uint64_t ahead = places_[ws_.order[j + kRowAhead]];
      if (ahead != RowResolution::kUnresolved) {
        sh_.prefetch_link(static_cast<uint32_t>(ahead));
        sh_.prefetch_occupied(static_cast<uint32_t>(ahead));
      }
    }
    const uint64_t place = places_[i];
    if (place == RowResolution::kUnresolved) return kNoRow;
    const uint32_t recorded = static_cast<uint32_t>(place);
    if (!sh_.occupied(recorded) || sh_.id_of(recorded) != r_.keys[i]) return kNoRow;
    ++reused_;
    return recorded;
  }

  // Resolve pass: every id already present is resolved and accumulated (the insert pass
  // pins those rows before its first insert, so none can evict a row the call is about to
  // update). Missing ids wait for the insert pass (all occurrences of a missing id do, so
  // each row's sum keeps the id order). Pipelined like gather_shard: resolve id j,
  // accumulate the id kRowAhead resolutions back. Overwrites this shard's part of ws.order
  // with the missing ids.
  template <typename Fast>
  void resolve(Fast fast) {
    constexpr bool kFast = Fast::value;
    uint32_t ring[kRing];  // resolved rows awaiting accumulation, at q % kRing
    uint32_t pending[kRing];  // ... and their ids' positions
    uint32_t resolved = 0, done = 0;  // entries [done, resolved) are pending
    missing_ = ws_.order.data() + b_;  // reused in place: slots [b, j) are done
    const uint32_t* bags = r_.offsets != nullptr ? ws_.bag_of.data() : nullptr;
    for (uint32_t j = b_; j < e_; ++j) {
      const uint32_t i = ws_.order[j];
      prefetch_inputs(ws_, j, e_, r_.keys, places_, bags);
      uint32_t row = kNoRow;
      if (kFast || exact_) {
        const uint64_t place = places_[i];
        if (place != RowResolution::kUnresolved) {
          row = static_cast<uint32_t>(place);
          ++reused_;
        }
      } else if (places_ != nullptr) {
        row = recorded_row(j, i);
      } else if (j + kSlotAhead < e_) {
        sh_.prefetch(mix64(r_.keys[ws_.order[j + kSlotAhead]]));
      }
      if (row == kNoRow) row = sh_.find(r_.keys[i], mix64(r_.keys[i]));
      if (row == kNoRow) {
        // order[b + num_missing] is never ahead of order[j]: safe to overwrite.
        missing_[num_missing_++] = i;
        continue;
      }
      // What accumulate reads of the row kRowAhead ids from now: its accumulator slot (a
      // random entry of an array over the shard's rows).
      __builtin_prefetch(slot_of_ + row);
      ring[resolved % kRing] = row;
      pending[resolved % kRing] = i;
      if (++resolved - done > kRowAhead) {
        accumulate(pending[done % kRing], ring[done % kRing], fast);
        ++done;
      }
    }
    for (; done < resolved; ++done) accumulate(pending[done % kRing], ring[done % kRing], fast);
  }

  // Insert pass: the missing ids in order (an id may recur: find again first). With an
  // admission filter, an id it has not admitted (by lookups) is not inserted and its gradient
  // is dropped; applies do not count sightings (a training step would count twice).
  void insert_missing(uint32_t step) {
    if (num_missing_ != 0) {  // inserts come: pin the rows summed so far
      for (uint32_t k = 0; k < num_unique_; ++k) sh_.pin(unique_[k]);
      pinned_ = true;
    }
    const CountMinSketch* sketch = t_.sketches_.empty() ? nullptr : &t_.sketches_[s_];
    const uint32_t min_count = t_.config_.admission.min_count;
    for (uint32_t k = 0; k < num_missing_; ++k) {
      const uint32_t i = missing_[k];
      const uint64_t id = r_.keys[i];
      const uint64_t hash = mix64(id);
      uint32_t row = sh_.find(id, hash);
      if (row == kNoRow) {
        if (sketch != nullptr && sketch->estimate(hash) < min_count) {
          ++rejected_;
          continue;
        }
        row = t_.insert_locked(s_, id, hash, step, evictions_);
        if (row == kNoRow) {
          add_counters(sh_, 0, 0, inserts_, evictions_, rejected_);
          throw CapacityError(t_.no_row_message(id, s_));
        }
        ++inserts_;
      }
      accumulate(i, row, std::false_type{});
    }
  }

  // Update pass: one optimizer step per distinct row, rows prefetched kRowAhead ahead. A long
  // pass or wide rows prefetch into L2: with several rows of many lines in flight an L1
  // prefetch loop waits on its own prefetches. The words of each row's reference and dirty
  // bits are prefetched too (their loads stalled short passes).
  void update(float lr, bool cow, bool track, uint32_t step) {
    const OptimizerConfig opt = t_.config_.optimizer;
    const bool to_l2 = num_unique_ >= kLongUpdate || row_bytes_ > kWideRowBytes;
    for (uint32_t k = 0; k < num_unique_; ++k) {
      if (k + kRowAhead < num_unique_) {
        const uint32_t ahead = unique_[k + kRowAhead];
        if (to_l2) {
          prefetch_lines<0, kToL2>(t_.row_ptr(sh_, ahead), row_bytes_);
        } else {
          prefetch_lines(t_.row_ptr(sh_, ahead), row_bytes_);
        }
        sh_.prefetch_update_bits(ahead);
      }
      const uint32_t row = unique_[k];
      if (cow) t_.preserve(s_, row);
      apply_update(opt, lr, t_.row_ptr(sh_, row), acc_base_ + static_cast<size_t>(k) * dim(),
                   dim());
      sh_.reference(row);
      sh_.mark_dirty(row);
      if (track) sh_.touch(row, step);
    }
  }

  Table& t_;
  const size_t s_;
  const ApplyRequest& r_;
  Workspace& ws_;
  Shard& sh_;
  const uint32_t b_, e_;  // the shard's ids: ws.order[b_, e_)
  const size_t dim_;  // the table's width (see dim())
  const size_t row_bytes_;
  float* acc_base_ = nullptr;
  uint32_t* unique_ = nullptr;  // distinct rows in first-occurrence order
  uint32_t num_unique_ = 0;
  // Each row's accumulator index: a per-thread array over the shard's rows, all kNoRow
  // between calls. Rows are pinned (against eviction by this batch's inserts) only if an
  // insert comes.
  uint32_t* slot_of_ = nullptr;
  bool pinned_ = false;
  const uint64_t* places_ = nullptr;  // the lookup's resolution, or nullptr
  bool exact_ = false;  // places_ are exact for this shard
  uint32_t* missing_ = nullptr;
  uint32_t num_missing_ = 0;
  uint64_t reused_ = 0, inserts_ = 0, evictions_ = 0, rejected_ = 0;
};

void BatchRunner::apply_shard(Table& t, size_t s, const ApplyRequest& r, float lr, Workspace& ws) {
  by_width(t.dim(), [&](auto width) { ShardApply<decltype(width)::value>(t, s, r, ws).run(lr); });
}

}  // namespace embstore
