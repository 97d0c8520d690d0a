// File: embstore/internal/fork_guard.hpp
//
// Fork safety: fork() copies memory, not threads. A worker holding a shard lock (maybe in
// the middle of an update) at that moment would leave the child with a locked, half-written
// shard. So the process quiesces every table around fork(): `prepare` takes every shard lock
// of every live table, in registry then shard order, and both sides release them after.
// Workers hold one shard lock at a time and never wait for another while holding it, so the
// ordered acquisition cannot deadlock. The thread pool handles its own lock (thread_pool.cpp).
#pragma once

namespace embstore {

class Table;

// The registry of live tables and the pthread_atfork handlers over it; a friend of Table.
struct ForkGuard {
  static void add(Table* t);     // registers t (installs the handlers on first use)
  static void remove(Table* t);  // before t is destroyed

 private:
  static void prepare();
  static void release();
  static void release_child();
};

}  // namespace embstore
