// File: batch.cpp
//
// The many-table batch calls, lookup_sum_many and apply_gradients_many: the orchestration of
// their phases only (validate, optimistic read, locked path, pool, keep the resolution; or
// validate, plan, update). The kernels each phase runs are in read_kernel.cpp,
// insert_kernel.cpp and apply_kernel.cpp.
#include <algorithm>  // std::min, std::max
#include <atomic>     // std::atomic
#include <exception>  // std::exception_ptr, std::rethrow_exception
#include <memory>     // std::unique_ptr
#include <numeric>    // std::iota
#include <stdexcept>  // std::invalid_argument
#include <string>     // std::to_string
#include <utility>    // std::swap
#include <vector>     // std::vector

#include "embstore/hash.hpp"                   // mix64
#include "embstore/internal/batch_common.hpp"  // Workspace, TaskSpace, StageClock
#include "embstore/internal/batch_runner.hpp"  // BatchRunner
#include "embstore/internal/float_env.hpp"     // DenormalScope
#include "embstore/internal/tuning.hpp"        // kIdsPerReadTask, kBagsPerPoolTask
#include "embstore/table.hpp"                  // lookup_sum_many, apply_gradients_many
#include "embstore/thread_pool.hpp"            // ThreadPool
#include "embstore/validate.hpp"               // validate_offsets, validate_finite

