// File: tests/cpp/test_checkpoint.cpp
//
// Checkpoints written and read by the core (embstore/checkpoint.hpp): round trip bit for
// bit, delta chains, reshard to other shard counts and capacities, keep_recent, filtered
// (keep_id) loads, groups, every kind of bad file, and a save while 4 threads keep calling
// lookup_sum and apply_gradients (the file must be the table at one instant).
//
// Its own small executable with a minimal harness (test_core's is private to that file):
//   test_checkpoint [NAME-SUBSTRING ...]      exit status 0 when every selected case passes.
// Files go to a fresh directory under $TMPDIR (removed at the end).

#include <algorithm>   // std::count_if
#include <atomic>      // std::atomic
#include <cstdio>      // std::printf, std::fprintf
#include <cstdlib>     // setenv, unsetenv
#include <cstring>     // std::strstr, std::memcpy
#include <exception>   // std::exception
#include <filesystem>  // std::filesystem
#include <fstream>     // std::ifstream, std::ofstream
#include <map>         // std::map
#include <random>      // std::mt19937_64
#include <string>      // std::string
#include <system_error>  // std::system_error
#include <thread>      // std::thread
#include <vector>      // std::vector

#include "embstore/checkpoint.hpp"
#include "embstore/errors.hpp"
#include "embstore/internal/crc32.hpp"
#include "embstore/snapshot.hpp"
#include "embstore/table.hpp"

