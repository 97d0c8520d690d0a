// File: embstore/internal/batch_runner.hpp
//
// BatchRunner: the batch kernels, a friend of Table. The kernels live in their own files
// (read_kernel.cpp: the lock-free read; insert_kernel.cpp: the locked path of lookups that
// insert; apply_kernel.cpp: the fused apply; batch.cpp: the many-table orchestration). The
// small helpers they share run once per id, so they are defined here, inline: no call
// crosses a translation unit inside a per-id loop. Internal: included by the core's .cpp
// files only.
#pragma once

#include <atomic>       // std::atomic
#include <cstddef>      // size_t
#include <cstdint>      // uint32_t, uint64_t
#include <cstring>      // std::memcpy, std::memset
#include <type_traits>  // std::integral_constant
#include <utility>      // std::pair
#include <vector>       // std::vector

#include "embstore/internal/batch_common.hpp"  // Workspace
#include "embstore/internal/tuning.hpp"        // kInputAhead, kIdsPerNoteAll
#include "embstore/simd.hpp"                   // simd_level, EMBSTORE_KERNEL_TARGET_AVX2
#include "embstore/table.hpp"                  // Table, LookupSumRequest, ApplyRequest

namespace embstore {

struct BatchRunner {
  using Workspace = detail::Workspace;

  // Groups keys by shard (stable counting sort) into ws.order / ws.shard_begin.
  // `places`: the ids' shard << 32 | row from a reused resolution (no hashing), or nullptr.
  static void plan(const Table& t, const uint64_t* keys, size_t n, Workspace& ws,
                   const uint64_t* places = nullptr);

  // Prefetches what the locked kernels read of the id kInputAhead ids after position j of a
  // shard's ids [.., e) in ws.order: its key and, when given, its place and bag.
  static void prefetch_inputs(const Workspace& ws, uint32_t j, uint32_t e, const uint64_t* keys,
                              const uint64_t* places, const uint32_t* bags) {
    if (j + detail::kInputAhead >= e) return;
    const uint32_t i = ws.order[j + detail::kInputAhead];
    __builtin_prefetch(keys + i);
    if (places != nullptr) __builtin_prefetch(places + i);
    if (bags != nullptr) __builtin_prefetch(bags + i);
  }

  static void add_counters(Shard& sh, uint64_t hits, uint64_t misses, uint64_t inserts,
                           uint64_t evictions, uint64_t rejected) {
    ShardCounters::add(sh.counters.hits, hits);
    ShardCounters::add(sh.counters.misses, misses);
    ShardCounters::add(sh.counters.inserts, inserts);
    ShardCounters::add(sh.counters.evictions, evictions);
    ShardCounters::add(sh.counters.rejected, rejected);
  }

  // out = 0 + w * src (first id of a bag) or out = out + w * src, in the spec's float order
  // (docs/semantics.md: s = 0; s = s + w_i * row_i; the leading 0 + is not a no-op for -0).
  // Unweighted sums skip the multiply (w * x == x exactly for w == 1). Reads rows without the
  // lock: the caller validates the shard version afterwards.
  template <size_t kDim>
  EMBSTORE_NO_SANITIZE_THREAD static void accumulate_row(float* __restrict out,
                                                         const float* __restrict src,
                                                         const float* weight, bool first,
                                                         size_t dim_runtime) noexcept {
    const size_t dim = kDim != 0 ? kDim : dim_runtime;
    if (weight == nullptr) {
      if (first) {
        for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + src[k];
      } else {
        for (size_t k = 0; k < dim; ++k) out[k] = out[k] + src[k];
      }
    } else {
      const float w = *weight;
      if (first) {
        for (size_t k = 0; k < dim; ++k) out[k] = 0.0f + w * src[k];
      } else {
        for (size_t k = 0; k < dim; ++k) out[k] = out[k] + w * src[k];
      }
    }
  }

  template <size_t kDim>
  EMBSTORE_NO_SANITIZE_THREAD static void copy_row(float* __restrict out,
                                                   const float* __restrict src,
                                                   size_t dim_runtime) noexcept {
    const size_t dim = kDim != 0 ? kDim : dim_runtime;
    for (size_t k = 0; k < dim; ++k) out[k] = src[k];
  }

