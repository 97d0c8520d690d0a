// File: tests/cpp/test_float_env.cpp
//
// Unit tests: the core's results do not depend on the caller's x86 flush-to-zero (FTZ) and
// denormals-are-zero (DAZ) modes, which -ffast-math's crtfastmath.o sets process-wide, and
// the core leaves the caller's modes as it found them (internal/float_env.hpp).
#include <unistd.h>  // getpid

#include <filesystem>  // std::filesystem

#include "embstore/checkpoint.hpp"
#include "helpers.hpp"

#if defined(__x86_64__) || (defined(__i386__) && defined(__SSE__))
#include <xmmintrin.h>  // _mm_getcsr, _mm_setcsr

namespace {

constexpr unsigned kFtzDaz = (1u << 15) | (1u << 6);

void set_ftz_daz(bool on) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | kFtzDaz) : (csr & ~kFtzDaz));
}

// Inputs made on a thread with the modes clear (the test's own arithmetic must not flush).
struct DenormalInputs {
  Ids ids;           // the batch's ids (repeats included)
  Offsets offsets;   // bags over ids
  Floats bag_grads;  // (num_bags, dim), around 1e-39
  Floats id_grads;   // (n, dim), around 1e-39
  Ids universe;      // every id, for reading rows back
};

DenormalInputs make_inputs(size_t n, size_t dim, uint64_t seed) {
  DenormalInputs in;
  std::mt19937_64 rng(seed);
  for (uint64_t id = 1; id <= 3000; ++id) in.universe.push_back(id * 0x9E3779B97F4A7C15ULL);
  in.ids.resize(n);
  for (uint64_t& id : in.ids) id = in.universe[rng() % in.universe.size()];
  in.offsets = random_offsets(rng, n, std::max<size_t>(2, n / 3));
  std::uniform_real_distribution<double> g(-2e-39, 2e-39);  // denormal float32 values
  in.bag_grads.resize((in.offsets.size() - 1) * dim);
  for (float& x : in.bag_grads) x = static_cast<float>(g(rng));
  in.id_grads.resize(n * dim);
  for (float& x : in.id_grads) x = static_cast<float>(g(rng));
  return in;
}

// Everything a run produces: pooled outputs, rows, initial values, and whether the calling
// thread had its modes back after every call.
struct RunResult {
  Floats out;
  bool modes_kept = true;
};

// A training loop on fresh tables (rows initialised tiny), run on a new thread with the
// modes `ftz_daz`; the tables are created there, so pool helpers they start inherit them.
RunResult run_workload(bool ftz_daz, const DenormalInputs& small, const DenormalInputs& large) {
  RunResult r;
  std::thread worker([&] {
    set_ftz_daz(ftz_daz);
    const OptimizerConfig opts[] = {sgd(0.75f), adagrad(0.5f, 1e-10f, 1e-3f)};
    for (const OptimizerConfig& opt : opts) {
      const size_t dim = 4;
      Table t(config(dim, 8192, 4, Eviction::kNone, opt, uniform(-3e-38, 3e-38, 5), 8));
      auto keep = [&](const Floats& v) {
        r.out.insert(r.out.end(), v.begin(), v.end());
        if ((_mm_getcsr() & kFtzDaz) != (ftz_daz ? kFtzDaz : 0u)) r.modes_kept = false;
      };
      keep(initial(t, small.universe));
      for (const DenormalInputs* in : {&small, &large, &small}) {
        keep(lookup_sum(t, in->ids, in->offsets, nullptr, PoolMode::kMean));
        apply_pooled(t, in->ids, in->bag_grads, in->offsets, nullptr, PoolMode::kMean);
        keep({});
        apply(t, in->ids, in->id_grads);
        keep({});
      }
      keep(lookup(t, small.universe, false));
    }
  });
  worker.join();
  return r;
}

}  // namespace

