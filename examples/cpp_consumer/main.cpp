// examples/cpp_consumer/main.cpp: a parameter-server-shaped use of the embstore core.
//
// 1. Live: 4 threads run lookup_sum and apply_gradients on two tables while the main thread
//    saves both; then each table is loaded into a table of another shard count and every
//    thread's rows in the file are checked to be its rows at one instant (exit 1 if not).
// 2. Golden (with an OUTPUT_DIR argument): a fixed single-threaded run whose batches,
//    pooled outputs and final checkpoints are written to OUTPUT_DIR, so the Python package
//    can replay it and compare bit for bit (tests/test_cpp_consumer.py).
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "embstore/checkpoint.hpp"  // save, load, CheckpointError
#include "embstore/table.hpp"       // Table, TableConfig

namespace {

constexpr size_t kThreads = 4;
constexpr size_t kIdsPerThread = 64;

embstore::TableConfig user_config() {
  embstore::TableConfig c;
  c.dim = 32;
  c.capacity = 100000;
  c.num_shards = 4;
  c.optimizer.kind = embstore::OptimizerKind::kAdagrad;
  c.optimizer.lr = 0.05f;
  c.initializer.kind = embstore::InitializerKind::kNormal;
  c.initializer.b = 0.01;  // std
  c.initializer.seed = 1;
  return c;
}

embstore::TableConfig item_config() {
  embstore::TableConfig c;
  c.dim = 16;
  c.capacity = 50000;
  c.num_shards = 4;
  c.optimizer.kind = embstore::OptimizerKind::kAdam;
  c.optimizer.lr = 0.01f;
  c.initializer.kind = embstore::InitializerKind::kUniform;
  c.initializer.a = -0.05;  // low
  c.initializer.b = 0.05;   // high
  c.initializer.seed = 2;
  return c;
}

// A forward (pooled lookup, inserting) on `t`: 4 bags over `keys`; then its backward.
constexpr size_t kBags = 4;

std::vector<float> forward(embstore::Table& t, const std::vector<uint64_t>& keys,
                           const int64_t* offsets) {
  std::vector<float> pooled(kBags * t.dim());
  t.lookup_sum(keys.data(), keys.size(), offsets, kBags, nullptr, embstore::PoolMode::kSum, true,
               pooled.data());
  return pooled;
}

void backward(embstore::Table& t, const std::vector<uint64_t>& keys, const int64_t* offsets,
              std::vector<float> grads) {
  t.apply_gradients(keys.data(), keys.size(), grads.data(), offsets, kBags, nullptr,
                    embstore::PoolMode::kSum);
}

// Thread k's ids all live in shard k of a 4-shard table (shard = top 2 bits of mix64), so
// each of its calls is atomic with respect to a save, and no other thread touches them:
// after each call (a forward may insert rows, a backward updates them) the thread records
// its rows, and the saved rows must be one of the records.
std::vector<uint64_t> ids_of_shard(size_t k, std::mt19937_64& rng) {
  std::vector<uint64_t> ids;
  while (ids.size() < kIdsPerThread) {
    const uint64_t id = rng();
    if ((embstore::mix64(id) >> 62) == k) ids.push_back(id);
  }
  return ids;
}

std::vector<float> rows_of(embstore::Table& t, const std::vector<uint64_t>& ids) {
  std::vector<float> out(ids.size() * t.dim());
  t.lookup(ids.data(), ids.size(), false, out.data());
  return out;
}

int live() {
  embstore::Table user(user_config()), item(item_config());
  std::mt19937_64 rng(42);
  std::vector<std::vector<uint64_t>> own(kThreads);
  for (size_t k = 0; k < kThreads; ++k) own[k] = ids_of_shard(k, rng);
  // history[table][thread]: the thread's rows after each of its calls.
  std::vector<std::vector<std::vector<float>>> history[2];
  for (auto& h : history) h.resize(kThreads);
  std::atomic<bool> stop{false};
  std::atomic<size_t> calls{0};
  std::vector<std::thread> workers;
  for (size_t k = 0; k < kThreads; ++k) {
    workers.emplace_back([&, k] {
      embstore::Table* tables[2] = {&user, &item};
      for (int t = 0; t < 2; ++t) history[t][k].push_back(rows_of(*tables[t], own[k]));
      std::mt19937_64 r(k);
      std::vector<uint64_t> batch(32);
      const int64_t offsets[] = {0, 8, 16, 24, 32};
      while (!stop.load()) {
        for (auto& id : batch) id = own[k][r() % own[k].size()];
        for (int t = 0; t < 2; ++t) {
          std::vector<float> grads = forward(*tables[t], batch, offsets);
          history[t][k].push_back(rows_of(*tables[t], own[k]));
          for (float& g : grads) g *= 0.01f;  // the gradient of a toy loss
          backward(*tables[t], batch, offsets, std::move(grads));
          history[t][k].push_back(rows_of(*tables[t], own[k]));
        }
        calls.fetch_add(1);
      }
    });
  }
  while (calls.load() < 200) std::this_thread::yield();
  embstore::save(user, "consumer_user.ckpt");  // while the workers run
  embstore::save(item, "consumer_item.ckpt");
  stop = true;
  for (auto& w : workers) w.join();

  const char* files[2] = {"consumer_user.ckpt", "consumer_item.ckpt"};
  int bad = 0;
  for (int t = 0; t < 2; ++t) {
    embstore::LoadOptions options;
    options.num_shards = 8;  // another shard count: rows are re-hashed
    embstore::LoadedTable loaded = embstore::load(files[t], {}, options);
    for (size_t k = 0; k < kThreads; ++k) {
      const std::vector<float> saved = rows_of(*loaded.table, own[k]);
      bool found = false;
      for (const auto& rows : history[t][k]) {
        found = found || std::memcmp(rows.data(), saved.data(), saved.size() * 4) == 0;
      }
      if (!found) {
        std::fprintf(stderr, "%s: thread %zu's rows are at no instant\n", files[t], k);
        ++bad;
      }
    }
    std::printf("%s: %zu rows loaded into %zu shards\n", files[t], loaded.table->size(),
                loaded.table->num_shards());
  }
  return bad;
}

// Fixed batches, one thread: writes golden.bin (per step and table: keys, gradient scale
// applied by the core, pooled outputs) and the final checkpoints.
void golden(const std::string& dir) {
  embstore::Table user(user_config()), item(item_config());
  embstore::Table* tables[2] = {&user, &item};
  std::ofstream out(dir + "/golden.bin", std::ios::binary);
  std::mt19937_64 rng(7);
  const uint32_t steps = 8, n = 256, bags = 16;
  out.write(reinterpret_cast<const char*>(&steps), 4);
  out.write(reinterpret_cast<const char*>(&n), 4);
  out.write(reinterpret_cast<const char*>(&bags), 4);
  std::vector<int64_t> offsets(bags + 1);
  for (uint32_t b = 0; b <= bags; ++b) offsets[b] = int64_t(b) * n / bags;
  for (uint32_t s = 0; s < steps; ++s) {
    for (embstore::Table* t : tables) {
      t->set_step(s + 1);
      std::vector<uint64_t> keys(n);
      for (auto& k : keys) k = rng() % 5000;
      std::vector<float> pooled(bags * t->dim()), grads(bags * t->dim());
      t->lookup_sum(keys.data(), n, offsets.data(), bags, nullptr, embstore::PoolMode::kSum, true,
                    pooled.data());
      for (size_t j = 0; j < grads.size(); ++j) grads[j] = float(int(j % 7) - 3) / 64.0f;
      t->apply_gradients(keys.data(), n, grads.data(), offsets.data(), bags, nullptr,
                         embstore::PoolMode::kSum);
      out.write(reinterpret_cast<const char*>(keys.data()), std::streamsize(n * 8));
      out.write(reinterpret_cast<const char*>(pooled.data()), std::streamsize(pooled.size() * 4));
    }
  }
  embstore::save(user, dir + "/user.ckpt", {std::string("user"), std::nullopt});
  embstore::save(item, dir + "/item.ckpt", {std::string("item"), std::nullopt});
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int bad = live();
    if (argc > 1) golden(argv[1]);
    std::printf(bad ? "FAILED\n" : "ok\n");
    return bad ? 1 : 0;
  } catch (const std::exception& e) {  // CheckpointError, CapacityError, std::system_error
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
