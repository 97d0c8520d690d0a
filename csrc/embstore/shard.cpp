#include "embstore/shard.hpp"

#include "embstore/hash.hpp"  // mix64, fast_range32

namespace embstore {
namespace {

// Slots per row: 1.5 keeps linear probing short (about 2 probes per hit, 5 per miss at the
// worst load) for 18 bytes of index per row.
uint32_t slots_for(uint32_t rows) noexcept {
  const uint64_t n = static_cast<uint64_t>(rows) + rows / 2 + 8;  // + 8: tiny shards
  return static_cast<uint32_t>(n);
}

size_t round_to_line(size_t bytes) noexcept {
  return (bytes + kCacheLine - 1) / kCacheLine * kCacheLine;
}

}  // namespace

size_t Shard::index_bytes(uint32_t num_rows) noexcept {
  return round_to_line(size_t{slots_for(num_rows)} * sizeof(Slot)) +
         round_to_line(size_t{num_rows} * sizeof(uint32_t));
}

size_t Shard::steps_bytes(uint32_t num_rows) noexcept {
  return round_to_line(size_t{num_rows} * sizeof(uint32_t));
}

Shard::Shard(uint32_t first_row, uint32_t num_rows, uint32_t quota, void* memory, uint32_t* steps)
    : first_row_(first_row),
      num_rows_(num_rows),
      quota_(quota),
      num_slots_(slots_for(num_rows)),
      own_memory_(memory == nullptr ? LargeBuffer(index_bytes(num_rows) + steps_bytes(num_rows))
                                    : LargeBuffer()),
      slots_(memory != nullptr ? memory : own_memory_.data(), num_slots_),
      links_(
          reinterpret_cast<char*>(slots_.get()) + round_to_line(size_t{num_slots_} * sizeof(Slot)),
          num_rows),
      steps_(memory != nullptr ? static_cast<void*>(steps)
                               : static_cast<char*>(own_memory_.data()) + index_bytes(num_rows),
             num_rows),
      ref_bits_(num_rows),
      occupied_(num_rows),
      dirty_(num_rows),
      pinned_(num_rows),
      captured_(num_rows),
      born_after_(num_rows),
      saved_(num_rows),
      dirty_pending_(num_rows) {}

void Shard::link(uint64_t id, uint64_t hash, uint32_t row, uint32_t step) noexcept {
  const uint32_t pos = find_slot(id, hash);
  Slot& s = slots_.get()[pos];
  s.id = id;
  s.store_row_plus1(row + 1);
  links_.get()[row] = pos;
  pinned_.clear(row);
  touch(row, step);
  occupied_.set(row);
  dirty_.set(row);
  saved_.clear(row);  // a new id: in no checkpoint yet
  if (snap_pending_) born_after_.set(row);
  reference(row);
  counters.size.store(counters.size.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

void Shard::erase_slot(uint32_t hole) noexcept {
  Slot* slots = slots_.get();
  // Backward-shift deletion: move later entries of the probe run into the hole unless their
  // home lies cyclically in (hole, pos], so no tombstones ever accumulate.
  for (uint32_t pos = next(hole); !slots[pos].empty(); pos = next(pos)) {
    const uint32_t h = home(mix64(slots[pos].id));
    const bool stays = hole <= pos ? (hole < h && h <= pos) : (hole < h || h <= pos);
    if (stays) continue;
    slots[hole].id = slots[pos].id;
    slots[hole].store_row_plus1(slots[pos].load_row_plus1());  // the read mark moves too
    links_.get()[slots[hole].row()] = hole;
    hole = pos;
  }
  slots[hole].store_row_plus1(0);
}

uint32_t Shard::unlink_and_free(uint64_t id, uint64_t hash) {
  const uint32_t pos = find_slot(id, hash);
  Slot& s = slots_.get()[pos];
  if (s.empty()) return kNoRow;
  const uint32_t row = s.row();
  note_removed(row);  // first: may allocate (and throw) before anything changes
  erase_slot(pos);
  release_row(row);
  return row;
}

void Shard::free_row(uint32_t row) {
  note_removed(row);
  erase_slot(links_.get()[row]);
  release_row(row);
}

void Shard::release_row(uint32_t row) {
  occupied_.clear(row);
  dirty_.clear(row);
  links_.get()[row] = free_head_;
  free_head_ = row;
  counters.size.store(counters.size.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
}

uint32_t Shard::claim_unused_row() noexcept {
  if (free_head_ != kNoRow) {
    const uint32_t row = free_head_;
    free_head_ = links_.get()[row];
    return row;
  }
  counters.claimed_rows.store(used_ + 1, std::memory_order_relaxed);
  return used_++;
}

uint32_t Shard::clock_victim(uint64_t max_steps) noexcept {
  if (used_ == 0) return kNoRow;
  // Three sweeps clear every reference bit and read mark, so a fourth finding nothing means
  // all are pinned. Lock-free lookups set bits and marks without the lock, so while they
  // run they can set them again behind the hand; then the first evictable row of the sweep
  // is taken rather than failing (alone, the sweep always finds a clear row first).
  const uint64_t sweep = 3 * static_cast<uint64_t>(used_) + 1;
  uint32_t first_evictable = kNoRow;
  for (uint64_t step = 0; step < sweep; ++step) {
    if (step == max_steps) return kRetry;
    const uint32_t row = hand_;
    hand_ = ring_next(row);
    ++sweep_steps_;
    if (!evictable(row)) continue;  // free or pinned
    if (first_evictable == kNoRow) first_evictable = row;
    if (referenced(row)) {
      unreference(row);
      continue;
    }
    // The slot's read mark, only now: it is one more line (likely_victim's caller has
    // prefetched it), which evict() then reads from cache.
    Slot& slot = slots_.get()[links_.get()[row]];
    if ((slot.load_row_plus1() & kReadMark) != 0) {
      slot.clear_mark();
      continue;
    }
    return row;
  }
  if (first_evictable != kNoRow) hand_ = ring_next(first_evictable);
  return first_evictable;
}

uint32_t Shard::likely_victim(uint32_t limit) const noexcept {
  uint32_t row = hand_;
  for (uint32_t step = 0; step < limit && step < used_; ++step) {
    if (evictable(row) && !referenced(row)) return row;
    row = ring_next(row);
  }
  return kNoRow;
}

void Shard::evict(uint32_t row) {
  note_removed(row);
  erase_slot(links_.get()[row]);
  occupied_.clear(row);
  dirty_.clear(row);
  counters.size.store(counters.size.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
}

}  // namespace embstore
