// Checkpoint throughput from C++ alone (no Python): W1-shaped tables (1M rows, D=32,
// Adagrad, warm), embstore::save and embstore::load into each directory given, plus the
// snapshot copy alone (Snapshot::next into a buffer, no file) as the floor of a save and
// the construction of an empty table of the same configuration, a load's first step.
//
//   cmake --install build --prefix /tmp/es
//   g++ -O2 -std=c++17 -I/tmp/es/include bench/checkpoint_cpp.cpp
//       /tmp/es/lib/libembstore_core.a -pthread -o /tmp/checkpoint_cpp      (one line)
//   /tmp/checkpoint_cpp [--rows N] [--repeats R] DIR...        (e.g. /dev/shm /var/tmp)
//
// Prints GB/s (file bytes / wall time) per repeat and the medians.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "embstore/checkpoint.hpp"
#include "embstore/snapshot.hpp"
#include "embstore/table.hpp"

namespace {

double seconds_of(const std::chrono::steady_clock::time_point& t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  size_t rows = 1000000, repeats = 5;
  std::vector<std::string> dirs;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--rows") && i + 1 < argc) {
      rows = std::strtoull(argv[++i], nullptr, 10);
    } else if (!std::strcmp(argv[i], "--repeats") && i + 1 < argc) {
      repeats = std::strtoull(argv[++i], nullptr, 10);
    } else {
      dirs.emplace_back(argv[i]);
    }
  }
  if (dirs.empty()) dirs.emplace_back("/dev/shm");
  embstore::TableConfig c;
  c.dim = 32;
  c.capacity = rows;
  c.num_threads = 2;
  c.optimizer.kind = embstore::OptimizerKind::kAdagrad;
  c.optimizer.lr = 0.05f;
  c.initializer.kind = embstore::InitializerKind::kNormal;
  c.initializer.b = 0.01;
  embstore::Table table(c);
  {
    std::vector<uint64_t> ids(rows);
    for (size_t i = 0; i < rows; ++i) ids[i] = embstore::splitmix64(i);
    std::vector<float> out(rows * c.dim);
    table.lookup(ids.data(), rows, true, out.data());
  }
  const double bytes = double(rows) * double(table.row_width() * 4 + 12);
  std::vector<double> copy;
  for (size_t r = 0; r < repeats; ++r) {  // the snapshot copy alone
    const auto t0 = std::chrono::steady_clock::now();
    embstore::Snapshot snap(table, embstore::SnapshotMode::kExport);
    const size_t cap = 16384;
    std::vector<uint64_t> ids(cap);
    std::vector<float> buf(cap * snap.row_width());
    std::vector<uint32_t> steps(cap);
    for (size_t s = 0; s < snap.num_shards(); ++s) {
      while (!snap.done(s)) snap.next(s, ids.data(), buf.data(), steps.data(), cap);
    }
    snap.commit();
    copy.push_back(bytes / seconds_of(t0) / 1e9);
  }
  std::printf("snapshot copy only: median %.2f GB/s\n", median(copy));
  std::vector<double> build;
  for (size_t r = 0; r < repeats; ++r) {  // a load's first step: the new, empty table
    const auto t0 = std::chrono::steady_clock::now();
    { embstore::Table empty(table.config()); }
    build.push_back(bytes / seconds_of(t0) / 1e9);
  }
  std::printf("new empty table only (as file bytes / time): median %.2f GB/s\n", median(build));
  for (const std::string& dir : dirs) {
    const std::string path = dir + "/embstore-checkpoint-cpp-bench.ckpt";
    std::vector<double> save, load;
    for (size_t r = 0; r < repeats; ++r) {
      std::filesystem::remove(path);
      auto t0 = std::chrono::steady_clock::now();
      embstore::save(table, path);
      const double size = double(std::filesystem::file_size(path));
      save.push_back(size / seconds_of(t0) / 1e9);
      t0 = std::chrono::steady_clock::now();
      { embstore::LoadedTable t = embstore::load(path); }
      load.push_back(size / seconds_of(t0) / 1e9);
      std::printf("%s repeat %zu: save %.2f GB/s, load %.2f GB/s\n", dir.c_str(), r, save.back(),
                  load.back());
    }
    std::filesystem::remove(path);
    std::printf("%s: save median %.2f GB/s, load median %.2f GB/s\n", dir.c_str(), median(save),
                median(load));
  }
}
