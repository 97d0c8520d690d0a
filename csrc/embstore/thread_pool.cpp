#include "embstore/thread_pool.hpp"

#include <chrono>  // std::chrono::steady_clock

#include <algorithm>  // std::find, std::max, std::min
#include <new>        // placement new

#include <pthread.h>  // pthread_atfork

namespace embstore {

struct ThreadPool::Job {
  const std::function<void(size_t)>* body;
  size_t num_tasks;
  size_t helpers_wanted;
  std::atomic<size_t> next_task{0};
  // Guarded by the pool mutex:
  size_t helpers_joined = 0;
  size_t helpers_active = 0;
  std::condition_variable helpers_done;
  // First exception of a task, guarded by error_mutex.
  std::mutex error_mutex;
  std::exception_ptr error;
};

namespace {
ThreadPool* g_global_pool = nullptr;
}  // namespace

ThreadPool& ThreadPool::global() {
  // Leaked on purpose: helpers must outlive every static Table destroyed at exit.
  static ThreadPool* pool = [] {
    g_global_pool = new ThreadPool(0);
    install_fork_handlers();
    return g_global_pool;
  }();
  return *pool;
}

void ThreadPool::install_fork_handlers() {
  pthread_atfork([] { g_global_pool->mutex_.lock(); },    // queue quiescent across fork()
                 [] { g_global_pool->mutex_.unlock(); },  // parent: carry on
                 [] { g_global_pool->forget_parent_threads_in_child(); });
}

void ThreadPool::forget_parent_threads_in_child() noexcept {
  // Only the forking thread exists here. The helpers' std::thread handles must not be
  // joined or destroyed (that would terminate): leak them. Jobs queued by other parent
  // threads have no caller here. The lock taken before fork() and the condition variable
  // (whose waiters are gone) are replaced by fresh ones.
  new std::vector<std::thread>(std::move(threads_));
  threads_.clear();
  queue_.clear();
  new (&mutex_) std::mutex();
  new (&work_cv_) std::condition_variable();
}

void ThreadPool::spawn_missing_helpers_locked() {
  while (threads_.size() < wanted_helpers_) threads_.emplace_back([this] { helper_loop(); });
}

size_t ThreadPool::hardware_threads() noexcept {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : n;
}

ThreadPool::ThreadPool(size_t helpers) { ensure_helpers(helpers); }

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::ensure_helpers(size_t helpers) {
  std::lock_guard<std::mutex> lock(mutex_);
  wanted_helpers_ = std::max(wanted_helpers_, helpers);
  spawn_missing_helpers_locked();
}

void ThreadPool::work_on(Job& job) noexcept {
  for (;;) {
    const size_t task = job.next_task.fetch_add(1, std::memory_order_relaxed);
    if (task >= job.num_tasks) return;
    try {
      (*job.body)(task);
    } catch (...) {
      std::lock_guard<std::mutex> lock(job.error_mutex);
      if (!job.error) job.error = std::current_exception();
      job.next_task.store(job.num_tasks, std::memory_order_relaxed);  // skip the rest
    }
  }
}

void ThreadPool::helper_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    Job* job = queue_.front();
    ++job->helpers_active;
    if (++job->helpers_joined >= job->helpers_wanted) queue_.pop_front();
    lock.unlock();
    work_on(*job);
    lock.lock();
    // Notified under the lock: the caller cannot destroy the job before we release it.
    if (--job->helpers_active == 0) job->helpers_done.notify_all();
  }
}

namespace {
thread_local uint64_t* wait_sink = nullptr;
}  // namespace

void ThreadPool::set_wait_sink(uint64_t* ns) noexcept { wait_sink = ns; }

void ThreadPool::run(size_t num_tasks, size_t max_workers,
                     const std::function<void(size_t)>& body) {
  if (num_tasks == 0) return;
  size_t helpers = std::min(max_workers == 0 ? 0 : max_workers - 1, num_tasks - 1);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    spawn_missing_helpers_locked();  // after a fork the child starts with none
    helpers = std::min(helpers, threads_.size());
  }
  if (helpers == 0) {
    for (size_t task = 0; task < num_tasks; ++task) body(task);
    return;
  }
  Job job;
  job.body = &body;
  job.num_tasks = num_tasks;
  job.helpers_wanted = helpers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(&job);
  }
  if (helpers == 1) {
    work_cv_.notify_one();
  } else {
    work_cv_.notify_all();
  }
  work_on(job);
  const auto finished = wait_sink != nullptr ? std::chrono::steady_clock::now()
                                             : std::chrono::steady_clock::time_point{};
  {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = std::find(queue_.begin(), queue_.end(), &job);
    if (it != queue_.end()) queue_.erase(it);  // no helper may join from now on
    job.helpers_done.wait(lock, [&job] { return job.helpers_active == 0; });
  }
  if (wait_sink != nullptr) {
    *wait_sink += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::steady_clock::now() - finished)
                                            .count());
  }
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace embstore