  // What one optimistic read task saw: ids [first_id, first_id + count) of its request, whose
  // places (shard << 32 | row, kUnresolved for a miss) it wrote to the request's places
  // array. Its hit counts are committed only when the whole request completed without the
  // lock (see finish_reads).
  struct ReadTask {
    size_t first_id = 0;
    size_t count = 0;
    uint64_t misses = 0;
    bool raced = false;  // a writer got in the way: the caller redoes the task carefully
    // (shard, version) of every shard the fast kernel's reads were validated at; empty when
    // the task ran the careful kernel (RowResolution::versions).
    std::vector<std::pair<uint32_t, uint64_t>> versions;
  };

  // Seqlock validation for one read task, deferred to its end: each shard's version is noted
  // at the task's first probe of that shard (or every shard's at the task's start: note_all);
  // a later probe that sees another version, or an odd one, fails at once, and `valid()`
  // checks that no version moved since. Every read of a shard lies between a note that saw
  // version v and the final check that still sees v, so no writer overlapped any of them.
  // (At most one check per id, at the probe; none per copy.)
  class ShardVersions {
   public:
    explicit ShardVersions(const Table& t) : t_(t) {
      thread_local std::vector<uint64_t> seen;  // kUnseen between tasks
      thread_local std::vector<uint32_t> touched;
      if (seen.size() < t.num_shards()) seen.resize(t.num_shards(), kUnseen);
      seen_ = seen.data();
      touched_ = &touched;
      touched_->clear();
    }
    ~ShardVersions() {
      for (const uint32_t s : *touched_) seen_[s] = kUnseen;
    }
    ShardVersions(const ShardVersions&) = delete;
    ShardVersions& operator=(const ShardVersions&) = delete;
    // Notes shard s's version before a probe; false if the read must be redone under the lock.
    bool note(size_t s) noexcept {
      const uint64_t v = t_.shards_[s]->read_begin();
      if ((v & 1) != 0) return false;  // a writer is inside
      if (seen_[s] == v) return true;
      if (seen_[s] != kUnseen) return false;  // a writer came and went since the first probe
      seen_[s] = v;
      touched_->push_back(static_cast<uint32_t>(s));
      return true;
    }
    // Notes every shard's version at once (false if a writer is inside one): then no probe
    // needs note().
    bool note_all() noexcept {
      for (size_t s = 0; s < t_.num_shards(); ++s) {
        if (!note(s)) return false;
      }
      return true;
    }
    // note(s), and the version noted is `expected` (rows recorded at that version are read).
    bool note_at(size_t s, uint64_t expected) noexcept { return note(s) && seen_[s] == expected; }
    // note_at(s, pass[s]) for every shard a locked pass left in place (pass[s] a version, not
    // kCopiedShard; see gather_shard): then no read needs note_at().
    bool note_all_at(const uint64_t* pass) noexcept {
      for (size_t s = 0; s < t_.num_shards(); ++s) {
        if (pass[s] != kCopiedShard && !note_at(s, pass[s])) return false;
      }
      return true;
    }
    bool valid() const noexcept {
      for (const uint32_t s : *touched_) {
        if (!t_.shards_[s]->read_valid(seen_[s])) return false;
      }
      return true;
    }
    // Appends (shard, version) for every shard noted.
    void copy_to(std::vector<std::pair<uint32_t, uint64_t>>& out) const {
      for (const uint32_t s : *touched_) out.emplace_back(s, seen_[s]);
    }

   private:
    static constexpr uint64_t kUnseen = 1;  // odd: never a version a probe accepts
    const Table& t_;
    uint64_t* seen_;
    std::vector<uint32_t>* touched_;  // the shards noted, in first-probe order
  };

  // The first id of bag b of r (without offsets every id is its own bag).
  static size_t bag_begin(const LookupSumRequest& r, size_t b) noexcept {
    return r.offsets == nullptr ? b : static_cast<size_t>(r.offsets[b]);
  }

