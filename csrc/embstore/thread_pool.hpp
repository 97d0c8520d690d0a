// File: embstore/thread_pool.hpp
//
// ThreadPool: persistent worker threads that split batches into tasks. The calling thread
// always works on its own job too, so a job finishes even when every helper is busy with
// other callers' jobs (many request threads may call at once); helpers sleep on a condition
// variable when idle, so an idle pool costs no CPU.
//
// Short waits spin first. A batch call runs several jobs back to back (a lookup's read pass
// and its finish; an apply's plan and its update) and a trainer calls again within
// microseconds, so a helper that finishes a job polls for the next one for up to spin_us()
// before it sleeps, and a caller that runs out of tasks polls for its helpers to finish
// before it sleeps: waking a sleeping thread costs tens of microseconds. Only while at most
// one caller is in the pool: with more, the CPU a spinning thread would hold belongs to
// another caller's work.
//
// A task's exception stops the job's remaining tasks and is rethrown on the caller once every
// helper has left the job (hnswlib's ParallelFor discipline). Thread-safe.
//
// Fork-safe (the global pool): a forked child (e.g. a PyTorch DataLoader worker) has only the
// forking thread, so the child forgets the parent's helpers and queued jobs and starts new
// helpers on its first batch; the pool lock is held across fork() so the queue is never
// copied mid-update.
#pragma once

#include <atomic>              // std::atomic
#include <condition_variable>  // std::condition_variable
#include <cstddef>             // size_t
#include <cstdint>             // uint64_t
#include <deque>               // std::deque
#include <exception>           // std::exception_ptr
#include <functional>          // std::function
#include <mutex>               // std::mutex
#include <thread>              // std::thread
#include <vector>              // std::vector

namespace embstore {

class ThreadPool {
 public:
  // The process-wide pool shared by all tables (grown on demand, never shrunk).
  static ThreadPool& global();

  // How long a waiting thread polls before it sleeps, unless the EMBSTORE_SPIN_US environment
  // variable (read once, by the global pool) says otherwise; 0 disables spinning.
  static constexpr uint32_t kDefaultSpinUs = 200;
  static constexpr uint32_t kMaxSpinUs = 100000;

  explicit ThreadPool(size_t helpers = 0, uint32_t spin_us = kDefaultSpinUs);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Makes sure at least `helpers` helper threads exist.
  void ensure_helpers(size_t helpers);

  // Runs body(task) for every task in [0, num_tasks) on the caller and at most
  // `max_workers - 1` helpers; returns when all are done. Rethrows a task's exception.
  void run(size_t num_tasks, size_t max_workers, const std::function<void(size_t)>& body);

  // A job is coming (the caller is about to validate its input): wakes the sleeping helpers
  // so that they are already polling when run() queues it. No-op with spinning off, while
  // another caller is in the pool, or when no helper sleeps.
  void prewake();

  // Microseconds a waiting helper or caller polls before it sleeps (see above; 0: never).
  uint32_t spin_us() const noexcept { return spin_us_.load(std::memory_order_relaxed); }
  void set_spin_us(uint32_t us) noexcept {
    spin_us_.store(us < kMaxSpinUs ? us : kMaxSpinUs, std::memory_order_relaxed);
  }
  // EMBSTORE_SPIN_US as microseconds: a decimal number, capped at kMaxSpinUs; anything
  // else (or unset) gives kDefaultSpinUs.
  static uint32_t spin_us_from_env() noexcept;

  // While set (per calling thread), run() adds to *ns the time the caller spent waiting
  // for helpers after it ran out of tasks (load imbalance). nullptr: nothing is timed.
  static void set_wait_sink(uint64_t* ns) noexcept;

  // The machine's hardware threads (at least 1).
  static size_t hardware_threads() noexcept;

 private:
  struct Job;
  void helper_loop();
  static void work_on(Job& job) noexcept;
  void spawn_missing_helpers_locked();
  void forget_parent_threads_in_child() noexcept;
  static void install_fork_handlers();

  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::deque<Job*> queue_;  // jobs still accepting helpers
  std::atomic<size_t> queued_{0};       // queue_.size(), for spinning helpers to poll
  std::atomic<int> callers_inside_{0};  // threads inside run(): spinning is for one caller
  std::atomic<uint32_t> spin_us_;
  size_t sleepers_ = 0;   // helpers waiting on work_cv_
  uint64_t prewakes_ = 0;  // bumped by prewake()
  std::vector<std::thread> threads_;
  size_t wanted_helpers_ = 0;  // what ensure_helpers asked for (re-spawned after fork)
  std::atomic<bool> stopping_{false};  // set under mutex_; polled by spinning helpers
};

}  // namespace embstore
