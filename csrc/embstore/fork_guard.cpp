// File: fork_guard.cpp
//
// ForkGuard (internal/fork_guard.hpp): every shard lock of every live table is held across
// fork(), so no child starts with a shard a worker was changing.
#include "embstore/internal/fork_guard.hpp"

#include <pthread.h>  // pthread_atfork

#include <algorithm>  // std::remove
#include <mutex>      // std::mutex, std::lock_guard
#include <vector>     // std::vector

#include "embstore/table.hpp"  // Table

namespace embstore {
namespace {

std::mutex& registry_mutex() {
  static std::mutex* m = new std::mutex();  // leaked: used by fork handlers until exit
  return *m;
}

std::vector<Table*>& registry() {
  static std::vector<Table*>* tables = new std::vector<Table*>();
  return *tables;
}

}  // namespace

void ForkGuard::add(Table* t) {
  static const bool installed = [] {
    pthread_atfork(&ForkGuard::prepare, &ForkGuard::release, &ForkGuard::release_child);
    return true;
  }();
  (void)installed;
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().push_back(t);
}

void ForkGuard::remove(Table* t) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& r = registry();
  r.erase(std::remove(r.begin(), r.end(), t), r.end());
}

// A table's snapshot and resolution mutexes are only ever held briefly and never while
// waiting for another lock, so taking them first keeps the order deadlock-free.
void ForkGuard::prepare() {
  registry_mutex().lock();
  for (Table* t : registry()) {
    t->snapshot_mutex_.lock();
    t->resolution_mutex_.lock();
    for (auto& sh : t->shards_) sh->mutex().lock();
  }
}

void ForkGuard::release() {
  for (Table* t : registry()) {
    for (auto& sh : t->shards_) sh->mutex().unlock();
    t->resolution_mutex_.unlock();
    t->snapshot_mutex_.unlock();
  }
  registry_mutex().unlock();
}

// The child has only the forking thread: a snapshot another thread was writing will never
// finish there, so the child forgets it (the parent's goes on untouched).
void ForkGuard::release_child() {
  for (Table* t : registry()) t->reset_snapshot_after_fork();
  release();
}

}  // namespace embstore
