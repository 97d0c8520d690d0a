#include "embstore/thread_pool.hpp"

#include <chrono>  // std::chrono::steady_clock

#include <algorithm>  // std::find, std::max, std::min
#include <cstdlib>    // std::getenv, std::strtoul
#include <new>        // placement new

#include <pthread.h>  // pthread_atfork

#include "embstore/internal/float_env.hpp"  // clear_denormal_modes

namespace embstore {

struct ThreadPool::Job {
  const std::function<void(size_t)>* body;
  size_t num_tasks;
  size_t helpers_wanted;
  std::atomic<size_t> next_task{0};
  // Guarded by the pool mutex:
  size_t helpers_joined = 0;
  // Helpers working on the job: changed under the pool mutex, polled without it by a
  // spinning caller.
  std::atomic<size_t> helpers_active{0};
  std::condition_variable helpers_done;
  // First exception of a task, guarded by error_mutex.
  std::mutex error_mutex;
  std::exception_ptr error;
};

namespace {
ThreadPool* g_global_pool = nullptr;

// A spin-wait hint: lets the sibling hyperthread run and saves power while polling.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls ready() for up to `us` microseconds; true as soon as it holds.
template <typename Ready>
bool spin_until(uint32_t us, const Ready& ready) noexcept {
  if (us == 0) return false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (;;) {
    for (int k = 0; k < 64; ++k) {  // the clock is read once per 64 polls
      if (ready()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return ready();
  }
}
}  // namespace

uint32_t ThreadPool::spin_us_from_env() noexcept {
  const char* env = std::getenv("EMBSTORE_SPIN_US");
  if (env == nullptr || *env < '0' || *env > '9') return kDefaultSpinUs;
  char* end = nullptr;
  const unsigned long us = std::strtoul(env, &end, 10);
  if (*end != '\0') return kDefaultSpinUs;
  return us < kMaxSpinUs ? static_cast<uint32_t>(us) : kMaxSpinUs;
}

ThreadPool& ThreadPool::global() {
  // Leaked on purpose: helpers must outlive every static Table destroyed at exit.
  static ThreadPool* pool = [] {
    g_global_pool = new ThreadPool(0, spin_us_from_env());
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
  queued_.store(0, std::memory_order_relaxed);
  sleepers_ = 0;
  callers_inside_.store(0, std::memory_order_relaxed);
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

ThreadPool::ThreadPool(size_t helpers, uint32_t spin_us) {
  set_spin_us(spin_us);
  ensure_helpers(helpers);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_.store(true, std::memory_order_relaxed);
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
  // A new thread inherits its creator's MXCSR: drop FTZ/DAZ (float_env.hpp) once, here.
  detail::clear_denormal_modes();
  std::unique_lock<std::mutex> lock(mutex_);
  uint64_t seen = prewakes_;
  for (;;) {
    if (queue_.empty() && !stopping_ && callers_inside_.load(std::memory_order_relaxed) <= 1) {
      lock.unlock();
      spin_until(spin_us(), [this] {
        return queued_.load(std::memory_order_relaxed) != 0 ||
               stopping_.load(std::memory_order_relaxed);
      });
      lock.lock();
    }
    ++sleepers_;
    work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || prewakes_ != seen; });
    --sleepers_;
    seen = prewakes_;
    if (stopping_) return;
    if (queue_.empty()) continue;  // woken ahead of a job: poll for it
    Job* job = queue_.front();
    job->helpers_active.fetch_add(1, std::memory_order_relaxed);
    if (++job->helpers_joined >= job->helpers_wanted) {
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_relaxed);
    }
    lock.unlock();
    work_on(*job);
    lock.lock();
    // Notified under the lock: the caller cannot destroy the job before we release it (a
    // caller that saw the count reach 0 while spinning takes the lock before returning).
    if (job->helpers_active.fetch_sub(1, std::memory_order_relaxed) == 1) {
      job->helpers_done.notify_all();
    }
  }
}

void ThreadPool::prewake() {
  if (spin_us() == 0 || callers_inside_.load(std::memory_order_relaxed) != 0) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (sleepers_ == 0) return;
    ++prewakes_;
  }
  work_cv_.notify_all();
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
  struct Inside {  // counts this caller in callers_inside_ until run() returns
    std::atomic<int>& n;
    explicit Inside(std::atomic<int>& c) : n(c) { n.fetch_add(1, std::memory_order_relaxed); }
    ~Inside() { n.fetch_sub(1, std::memory_order_relaxed); }
    Inside(const Inside&) = delete;
    Inside& operator=(const Inside&) = delete;
  } inside(callers_inside_);
  Job job;
  job.body = &body;
  job.num_tasks = num_tasks;
  job.helpers_wanted = helpers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(&job);
    queued_.fetch_add(1, std::memory_order_relaxed);
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
    if (it != queue_.end()) {  // no helper may join from now on
      queue_.erase(it);
      queued_.fetch_sub(1, std::memory_order_relaxed);
    }
    const auto done = [&job] { return job.helpers_active.load(std::memory_order_relaxed) == 0; };
    if (!done() && callers_inside_.load(std::memory_order_relaxed) == 1) {
      lock.unlock();
      spin_until(spin_us(), done);
      lock.lock();  // waits for a helper still inside its notify (see helper_loop)
    }
    job.helpers_done.wait(lock, done);
  }
  if (wait_sink != nullptr) {
    *wait_sink += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::steady_clock::now() - finished)
                                            .count());
  }
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace embstore