  // Whether a task over bags [bag_lo, bag_hi) of r notes every shard's version up front
  // (ShardVersions::note_all, note_all_at): with kIdsPerNoteAll or more ids per shard, that
  // spares each id a version load and check.
  static bool notes_all_up_front(const Table& t, const LookupSumRequest& r, size_t bag_lo,
                                 size_t bag_hi) noexcept {
    return t.num_shards() * detail::kIdsPerNoteAll <= bag_begin(r, bag_hi) - bag_begin(r, bag_lo);
  }

  // Resets `task` to bags [bag_lo, bag_hi) of r and returns their ids [lo, hi).
  static std::pair<size_t, size_t> start_task(const LookupSumRequest& r, size_t bag_lo,
                                              size_t bag_hi, ReadTask& task) noexcept {
    const size_t lo = bag_begin(r, bag_lo), hi = bag_begin(r, bag_hi);
    task.first_id = lo;
    task.count = hi - lo;
    task.misses = 0;
    task.raced = false;
    task.versions.clear();
    return {lo, hi};
  }

  // A row of `dim` zeros (what a missing id reads), one buffer per thread.
  static const float* zero_row(size_t dim) {
    thread_local std::vector<float> zeros;
    if (zeros.size() < dim) zeros.assign(dim, 0.0f);
    return zeros.data();
  }

  // Runs kernel(std::integral_constant<size_t, W>{}): W is the table's width when the row
  // kernels have a fully unrolled version for it (16, 32, 64, 128), else 0 (any width).
  // Inside the AVX2 wrapper when the CPU has it (the wrapper's `flatten` inlines the whole
  // kernel into it, so all of it is compiled for AVX2).
  template <class Kernel>
  static auto by_width(size_t dim, const Kernel& kernel) {
#if EMBSTORE_HAS_AVX2_KERNELS
    if (simd_level() == SimdLevel::kAvx2) return by_width_avx2(dim, kernel);
#endif
    return by_width_portable(dim, kernel);
  }
#if EMBSTORE_HAS_AVX2_KERNELS
  template <class Kernel>
  EMBSTORE_KERNEL_TARGET_AVX2 static auto by_width_avx2(size_t dim, const Kernel& kernel) {
    return by_width_portable(dim, kernel);
  }
#endif
  template <class Kernel>
  static inline auto by_width_portable(size_t dim, const Kernel& kernel) {
    switch (dim) {
      case 16: return kernel(std::integral_constant<size_t, 16>{});
      case 32: return kernel(std::integral_constant<size_t, 32>{});
      case 64: return kernel(std::integral_constant<size_t, 64>{});
      case 128: return kernel(std::integral_constant<size_t, 128>{});
      default: return kernel(std::integral_constant<size_t, 0>{});
    }
  }

  // Writes bags [bag_lo, bag_hi) of r.out from row_of(j) (id j's row, or nullptr to stop):
  // with offsets, each bag's pooled sum (zeros for an empty bag); without, each id's row
  // copied exactly. False if row_of stopped; true otherwise, also when it returned early
  // because another task of the request set `abort` (checked every 64 bags).
  template <size_t kDim, typename RowOf>
  static bool write_bags(const LookupSumRequest& r, size_t bag_lo, size_t bag_hi, size_t dim,
                         const std::atomic<bool>& abort, const RowOf& row_of) {
    for (size_t bag = bag_lo; bag < bag_hi; ++bag) {
      if ((bag & 63) == 0 && abort.load(std::memory_order_relaxed)) return true;
      float* out = r.out + bag * dim;
      if (r.offsets == nullptr) {  // lookup: the row, copied exactly
        const float* src = row_of(bag);
        if (src == nullptr) return false;
        copy_row<kDim>(out, src, dim);
        continue;
      }
      const size_t begin = static_cast<size_t>(r.offsets[bag]);
      const size_t end = static_cast<size_t>(r.offsets[bag + 1]);
      if (end - begin == 1) {  // one id (L = 1): 0 + w * row, straight into out (mean: / 1)
        const float* src = row_of(begin);
        if (src == nullptr) return false;
        accumulate_row<kDim>(out, src, r.weights != nullptr ? r.weights + begin : nullptr, true,
                             dim);
      } else if (begin == end) {  // an empty bag reads zeros
        std::memset(out, 0, dim * sizeof(float));
      } else if (!pool_bag<kDim>(out, begin, end, r.weights, r.mode, dim, row_of)) {
        return false;
      }
    }
    return true;
  }

