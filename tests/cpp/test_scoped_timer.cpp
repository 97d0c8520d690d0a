// Named layer timers (embstore/scoped_timer.hpp): one histogram per name, ScopedTimer
// records into it, bad names throw, snapshot_all lists by name, reset_all clears, and
// recording from many threads loses nothing; a table's TimerSet allocates on first record.
#include <cstdio>     // std::printf, std::fprintf
#include <cstdlib>    // std::exit
#include <stdexcept>  // std::invalid_argument
#include <string>     // std::string
#include <thread>     // std::thread
#include <vector>     // std::vector

#include "embstore/metrics.hpp"       // TimerSet
#include "embstore/scoped_timer.hpp"

namespace m = embstore::metrics;

// Checked in every build type (assert would vanish under NDEBUG in Release).
#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

static uint64_t count(const embstore::LatencyHistogram& h) {
  return embstore::LatencyHistogram::summarize({}, h.snapshot()).count;
}

int main() {
  embstore::set_metrics_enabled(true);
  embstore::LatencyHistogram& a = m::histogram("test.A.Total");
  CHECK(&a == &m::histogram("test.A.Total"));  // one histogram per name
  {
    m::ScopedTimer t(a);
  }
  {
    m::ScopedTimer t(std::string("test.A.Total"));
  }
  CHECK(count(a) == 2);

  for (const char* bad : {"", "nodot", ".x", "layer."}) {
    bool threw = false;
    try {
      m::histogram(bad);
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    CHECK(threw);
  }

  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([] {
      embstore::LatencyHistogram& h = m::histogram("test.Threads.Total");
      for (int i = 0; i < 1000; ++i) m::ScopedTimer t(h);
    });
  }
  for (auto& t : threads) t.join();
  CHECK(count(m::histogram("test.Threads.Total")) == 4000);

  const auto all = m::snapshot_all();
  CHECK(all.size() == 2 && all[0].first == "test.A.Total" && all[1].first == "test.Threads.Total");

  embstore::set_metrics_enabled(false);
  {
    m::ScopedTimer t(a);
  }
  CHECK(count(a) == 2);  // off: nothing recorded
  embstore::set_metrics_enabled(true);
  m::reset_all();
  CHECK(count(a) == 0 && count(m::histogram("test.Threads.Total")) == 0);

  // A table's TimerSet: histograms appear on first record, racing first records all count.
  for (int round = 0; round < 20; ++round) {
    embstore::TimerSet set;
    CHECK(count(set[2]) == 0 && set[2].snapshot().resets == 0);  // never recorded: empty
    set.reset();  // nothing allocated yet: still fine
    std::vector<std::thread> racers;
    for (int k = 0; k < 4; ++k) {
      racers.emplace_back([&set] {
        for (int i = 0; i < 100; ++i) set.get(2)->record(1000);
      });
    }
    for (auto& t : racers) t.join();
    CHECK(count(set[2]) == 400 && count(set[3]) == 0);
    CHECK(set.get(2) == &set[2]);  // one histogram per slot
    set.reset();
    CHECK(count(set[2]) == 0 && set[2].snapshot().resets == 1);
  }
  std::printf("test_scoped_timer: ok\n");
  return 0;
}