TEST_CASE(denormal_results_independent_of_caller_ftz_daz) {
  // Small batches run on the caller alone; large ones (above kIdsPerWorker per helper) on
  // the pool's helpers too.
  const DenormalInputs small = make_inputs(64, 4, 1);
  const DenormalInputs large = make_inputs(12000, 4, 2);
  // The flushed run first: helpers the pool starts for it inherit the modes.
  const RunResult flushed = run_workload(true, small, large);
  const RunResult ieee = run_workload(false, small, large);
  // The test can fail: the IEEE run did make denormals.
  size_t denormals = 0;
  for (const float x : ieee.out) denormals += std::fpclassify(x) == FP_SUBNORMAL ? 1 : 0;
  CHECK_MSG(denormals > 100, std::to_string(denormals) + " denormal outputs");
  CHECK_BITS_EQ(flushed.out, ieee.out);
  CHECK(ieee.modes_kept);
  CHECK(flushed.modes_kept);
  // The modes are back after a call that throws (bad input) too.
  bool threw = false;
  unsigned after = 0;
  std::thread worker([&] {
    set_ftz_daz(true);
    Table t(config(2, 16, 1));
    try {
      apply(t, {1}, Floats{kNaN, 1.0f});
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    after = _mm_getcsr() & kFtzDaz;
  });
  worker.join();
  CHECK(threw);
  CHECK(after == kFtzDaz);
}

TEST_CASE(pool_helpers_clear_ftz_daz) {
  // A pool created by a thread with the modes set: its helpers start with them (threads
  // inherit MXCSR) and must clear them; the caller's own modes are left alone.
  constexpr size_t kTasks = 4;
  unsigned seen[kTasks] = {};
  bool on_caller[kTasks] = {};
  std::thread creator([&] {
    set_ftz_daz(true);
    ThreadPool pool(kTasks - 1, 0);
    const std::thread::id caller = std::this_thread::get_id();
    std::atomic<size_t> started{0};
    pool.run(kTasks, kTasks, [&](size_t task) {
      seen[task] = _mm_getcsr() & kFtzDaz;
      on_caller[task] = std::this_thread::get_id() == caller;
      // Bounded wait for every task to start, so each runs on its own thread.
      started.fetch_add(1);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (started.load() < kTasks && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
    });
  });
  creator.join();
  size_t on_helpers = 0;
  for (size_t k = 0; k < kTasks; ++k) {
    if (on_caller[k]) {
      CHECK(seen[k] == kFtzDaz);
    } else {
      CHECK_MSG(seen[k] == 0, "task " + std::to_string(k));
      ++on_helpers;
    }
  }
  CHECK(on_helpers > 0);
}

TEST_CASE(denormal_settings_survive_ftz_daz) {
  // Denormal settings: DAZ would take the lr for 0 in set_lr's check and in the saved
  // header (std::to_chars); FTZ would flush the header's doubles when a load narrows them.
  const float lr = 1e-39f, eps = 2e-40f, acc0 = 3e-39f;
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("embstore_ftz_" + std::to_string(getpid()) + ".ckpt"))
                               .string();
  bool lr_ok = false;
  float got[3] = {};
  std::string error;
  std::thread worker([&] {
    set_ftz_daz(true);
    try {
      Table t(config(2, 16, 1, Eviction::kClock, adagrad(0.5f, eps, acc0), zeros()));
      t.set_lr(lr);
      lr_ok = true;
      embstore::save(t, path);
      const LoadedTable loaded = embstore::load(path);
      got[0] = loaded.table->lr();
      got[1] = loaded.table->config().optimizer.eps;
      got[2] = loaded.table->config().optimizer.initial_accumulator;
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  worker.join();
  std::filesystem::remove(path);
  CHECK_MSG(lr_ok && error.empty(), error);
  CHECK_BITS_EQ(Floats(got, got + 3), (Floats{lr, eps, acc0}));
}

#endif  // x86