  // Sums (or averages) the rows of ids [begin, end) into out, in id order (docs/semantics.md:
  // s = 0; s = s + w_i * row_i; the leading 0 + is not a no-op for -0). Fixed widths of up to
  // 32 floats sum in a local array the compiler keeps in registers. The bag is not empty
  // (begin < end). False if row_of aborted.
  template <size_t kDim, typename RowOf>
  EMBSTORE_NO_SANITIZE_THREAD static bool pool_bag(float* __restrict out, size_t begin, size_t end,
                                                   const float* weights, PoolMode mode, size_t dim,
                                                   const RowOf& row_of) noexcept {
    constexpr bool kLocal = kDim != 0 && kDim <= 32;
    float local[kLocal ? kDim : 1];
    float* __restrict acc = kLocal ? local : out;
    // The first row and the weights test are hoisted out of the per-id loop (two loops on
    // purpose: one generic lambda costs more instructions per id).
    const float* __restrict first = row_of(begin);
    if (first == nullptr) return false;
    if (weights == nullptr) {
      accumulate_row<kDim>(acc, first, nullptr, true, dim);
      for (size_t j = begin + 1; j < end; ++j) {
        const float* __restrict src = row_of(j);
        if (src == nullptr) return false;
        accumulate_row<kDim>(acc, src, nullptr, false, dim);
      }
    } else {
      accumulate_row<kDim>(acc, first, weights + begin, true, dim);
      for (size_t j = begin + 1; j < end; ++j) {
        const float* __restrict src = row_of(j);
        if (src == nullptr) return false;
        accumulate_row<kDim>(acc, src, weights + j, false, dim);
      }
    }
    if (mode == PoolMode::kMean) {
      const float count = static_cast<float>(end - begin);
      for (size_t k = 0; k < dim; ++k) acc[k] = acc[k] / count;
    }
    if (kLocal) std::memcpy(out, acc, dim * sizeof(float));
    return true;
  }

  // Lock-free read kernel (read_kernel.cpp).
  static void read_bags(Table& t, const LookupSumRequest& r, size_t bag_lo, size_t bag_hi,
                        std::atomic<bool>& abort, ReadTask& task, uint64_t* places, bool careful);
  template <size_t kDim, bool kAllNoted>
  static void read_bags_impl(Table& t, const LookupSumRequest& r, size_t bag_lo, size_t bag_hi,
                             std::atomic<bool>& abort, ReadTask& task, uint64_t* places);
  static void read_bags_careful(Table& t, const LookupSumRequest& r, size_t bag_lo, size_t bag_hi,
                                std::atomic<bool>& abort, ReadTask& task, uint64_t* places);
  static void finish_reads(Table& t, const LookupSumRequest& r, const ReadTask* tasks, size_t count,
                           bool aborted, RowResolution& resolution);

  // Locked path of lookups (insert_kernel.cpp).
  static constexpr uint64_t kCopiedShard = 1;  // odd: never a version
  static void gather_shard(Table& t, size_t s, const uint64_t* keys, const Workspace& ws,
                           bool insert, const float* weights, bool pooled, float* dst,
                           uint64_t* places, uint64_t* versions, uint64_t* pass = nullptr,
                           bool count_reads = true);
  static bool pool_places(Table& t, const LookupSumRequest& r, const uint64_t* places,
                          const uint64_t* pass, const float* copies, size_t bag_lo, size_t bag_hi);
  template <size_t kDim, bool kAllNoted>
  static bool pool_places_impl(Table& t, const LookupSumRequest& r, const uint64_t* places,
                               const uint64_t* pass, const float* copies, size_t bag_lo,
                               size_t bag_hi);
  static void pool_bags(const LookupSumRequest& r, size_t dim, const float* rows, size_t bag_lo,
                        size_t bag_hi);

  // Fused apply (apply_kernel.cpp).
  static void apply_shard(Table& t, size_t s, const ApplyRequest& r, float lr, Workspace& ws);
  template <size_t kDim>
  class ShardApply;

  // The many-table calls' phases (batch.cpp).
  class LookupBatch;
  class ApplyBatch;
};

}  // namespace embstore