namespace embstore {

using detail::caller_workspaces;
using detail::choose_workers;
using detail::kBagsPerPoolTask;
using detail::kIdsPerReadTask;
using detail::prefix;
using detail::rotation;
using detail::StageClock;
using detail::TaskSpace;
using detail::Workspace;

namespace {

// The workers a batch of several requests gets: by its ids, up to its tables' most threads.
// With more than one, the pool's helpers are woken now, so that they are polling for the job
// by the time validation ends (ThreadPool::prewake).
template <typename Request>
size_t workers_for(const std::vector<Request>& requests) {
  size_t total_ids = 0, max_threads = 1;
  for (const Request& r : requests) {
    total_ids += r.n;
    max_threads = std::max(max_threads, r.table->num_threads());
  }
  const size_t workers = choose_workers(total_ids, max_threads);
  if (workers > 1) ThreadPool::global().prewake();
  return workers;
}

// Runs validate(k) for every request k on the pool (an apply may read megabytes of
// gradients to check them), then rethrows the error of the first request, in request order, that
// failed: the error a call raises does not depend on thread timing.
template <typename Validate>
void validate_each(size_t num_requests, size_t workers, const Validate& validate) {
  std::vector<std::exception_ptr> errors(num_requests);
  ThreadPool::global().run(num_requests, workers, [&](size_t k) {
    try {
      validate(k);
    } catch (...) {
      errors[k] = std::current_exception();
    }
  });
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace

// Groups keys by shard (stable counting sort).
void BatchRunner::plan(const Table& t, const uint64_t* keys, size_t n, Workspace& ws,
                       const uint64_t* places) {
  const size_t S = t.num_shards();
  ws.order.resize(n);
  ws.shard_begin.assign(S + 1, 0);
  if (S == 1) {
    std::iota(ws.order.begin(), ws.order.end(), 0u);
    ws.shard_begin[1] = static_cast<uint32_t>(n);
    return;
  }
  ws.shard_ids.resize(n);
  ws.cursor.assign(S, 0);
  for (size_t i = 0; i < n; ++i) {
    const size_t s = places != nullptr && places[i] != RowResolution::kUnresolved
                         ? places[i] >> 32
                         : t.shard_of(mix64(keys[i]));
    ws.shard_ids[i] = static_cast<uint16_t>(s);
    ++ws.cursor[s];
  }
  for (size_t s = 0; s < S; ++s) {
    ws.shard_begin[s + 1] = ws.shard_begin[s] + ws.cursor[s];
    ws.cursor[s] = ws.shard_begin[s];
  }
  for (size_t i = 0; i < n; ++i) ws.order[ws.cursor[ws.shard_ids[i]]++] = static_cast<uint32_t>(i);
}

// One lookup_sum_many call, phase by phase. Requests go first through the optimistic
// (lock-free) pass; those it aborts (an id to insert, a table that tracks steps) take the
// locked path: grouped by shard, resolved under each shard's lock in id order, then pooled.
class BatchRunner::LookupBatch {
 public:
  explicit LookupBatch(std::vector<LookupSumRequest>& requests)
      : requests_(requests),
        R_(requests.size()),
        spaces_(caller_workspaces(R_)),
        workers_(workers_for(requests)) {}

  void run(Timer op) {
    validate();
    read_optimistically();
    clock_.lap(Timer::kStageGather);
    for (size_t k = 0; k < R_; ++k) {
      if (aborted_[k].load(std::memory_order_relaxed)) locked_.push_back(k);
    }
    if (!locked_.empty()) run_locked();
    clock_.record(requests_, op);
  }

 private:
  // 1. Validates everything before any table changes.
  void validate() {
    validate_each(R_, workers_, [&](size_t k) {
      const LookupSumRequest& r = requests_[k];
      Workspace& ws = *spaces_[k];
      ws.one_hot = true;
      if (r.offsets != nullptr) {
        const size_t longest = validate_offsets(r.offsets, r.num_bags, r.n, r.label);
        ws.one_hot = longest <= 1 && r.num_bags == r.n;
      } else if (r.num_bags != r.n) {  // without offsets every id is its own bag
        throw std::invalid_argument(prefix(r.label) + "without offsets, num_bags must equal n");
      }
      if (r.weights != nullptr) validate_finite(r.weights, r.n, "weights", r.label);
    });
    clock_.lap(Timer::kStageValidate);
  }

  // 2. Optimistic pass: tasks of ~kIdsPerReadTask ids (whole bags) read rows without locks
  //    and pool them in bag order. A request that needs an insert is aborted (and redone on
  //    the locked path); a task that races a writer is redone row by row.
  void read_optimistically() {
    std::vector<size_t> bags_per_task(R_);
    TaskSpace tasks;
    for (size_t k = 0; k < R_; ++k) {
      const LookupSumRequest& r = requests_[k];
      const size_t count = std::max<size_t>(1, (r.n + kIdsPerReadTask - 1) / kIdsPerReadTask);
      bags_per_task[k] = std::max<size_t>(1, (r.num_bags + count - 1) / count);
      tasks.add(r.num_bags == 0 ? 0 : (r.num_bags + bags_per_task[k] - 1) / bags_per_task[k]);
    }
    thread_local std::vector<ReadTask> read_tasks;  // reused: no allocation warm
    if (read_tasks.size() < tasks.total()) read_tasks.resize(tasks.total());
    aborted_.reset(new std::atomic<bool>[R_]);
    for (size_t k = 0; k < R_; ++k) {
      // Step tracking writes each row's last step (and its dirty bit, with copy-on-write
      // while a checkpoint runs): that needs the shard lock, so such tables take the locked
      // path.
      const bool track = requests_[k].table->track_steps_.load(std::memory_order_relaxed);
      aborted_[k].store(track, std::memory_order_relaxed);
    }
    std::vector<ReadTask>& reads = read_tasks;
    // Per id: its place, written by the read tasks (and by gather_shard if the request goes
    // to the locked path; a request's places are kept only if it inserts).
    std::vector<uint64_t*> read_places(R_);
    for (size_t k = 0; k < R_; ++k) {
      spaces_[k]->resolution.places.resize(requests_[k].n);
      read_places[k] = spaces_[k]->resolution.places.data();
    }
    pool_.run(tasks.total(), workers_, [&](size_t task) {
      const size_t k = tasks.request_of(task);
      const LookupSumRequest& r = requests_[k];
      ReadTask& read = reads[task];
      if (aborted_[k].load(std::memory_order_relaxed)) return;
      const size_t bag_lo = (task - tasks.begin[k]) * bags_per_task[k];
      const size_t bag_hi = std::min(r.num_bags, bag_lo + bags_per_task[k]);
      read_bags(*r.table, r, bag_lo, bag_hi, aborted_[k], read, read_places[k], false);
      if (read.raced && !aborted_[k].load(std::memory_order_relaxed)) {
        r.table->read_retries_.fetch_add(1, std::memory_order_relaxed);  // redo it row by row
        read_bags(*r.table, r, bag_lo, bag_hi, aborted_[k], read, read_places[k], true);
      }
    });
    pool_.run(R_, workers_, [&](size_t k) {  // (every task ran: reads[] is complete)
      finish_reads(*requests_[k].table, requests_[k], reads.data() + tasks.begin[k],
                   tasks.begin[k + 1] - tasks.begin[k], aborted_[k].load(std::memory_order_relaxed),
                   spaces_[k]->resolution);
    });
  }

  // 3. The locked path for the aborted requests: plan, gather under the locks, pool; redo
  //    what a writer raced; keep the training lookups' resolutions for the apply.
  void run_locked() {
    pool_.run(locked_.size(), workers_, [&](size_t q) {
      const size_t k = locked_[q];
      const LookupSumRequest& r = requests_[k];
      plan(*r.table, r.keys, r.n, *spaces_[k]);
      if (!spaces_[k]->one_hot) spaces_[k]->rows.resize(r.n * r.table->dim());
      spaces_[k]->resolution.versions.assign(r.table->num_shards(), RowResolution::kUnknownVersion);
      spaces_[k]->pass.resize(r.table->num_shards());
    });
    clock_.lap(Timer::kStagePlan);
    rot_ = rotation();
    raced_.reset(new std::atomic<bool>[locked_.size()]);
    for (size_t q = 0; q < locked_.size(); ++q) raced_[q].store(false, std::memory_order_relaxed);
    std::vector<size_t> all(locked_.size());
    for (size_t q = 0; q < locked_.size(); ++q) all[q] = q;
    gather(all, true);
    clock_.lap(Timer::kStageLockedGather);
    const bool pooled = pool_all(all, true);
    // A writer changed rows a record-only request was to read: redo its pass copying rows.
    // Its ids are in the table now unless that writer evicted them; the redo does not count
    // its hits and misses again (an admission sketch does see its rejected ids again).
    std::vector<size_t> redo;
    for (size_t q = 0; q < locked_.size(); ++q) {
      if (raced_[q].load(std::memory_order_relaxed)) redo.push_back(q);
    }
    if (!redo.empty()) {
      for (const size_t q : redo) requests_[locked_[q]].table->read_retries_.fetch_add(1);
      gather(redo, false);
      pool_all(redo, false);
    }
    keep_resolutions();
    if (pooled) clock_.lap(Timer::kStagePool);
  }

  // A training lookup that pools (bags of any size) records its rows' places and pools
  // straight from the rows after the pass (gather_shard's `pass`); others copy the rows to
  // their output (one id per bag) or to the workspace, and pool from there.
  bool record_only(size_t k) const { return requests_[k].insert && !spaces_[k]->one_hot; }

  // Runs the locked pass of requests locked_[q] for q in `which`, one task per shard.
  void gather(const std::vector<size_t>& which, bool first) {
    TaskSpace shard_tasks;
    for (const size_t q : which) shard_tasks.add(requests_[locked_[q]].table->num_shards());
    pool_.run(shard_tasks.total(), workers_, [&](size_t task) {
      const size_t w = shard_tasks.request_of(task);
      const size_t k = locked_[which[w]];
      const LookupSumRequest& r = requests_[k];
      Workspace& ws = *spaces_[k];
      const size_t s = (task - shard_tasks.begin[w] + rot_) % r.table->num_shards();
      uint64_t* places = r.insert ? ws.resolution.places.data() : nullptr;
      uint64_t* versions = ws.resolution.versions.data();
      if (ws.one_hot) {
        gather_shard(*r.table, s, r.keys, ws, r.insert, r.weights, r.offsets != nullptr, r.out,
                     places, versions);
      } else {
        gather_shard(*r.table, s, r.keys, ws, r.insert, nullptr, false, ws.rows.data(), places,
                     versions, first && record_only(k) ? ws.pass.data() : nullptr, first);
      }
    });
  }

  // Pools the bags of requests locked_[q] for q in `which`; sets raced_[q] where a
  // record-only request's rows changed before they were read. Returns whether any pooled.
  bool pool_all(const std::vector<size_t>& which, bool first) {
    TaskSpace pool_tasks;
    for (const size_t q : which) {
      const size_t k = locked_[q];
      pool_tasks.add(spaces_[k]->one_hot
                         ? 0
                         : (requests_[k].num_bags + kBagsPerPoolTask - 1) / kBagsPerPoolTask);
    }
    pool_.run(pool_tasks.total(), workers_, [&](size_t task) {
      const size_t w = pool_tasks.request_of(task);
      const size_t k = locked_[which[w]];
      const LookupSumRequest& r = requests_[k];
      Workspace& ws = *spaces_[k];
      const size_t lo = (task - pool_tasks.begin[w]) * kBagsPerPoolTask;
      const size_t hi = std::min(r.num_bags, lo + kBagsPerPoolTask);
      if (!first || !record_only(k)) {
        pool_bags(r, r.table->dim(), ws.rows.data(), lo, hi);
      } else if (!pool_places(*r.table, r, ws.resolution.places.data(), ws.pass.data(),
                              ws.rows.data(), lo, hi)) {
        raced_[which[w]].store(true, std::memory_order_relaxed);
      }
    });
    return pool_tasks.total() != 0;
  }

  // Keeps each training lookup's resolution, with its plan, for the apply (inexact shards'
  // rows are checked there; see gather_shard).
  void keep_resolutions() {
    for (const size_t k : locked_) {
      const LookupSumRequest& r = requests_[k];
      if (!r.insert) continue;
      Workspace& ws = *spaces_[k];
      ws.resolution.refs_pending = false;  // gather_shard referenced its rows
      std::swap(ws.resolution.order, ws.order);  // the plan goes with it, for the apply
      std::swap(ws.resolution.shard_begin, ws.shard_begin);
      ws.resolution.planned = true;
      r.table->keep_resolution(r.keys, r.n, ws.resolution);
    }
  }

  StageClock clock_;  // first: it times the whole call
  std::vector<LookupSumRequest>& requests_;
  const size_t R_;
  const std::vector<Workspace*> spaces_;
  const size_t workers_;
  ThreadPool& pool_ = ThreadPool::global();
  std::unique_ptr<std::atomic<bool>[]> aborted_;  // per request: it takes the locked path
  std::vector<size_t> locked_;                    // the requests that do, in order
  std::unique_ptr<std::atomic<bool>[]> raced_;    // per locked request: redo its pass
  size_t rot_ = 0;                                // the locked pass's first shard
};

// One apply_gradients_many call: validate, plan (group ids by shard, reusing the training
// lookup's resolution when the call takes one), then one task per (request, shard).
class BatchRunner::ApplyBatch {
 public:
  explicit ApplyBatch(std::vector<ApplyRequest>& requests)
      : requests_(requests),
        R_(requests.size()),
        spaces_(caller_workspaces(R_)),
        workers_(workers_for(requests)) {}

  void run(Timer op) {
    validate();
    plan_all();
    update();
    clock_.record(requests_, op);
  }

 private:
  // 1. Validates everything before any table changes; reads each table's learning rate once.
  void validate() {
    validate_each(R_, workers_, [&](size_t k) {
      const ApplyRequest& r = requests_[k];
      const size_t grad_rows = r.offsets == nullptr ? r.n : r.num_bags;
      if (r.offsets != nullptr) validate_offsets(r.offsets, r.num_bags, r.n, r.label);
      validate_finite(r.grads, grad_rows * r.table->dim(), "grads", r.label);
      if (r.weights != nullptr) validate_finite(r.weights, r.n, "weights", r.label);
    });
    lrs_.resize(R_);  // one learning rate per call, even if set_lr runs meanwhile
    for (size_t k = 0; k < R_; ++k) lrs_[k] = requests_[k].table->lr();
    clock_.lap(Timer::kStageValidate);
  }

  // 2. Groups by shard; maps each id to its bag. (The gradient sums live in per-thread
  //    scratch: see apply_kernel.cpp.)
  void plan_all() {
    pool_.run(R_, workers_, [&](size_t k) {
      const ApplyRequest& r = requests_[k];
      Workspace& ws = *spaces_[k];
      const bool reuse = r.table->take_resolution(r.keys, r.n, ws.resolution);
      if (reuse && ws.resolution.planned) {  // the lookup's locked pass grouped these ids
        std::swap(ws.order, ws.resolution.order);
        std::swap(ws.shard_begin, ws.resolution.shard_begin);
        ws.resolution.planned = false;
      } else {
        plan(*r.table, r.keys, r.n, ws, reuse ? ws.resolution.places.data() : nullptr);
      }
      if (r.offsets != nullptr) {
        ws.bag_of.resize(r.n);
        for (size_t bag = 0; bag < r.num_bags; ++bag) {
          for (int64_t i = r.offsets[bag]; i < r.offsets[bag + 1]; ++i) {
            ws.bag_of[static_cast<size_t>(i)] = static_cast<uint32_t>(bag);
          }
        }
      }
    });
    clock_.lap(Timer::kStagePlan);
  }

  // 3. One task per (request, shard): sum duplicates, then one fused update per row. Every
  //    updated row gets its reference bit, which pays what a taken resolution owed; if the
  //    call fails part way, the owed bits are set here instead.
  void update() {
    TaskSpace shard_tasks;
    for (const ApplyRequest& r : requests_) shard_tasks.add(r.table->num_shards());
    const size_t rot = rotation();
    try {
      pool_.run(shard_tasks.total(), workers_, [&](size_t task) {
        const size_t k = shard_tasks.request_of(task);
        const ApplyRequest& r = requests_[k];
        const size_t s = (task - shard_tasks.begin[k] + rot) % r.table->num_shards();
        apply_shard(*r.table, s, r, lrs_[k], *spaces_[k]);
      });
    } catch (...) {
      for (size_t k = 0; k < R_; ++k) requests_[k].table->pay_references(spaces_[k]->resolution);
      throw;
    }
    clock_.lap(Timer::kStageUpdate);
  }

  StageClock clock_;  // first: it times the whole call
  std::vector<ApplyRequest>& requests_;
  const size_t R_;
  const std::vector<Workspace*> spaces_;
  const size_t workers_;
  ThreadPool& pool_ = ThreadPool::global();
  std::vector<float> lrs_;
};

// Both guard the caller's FTZ/DAZ modes (float_env.hpp); the pool's helpers clear theirs.
void lookup_sum_many(std::vector<LookupSumRequest>& requests, Timer op) {
  const detail::DenormalScope ieee;
  BatchRunner::LookupBatch(requests).run(op);
}

void apply_gradients_many(std::vector<ApplyRequest>& requests, Timer op) {
  const detail::DenormalScope ieee;
  BatchRunner::ApplyBatch(requests).run(op);
}

}  // namespace embstore