namespace {

namespace fs = std::filesystem;
using embstore::LoadOptions;
using embstore::PoolMode;
using embstore::Table;
using embstore::TableConfig;

// ---- harness ---------------------------------------------------------------------------
struct CheckFailure {};
struct Case {
  const char* name;
  void (*fn)();
};
std::vector<Case>& cases() {
  static std::vector<Case> c;
  return c;
}
struct Register {
  Register(const char* name, void (*fn)()) { cases().push_back({name, fn}); }
};
[[noreturn]] void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  throw CheckFailure{};
}
#define CHECK(cond)                               \
  do {                                            \
    if (!(cond)) fail(__FILE__, __LINE__, #cond); \
  } while (0)
// Expects stmt to throw `type` whose message contains `text`.
#define CHECK_THROWS(type, text, stmt)                                                             \
  do {                                                                                             \
    bool caught_ = false;                                                                          \
    try {                                                                                          \
      stmt;                                                                                        \
    } catch (const type& e_) {                                                                     \
      caught_ = true;                                                                              \
      if (!std::strstr(e_.what(), text)) {                                                         \
        fail(__FILE__, __LINE__, std::string("message '") + e_.what() + "' lacks '" + text + "'"); \
      }                                                                                            \
    }                                                                                              \
    if (!caught_) fail(__FILE__, __LINE__, std::string(#stmt) + " did not throw " #type);          \
  } while (0)
#define TEST_CASE(name)                         \
  void name();                                  \
  const Register register_##name(#name, &name); \
  void name()

fs::path& workdir() {
  static fs::path dir;
  return dir;
}
std::string file(const std::string& name) { return (workdir() / name).string(); }

// ---- tables and their contents --------------------------------------------------------
TableConfig config(size_t capacity, size_t shards, embstore::OptimizerKind opt) {
  TableConfig c;
  c.dim = 8;
  c.capacity = capacity;
  c.num_shards = shards;
  c.num_threads = 2;
  c.optimizer.kind = opt;
  c.optimizer.lr = 0.05f;
  c.optimizer.momentum = 0.5f;
  c.initializer.kind = embstore::InitializerKind::kNormal;
  c.initializer.b = 0.1;
  c.initializer.seed = 7;
  return c;
}

struct Row {
  std::vector<float> values;  // weights and optimizer state, compared bit for bit
  uint32_t step = 0;
  bool operator==(const Row& o) const {
    return step == o.step && values.size() == o.values.size() &&
           std::memcmp(values.data(), o.values.data(), values.size() * 4) == 0;
  }
};
using Rows = std::map<uint64_t, Row>;

Rows dump(Table& t) {  // every row, as an export (a point-in-time snapshot)
  embstore::Snapshot snap(t, embstore::SnapshotMode::kExport);
  const size_t w = snap.row_width(), cap = 1024;
  std::vector<uint64_t> ids(cap);
  std::vector<float> rows(cap * w);
  std::vector<uint32_t> steps(cap);
  Rows out;
  for (size_t s = 0; s < snap.num_shards(); ++s) {
    while (!snap.done(s)) {
      const size_t n = snap.next(s, ids.data(), rows.data(), steps.data(), cap);
      for (size_t i = 0; i < n; ++i) {
        out[ids[i]] = Row{{rows.begin() + i * w, rows.begin() + (i + 1) * w}, steps[i]};
      }
    }
  }
  snap.commit();
  return out;
}

// One training step on `t` in two calls: a pooled lookup (inserting) of random bags, then
// its backward. `half` 0 runs the lookup only, 1 the apply only (of the same batch: the
// caller repeats the rng state), 2 both.
void train(Table& t, std::mt19937_64& rng, const std::vector<uint64_t>& universe, size_t n,
           int half = 2) {
  std::vector<uint64_t> keys(n);
  for (auto& k : keys) k = universe[rng() % universe.size()];
  const size_t bags = 4;
  std::vector<int64_t> off{0, int64_t(n / 4), int64_t(n / 2), int64_t(3 * n / 4), int64_t(n)};
  std::vector<float> out(bags * t.dim()), grads(bags * t.dim());
  if (half != 1) {
    t.lookup_sum(keys.data(), n, off.data(), bags, nullptr, PoolMode::kSum, true, out.data());
  }
  if (half == 0) return;
  for (size_t j = 0; j < grads.size(); ++j) grads[j] = 0.001f * float(j % 5) - 0.002f;
  t.apply_gradients(keys.data(), n, grads.data(), off.data(), bags, nullptr, PoolMode::kSum);
}

std::vector<uint64_t> random_ids(std::mt19937_64& rng, size_t n) {
  std::vector<uint64_t> ids(n);
  for (auto& id : ids) id = rng();
  return ids;
}

std::unique_ptr<Table> trained(size_t capacity, size_t shards, std::mt19937_64& rng,
                               const std::vector<uint64_t>& universe,
                               embstore::OptimizerKind opt = embstore::OptimizerKind::kAdam) {
  auto t = std::make_unique<Table>(config(capacity, shards, opt));
  for (int k = 0; k < 20; ++k) {
    t->set_step(static_cast<uint64_t>(k + 1));
    train(*t, rng, universe, 64);
  }
  return t;
}

std::vector<char> read_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& p, const std::vector<char>& b) {
  std::ofstream(p, std::ios::binary).write(b.data(), static_cast<std::streamsize>(b.size()));
}

// ---- cases -----------------------------------------------------------------------------
TEST_CASE(crc32_matches_zlib) {
  // zlib.crc32 values (Python): b"" -> 0, b"123456789" -> 0xCBF43926, and continuation.
  CHECK(embstore::internal::crc32("", 0) == 0);
  CHECK(embstore::internal::crc32("123456789", 9) == 0xCBF43926u);
  std::string long_text(1000, 'x');
  for (size_t k = 0; k < long_text.size(); ++k) long_text[k] = char(k * 31 + 7);
  const uint32_t whole = embstore::internal::crc32(long_text.data(), long_text.size());
  const uint32_t a = embstore::internal::crc32(long_text.data(), 333);
  CHECK(embstore::internal::crc32(long_text.data() + 333, 667, a) == whole);
  // The PCLMUL path equals the tables for every length, alignment and running crc.
  std::mt19937_64 rng(1);
  std::vector<unsigned char> b(3000);
  for (auto& x : b) x = static_cast<unsigned char>(rng());
  for (size_t off = 0; off < 17; ++off) {
    for (size_t n = 0; n + off <= b.size(); n += (n < 300 ? 1 : 37)) {
      const auto seed = static_cast<uint32_t>(rng());
      CHECK(embstore::internal::crc32(b.data() + off, n, seed) ==
            embstore::internal::crc32_portable(b.data() + off, n, seed));
    }
  }
}

TEST_CASE(round_trip_bit_exact_every_optimizer) {
  using K = embstore::OptimizerKind;
  for (K opt : {K::kSgd, K::kAdagrad, K::kRowWiseAdagrad, K::kAdam, K::kFtrl}) {
    std::mt19937_64 rng(1 + int(opt));
    const auto universe = random_ids(rng, 3000);
    auto t = trained(4096, 4, rng, universe, opt);
    const std::string id = embstore::save(*t, file("rt.ckpt"), {std::string("user"), 2});
    CHECK(id.size() == 32 && t->checkpoint_id() == id);
    auto loaded = embstore::load(file("rt.ckpt"));
    CHECK(dump(*loaded.table) == dump(*t));
    CHECK(loaded.table->num_shards() == 4 && loaded.table->capacity() == 4096);
    CHECK(loaded.table->step() == t->step() && loaded.table->step_tracking());
    CHECK(loaded.label.name == std::string("user") && loaded.label.num_threads == size_t(2));
    CHECK(loaded.checkpoint_id == id && loaded.table->checkpoint_id() == id);
    CHECK(loaded.table->lr() == t->lr());
    // The loaded table trains on exactly as the original does.
    std::mt19937_64 a(99), b(99);
    train(*t, a, universe, 64);
    train(*loaded.table, b, universe, 64);
    CHECK(dump(*loaded.table) == dump(*t));
  }
}

TEST_CASE(delta_chain_and_its_errors) {
  std::mt19937_64 rng(3);
  const auto universe = random_ids(rng, 2000);
  auto t = trained(8192, 8, rng, universe);
  CHECK_THROWS(embstore::CheckpointError, "needs a previous checkpoint",
               embstore::save_delta(*t, file("d0.ckpt")));
  embstore::save(*t, file("base.ckpt"));
  std::vector<std::string> deltas;
  for (int k = 0; k < 3; ++k) {
    t->set_step(100 + k);
    train(*t, rng, universe, 64);
    std::vector<uint64_t> gone(universe.begin() + 10 * k, universe.begin() + 10 * k + 5);
    t->erase(gone.data(), gone.size());
    const auto fresh = random_ids(rng, 50);  // rows born after the base
    train(*t, rng, fresh, 32);
    deltas.push_back(file("d" + std::to_string(k) + ".ckpt"));
    embstore::save_delta(*t, deltas.back());
  }
  auto loaded = embstore::load(file("base.ckpt"), deltas);
  CHECK(dump(*loaded.table) == dump(*t));
  CHECK(loaded.checkpoint_id == t->checkpoint_id());
  // The loaded table continues the chain.
  train(*loaded.table, rng, universe, 64);
  embstore::save_delta(*loaded.table, file("d3.ckpt"));
  deltas.push_back(file("d3.ckpt"));
  auto again = embstore::load(file("base.ckpt"), deltas);
  CHECK(dump(*again.table) == dump(*loaded.table));
  CHECK_THROWS(embstore::CheckpointError, "the chain does not fit",
               embstore::load(file("base.ckpt"), {deltas[1], deltas[0]}));
  CHECK_THROWS(embstore::CheckpointError, "a delta checkpoint, not a full one",
               embstore::load(deltas[0]));
  CHECK_THROWS(embstore::CheckpointError, "not a delta",
               embstore::load(file("base.ckpt"), {file("base.ckpt")}));
}

TEST_CASE(reshard_capacity_and_keep_recent) {
  std::mt19937_64 rng(4);
  const auto universe = random_ids(rng, 3000);
  auto t = trained(4096, 8, rng, universe);
  embstore::save(*t, file("r.ckpt"));
  const Rows want = dump(*t);
  for (size_t shards : {1, 2, 16}) {
    LoadOptions o;
    o.num_shards = shards;
    o.capacity = 8192;
    auto l = embstore::load(file("r.ckpt"), {}, o);
    CHECK(l.table->num_shards() == shards && l.table->capacity() == 8192);
    CHECK(dump(*l.table) == want);
  }
  LoadOptions small;
  small.capacity = want.size() / 2;
  CHECK_THROWS(embstore::CapacityError, "more than capacity",
               embstore::load(file("r.ckpt"), {}, small));
  small.keep_recent = true;
  small.num_shards = 1;  // no shard imbalance: exactly capacity rows
  auto l = embstore::load(file("r.ckpt"), {}, small);
  const Rows got = dump(*l.table);
  CHECK(got.size() == *small.capacity);
  uint32_t min_kept = ~0u, max_left = 0;
  for (const auto& [id, row] : want) {
    const auto it = got.find(id);
    if (it == got.end()) {
      max_left = std::max(max_left, row.step);
    } else {
      CHECK(it->second == row);
      min_kept = std::min(min_kept, row.step);
    }
  }
  CHECK(min_kept >= max_left);  // the most recent rows are the ones kept
  CHECK(l.checkpoint_id.empty() && l.dropped > 0);
  CHECK_THROWS(embstore::CheckpointError, "needs a previous checkpoint",
               embstore::save_delta(*l.table, file("x.ckpt")));
}

TEST_CASE(keep_id_splits_rows_by_route) {
  std::mt19937_64 rng(5);
  const auto universe = random_ids(rng, 3000);
  auto t = trained(4096, 4, rng, universe);
  embstore::save(*t, file("f.ckpt"));
  t->set_step(500);
  train(*t, rng, universe, 64);
  embstore::save_delta(*t, file("f1.ckpt"));
  const Rows want = dump(*t);
  for (bool chain : {false, true}) {
    const Rows base = chain ? want : dump(*embstore::load(file("f.ckpt")).table);
    Rows united;
    for (uint32_t k = 0; k < 3; ++k) {
      LoadOptions o;
      o.keep_id = embstore::keep_route(0x1234, 3, k);
      o.num_shards = 2;
      auto part = chain ? embstore::load(file("f.ckpt"), {file("f1.ckpt")}, o)
                        : embstore::load(file("f.ckpt"), {}, o);
      CHECK(part.checkpoint_id.empty());
      for (const auto& [id, row] : dump(*part.table)) {
        CHECK(embstore::route_of(id, 0x1234, 3) == k);
        united[id] = row;
      }
    }
    CHECK(united == base);
  }
  // Capacity is checked after filtering: a third of the rows fit a third of the capacity.
  LoadOptions o;
  o.keep_id = [](uint64_t id) { return id % 2 == 0; };
  o.capacity = want.size() / 2 + 600;
  auto half = embstore::load(file("f.ckpt"), {file("f1.ckpt")}, o);
  size_t even = 0;
  for (const auto& [id, row] : want) even += id % 2 == 0;
  CHECK(half.table->size() == even);
}

TEST_CASE(group_round_trip) {
  std::mt19937_64 rng(6);
  const auto universe = random_ids(rng, 1000);
  auto a = trained(2048, 2, rng, universe);
  auto b = trained(1024, 4, rng, universe, embstore::OptimizerKind::kAdagrad);
  const std::string dir = file("group");
  embstore::save_group({{"user", a.get()}, {"item", b.get()}}, dir);
  std::ofstream(dir + "/.t000-x.ckpt.0123456789ab.tmp") << "stray";  // a crashed save's
  std::ofstream(dir + "/notes.txt") << "kept";                         // not ours
  embstore::save_group({{"user", a.get()}, {"item", b.get()}}, dir);  // replaces the first
  size_t files = 0, others = 0;
  for (const auto& f : fs::directory_iterator(dir)) {
    files += f.path().extension() == ".ckpt";
    others += f.path().extension() != ".ckpt";
  }
  CHECK(files == 2 && others == 2);  // MANIFEST.json and notes.txt
  auto g = embstore::load_group(dir);
  CHECK(g.size() == 2 && g[0].first == "user" && g[1].first == "item");
  CHECK(dump(*g[0].second.table) == dump(*a) && dump(*g[1].second.table) == dump(*b));
  CHECK(g[0].second.label.name == std::string("user"));
}

TEST_CASE(bad_files_raise_checkpoint_error) {
  std::mt19937_64 rng(7);
  const auto universe = random_ids(rng, 40);
  auto t = trained(256, 2, rng, universe, embstore::OptimizerKind::kRowWiseAdagrad);
  embstore::save(*t, file("good.ckpt"));
  const auto good = read_bytes(file("good.ckpt"));
  const std::string bad = file("bad.ckpt");
  // Every flipped byte is detected.
  for (size_t i = 0; i < good.size(); ++i) {
    auto b = good;
    b[i] = char(b[i] ^ 0x10);
    write_bytes(bad, b);
    bool caught = false;
    try {
      embstore::load(bad);
    } catch (const embstore::CheckpointError& e) {
      caught = std::strstr(e.what(), bad.c_str()) == e.what();
    }
    if (!caught) fail(__FILE__, __LINE__, "flipped byte " + std::to_string(i) + " not detected");
  }
  // Every truncation is detected.
  for (size_t n = 0; n < good.size(); n += (n < 200 ? 1 : 7)) {
    write_bytes(bad, std::vector<char>(good.begin(), good.begin() + long(n)));
    bool caught = false;
    try {
      embstore::load(bad);
    } catch (const embstore::CheckpointError&) {
      caught = true;
    }
    if (!caught) fail(__FILE__, __LINE__, "truncation to " + std::to_string(n) + " not detected");
  }
  write_bytes(bad, std::vector<char>(100, 'a'));
  CHECK_THROWS(embstore::CheckpointError, "not an embstore checkpoint", embstore::load(bad));
  auto v2 = good;  // version 2, with a valid preamble checksum
  v2[16] = 2;
  const uint32_t crc = embstore::internal::crc32(v2.data(), 28);
  std::memcpy(v2.data() + 28, &crc, 4);
  write_bytes(bad, v2);
  CHECK_THROWS(embstore::CheckpointError, "unsupported checkpoint format version 2",
               embstore::load(bad));
  CHECK_THROWS(std::system_error, "cannot open", embstore::load(file("missing.ckpt")));
}

TEST_CASE(failed_save_leaves_the_old_file_and_the_chain) {
  std::mt19937_64 rng(8);
  const auto universe = random_ids(rng, 200);
  auto t = trained(1024, 2, rng, universe);
  const std::string id = embstore::save(*t, file("keep.ckpt"));
  CHECK_THROWS(std::system_error, "cannot create",
               embstore::save_delta(*t, file("no/such/dir/x.ckpt")));
  CHECK(t->checkpoint_id() == id);  // the chain is unchanged; the delta still holds everything
  train(*t, rng, universe, 64);
  embstore::save_delta(*t, file("keep1.ckpt"));
  CHECK(dump(*embstore::load(file("keep.ckpt"), {file("keep1.ckpt")}).table) == dump(*t));
  for (const auto& f : fs::directory_iterator(workdir())) {
    CHECK(f.path().extension() != ".tmp");
  }
}

// 4 threads train on their own ids (each thread's ids in one shard, so each of its calls is
// atomic with respect to the snapshot) while the main thread saves. Every thread's rows in
// the file must equal its rows after exactly m of its calls, with m between the calls it had
// finished when the save began and those it had begun when the save returned: the file is
// the table at one instant. Replayed alone on a fresh table, each thread's calls give the
// reference states.
TEST_CASE(save_while_four_threads_train) {
  const size_t shards = 8, threads = 4, per_thread = 300;
  std::mt19937_64 rng(9);
  std::vector<std::vector<uint64_t>> own(threads);
  while (true) {  // ids by shard: the top 3 bits of mix64 (table.hpp)
    const uint64_t id = rng();
    const size_t s = embstore::mix64(id) >> 61;
    if (s % 2 == 0 && own[s / 2].size() < per_thread) own[s / 2].push_back(id);
    bool full = true;
    for (const auto& o : own) full = full && o.size() == per_thread;
    if (full) break;
  }
  const TableConfig cfg = config(1 << 18, shards, embstore::OptimizerKind::kAdagrad);
  Table t(cfg);
  {  // bulk so the save takes a while: rows no thread touches
    const auto filler = random_ids(rng, 150000);
    std::vector<float> out(filler.size() * cfg.dim);
    t.lookup(filler.data(), filler.size(), true, out.data());
  }
  // Calls are counted one by one (a lookup, then its apply): the instant may fall between.
  std::atomic<bool> stop{false};
  std::vector<std::atomic<size_t>> done(threads);
  std::vector<std::thread> workers;
  for (size_t k = 0; k < threads; ++k) {
    workers.emplace_back([&, k] {
      std::mt19937_64 r(1000 + k);
      while (!stop.load()) {
        std::mt19937_64 again = r;
        train(t, r, own[k], 16, 0);
        done[k].fetch_add(1);
        train(t, again, own[k], 16, 1);
        done[k].fetch_add(1);
      }
    });
  }
  while (done[threads - 1].load() < 40) std::this_thread::yield();
  std::vector<size_t> before(threads), after(threads);
  for (size_t k = 0; k < threads; ++k) before[k] = done[k].load();
  setenv("EMBSTORE_CHECKPOINT_TEST_CHUNK_US", "2000", 1);  // a slow save: many calls overlap
  embstore::save(t, file("live.ckpt"));
  unsetenv("EMBSTORE_CHECKPOINT_TEST_CHUNK_US");
  size_t overlapped = 0;
  for (size_t k = 0; k < threads; ++k) {
    after[k] = done[k].load() + 1;
    overlapped += after[k] - 1 - before[k];
  }
  std::printf("  %zu calls ran during the save\n", overlapped);
  stop = true;
  for (auto& w : workers) w.join();
  const Rows saved = dump(*embstore::load(file("live.ckpt")).table);
  CHECK(saved.size() >= 150000);
  for (size_t k = 0; k < threads; ++k) {
    Table ref(cfg);
    std::mt19937_64 r(1000 + k), again(1000 + k);
    bool matched = false;
    for (size_t m = 0; m <= after[k] && !matched; ++m) {
      if (m > 0 && m % 2 == 1) {
        again = r;
        train(ref, r, own[k], 16, 0);
      } else if (m > 0) {
        train(ref, again, own[k], 16, 1);
      }
      if (m < before[k]) continue;
      const Rows want = dump(ref);
      bool same = true;
      for (uint64_t id : own[k]) {
        const auto w = want.find(id);
        const auto s = saved.find(id);
        same = same && (w == want.end()) == (s == saved.end()) &&
               (w == want.end() || w->second == s->second);
      }
      matched = same;
    }
    if (!matched) fail(__FILE__, __LINE__, "thread " + std::to_string(k) + " is at no instant");
  }
}

}  // namespace

int main(int argc, char** argv) {
  workdir() =
      fs::temp_directory_path() / ("embstore-ckpt-test-" + std::to_string(std::random_device{}()));
  fs::create_directories(workdir());
  int failed = 0;
  for (const Case& c : cases()) {
    bool selected = argc < 2;
    for (int i = 1; i < argc; ++i) selected = selected || std::strstr(c.name, argv[i]);
    if (!selected) continue;
    std::printf("[ RUN  ] %s\n", c.name);
    std::fflush(stdout);
    bool ok = false;
    try {
      c.fn();
      ok = true;
    } catch (const CheckFailure&) {
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: unexpected exception: %s\n", c.name, e.what());
    }
    std::printf("[ %s ] %s\n", ok ? " OK " : "FAIL", c.name);
    failed += !ok;
  }
  std::error_code ec;
  fs::remove_all(workdir(), ec);
  std::printf("%d failed\n", failed);
  return failed == 0 ? 0 : 1;
}
