// Checkpoint writing: save, save_delta and save_group (checkpoint.hpp). Loading is in
// checkpoint_load.cpp; the file format in internal/checkpoint_file.cpp.
#include "embstore/checkpoint.hpp"

#include <chrono>        // std::chrono::system_clock
#include <exception>     // std::exception_ptr
#include <filesystem>    // std::filesystem
#include <set>           // std::set
#include <stdexcept>     // std::invalid_argument
#include <thread>        // std::thread

#include "embstore/errors.hpp"                      // CheckpointError
#include "embstore/hash.hpp"                        // splitmix64
#include "embstore/internal/channel.hpp"            // Channel, chunk_rows
#include "embstore/internal/checkpoint_file.hpp"    // FileWriter, write_atomic
#include "embstore/internal/checkpoint_header.hpp"  // make_header, new_checkpoint_id
#include "embstore/internal/crc32.hpp"              // crc32
#include "embstore/internal/float_env.hpp"          // DenormalScope
#include "embstore/snapshot.hpp"                    // Snapshot

namespace embstore {
namespace {

using internal::Channel;
using internal::crc32;
using internal::FileWriter;
using internal::Json;

struct Chunk {
  std::vector<uint64_t> ids;
  std::vector<float> rows;
  std::vector<uint32_t> steps;
  size_t n = 0;
  uint32_t shard = 0;
  uint32_t crcs[3] = {0, 0, 0};
};

// What the writer thread writes next: a chunk of rows (returned to `free` once written) or
// one other section.
struct Item {
  Chunk* chunk = nullptr;
  const char* name = nullptr;
  uint32_t shard = 0;
  std::vector<uint64_t> u64;
  std::vector<uint16_t> u16;
};

void write_item(FileWriter& w, const Item& item, size_t width) {
  if (item.chunk != nullptr) {
    const Chunk& c = *item.chunk;
    w.section("ids", c.shard, c.n, 0, c.ids.data(), c.crcs[0]);
    w.section("rows", c.shard, c.n, width, c.rows.data(), c.crcs[1]);
    w.section("last_step", c.shard, c.n, 0, c.steps.data(), c.crcs[2]);
  } else if (!item.u64.empty()) {
    w.section(item.name, item.shard, item.u64.size(), 0, item.u64.data(),
              crc32(item.u64.data(), item.u64.size() * 8));
  } else {
    w.section(item.name, item.shard, item.u16.size(), 0, item.u16.data(),
              crc32(item.u16.data(), item.u16.size() * 2));
  }
}

// Streams a begun snapshot into `path` (atomically). This thread copies chunks out of the
// table and checksums them; a writer thread writes the previous chunk meanwhile (two chunk
// buffers), so copy and I/O overlap. The snapshot is neither committed nor aborted here.
void write_snapshot(Table& table, Snapshot& snap, const std::string& path, const std::string& kind,
                    const std::string& id, const TableLabel& label) {
  const Json header = internal::make_header(table, snap, kind, id, snap.parent_id(), label);
  FileWriter w(path, header);
  const size_t width = snap.row_width(), cap = internal::chunk_rows(width);
  Chunk buffers[2];
  Channel<Chunk*> free(2);
  for (Chunk& c : buffers) {
    c.ids.resize(cap);
    c.rows.resize(cap * width);
    c.steps.resize(cap);
    free.push(&c);
  }
  Channel<Item> work(4);
  std::exception_ptr failure;
  std::thread writer([&] {
    Item item;
    while (work.pop(item)) {
      try {
        if (!failure) write_item(w, item, width);
      } catch (...) {
        failure = std::current_exception();
        free.close();  // wakes the copying thread, which then stops
      }
      if (item.chunk != nullptr) free.push(item.chunk);
    }
  });
  try {
    const bool delta = snap.mode() == SnapshotMode::kDelta;
    const bool admission = table.config().admission.enabled();
    for (size_t s = 0; s < snap.num_shards(); ++s) {
      while (!snap.done(s)) {
        Chunk* c = nullptr;
        if (!free.pop(c)) break;  // the writer failed
        c->n = snap.next(s, c->ids.data(), c->rows.data(), c->steps.data(), cap);
        internal::test_chunk_pause();
        if (c->n == 0) {
          free.push(c);
          continue;
        }
        c->shard = static_cast<uint32_t>(s);
        c->crcs[0] = crc32(c->ids.data(), c->n * 8);
        c->crcs[1] = crc32(c->rows.data(), c->n * width * 4);
        c->crcs[2] = crc32(c->steps.data(), c->n * 4);
        Item item;
        item.chunk = c;
        work.push(std::move(item));
      }
      if (!snap.done(s)) break;
      const auto shard = static_cast<uint32_t>(s);
      if (delta && !snap.removed(s).empty()) {
        Item item;
        item.name = "removed";
        item.shard = shard;
        item.u64 = snap.removed(s);
        work.push(std::move(item));
      }
      if (admission && !snap.sketch(s).empty()) {
        Item item;
        item.name = "sketch";
        item.shard = shard;
        item.u16 = snap.sketch(s);
        work.push(std::move(item));
      }
    }
  } catch (...) {
    work.close();
    writer.join();
    throw;
  }
  work.close();
  writer.join();
  if (failure) std::rethrow_exception(failure);
  w.finish();
}

bool is_hex(const std::string& s, size_t from, size_t n) {
  for (size_t k = from; k < from + n; ++k) {
    if (!((s[k] >= '0' && s[k] <= '9') || (s[k] >= 'a' && s[k] <= 'f'))) return false;
  }
  return true;
}

// A group's table file, tNNN-<12 hex>.ckpt (as the Python writer's pattern).
bool is_table_file(const std::string& s) {
  if (s.size() != 22 || s[0] != 't' || s[4] != '-' || s.compare(17, 5, ".ckpt") != 0) return false;
  for (size_t k = 1; k < 4; ++k) {
    if (s[k] < '0' || s[k] > '9') return false;
  }
  return is_hex(s, 5, 12);
}

// A writer's temporary file, .<name>.<12 hex>.tmp.
bool is_temporary_file(const std::string& s) {
  const size_t n = s.size();
  return n >= 19 && s[0] == '.' && s.compare(n - 4, 4, ".tmp") == 0 && s[n - 17] == '.' &&
         is_hex(s, n - 16, 12);
}

std::string save_impl(Table& table, const std::string& path, const TableLabel& label, bool delta) {
  // The header's float settings go through std::to_chars, which writes a denormal as 0
  // under DAZ. Threads started in this scope inherit the cleared modes.
  const detail::DenormalScope ieee;
  Snapshot snap(table, delta ? SnapshotMode::kDelta : SnapshotMode::kFull);
  if (delta && snap.parent_id().empty()) {
    throw CheckpointError(path +
                          ": save_delta needs a previous checkpoint of this table: call save() "
                          "first (a table starts a chain with save() or by being loaded from a "
                          "checkpoint)");
  }
  const std::string id = internal::new_checkpoint_id();
  write_snapshot(table, snap, path, delta ? "delta" : "full", id, label);
  snap.commit(id);  // the destructor aborts on any exception before
  return id;
}

}  // namespace

std::string save(Table& table, const std::string& path, const TableLabel& label) {
  return save_impl(table, path, label, false);
}

std::string save_delta(Table& table, const std::string& path, const TableLabel& label) {
  return save_impl(table, path, label, true);
}

uint32_t route_of(uint64_t id, uint64_t salt, uint32_t num_shards) noexcept {
  // The high 64 bits of the 128-bit product, from 32-bit halves (no overflow: see below).
  const uint64_t h = splitmix64(id ^ salt);
  const uint64_t lo = ((h & 0xFFFFFFFFu) * num_shards) >> 32;  // < 2^32
  const uint64_t hi = (h >> 32) * num_shards + lo;              // <= (2^32-1)^2 + 2^32 - 1
  return static_cast<uint32_t>(hi >> 32);
}

std::function<bool(uint64_t)> keep_route(uint64_t salt, uint32_t num_shards, uint32_t shard) {
  if (num_shards == 0 || shard >= num_shards) {
    throw std::invalid_argument("keep_route: shard must be in [0, num_shards)");
  }
  return [=](uint64_t id) { return route_of(id, salt, num_shards) == shard; };
}

void save_group(const std::vector<std::pair<std::string, Table*>>& tables,
                const std::string& directory, const std::vector<TableLabel>& labels) {
  const detail::DenormalScope ieee;  // as save_impl
  namespace fs = std::filesystem;
  if (!labels.empty() && labels.size() != tables.size()) {
    throw std::invalid_argument("save_group: labels must be empty or one per table");
  }
  std::set<std::string> names;
  for (const auto& [name, table] : tables) {
    if (table == nullptr) throw std::invalid_argument("save_group: table '" + name + "' is null");
    if (!names.insert(name).second) {
      throw std::invalid_argument("save_group: two tables named '" + name + "'");
    }
  }
  fs::create_directories(directory);
  std::vector<std::unique_ptr<Snapshot>> snaps;
  for (const auto& entry : tables) {  // back to back: instants microseconds apart
    snaps.push_back(std::make_unique<Snapshot>(*entry.second, SnapshotMode::kFull));
  }
  Json entries = Json::object(), order = Json::array();
  std::vector<std::string> ids;
  std::set<std::string> files;
  for (size_t k = 0; k < tables.size(); ++k) {
    const std::string id = internal::new_checkpoint_id();
    char file[64];
    std::snprintf(file, sizeof file, "t%03zu-%s.ckpt", k, id.substr(0, 12).c_str());
    TableLabel label = labels.empty() ? TableLabel{} : labels[k];
    label.name = tables[k].first;
    write_snapshot(*tables[k].second, *snaps[k], directory + "/" + file, "full", id, label);
    Json e = Json::object();
    e.set("file", Json::string(file));
    e.set("checkpoint_id", Json::string(id));
    entries.set(tables[k].first, e);
    order.push(Json::string(tables[k].first));
    ids.push_back(id);
    files.insert(file);
  }
  Json body = Json::object();
  body.set("format", Json::string("embstore.group"));
  body.set("version", Json::unsigned_integer(internal::kFormatVersion));
  body.set("created_unix", Json::number(std::chrono::duration<double>(
                                            std::chrono::system_clock::now().time_since_epoch())
                                            .count()));
  body.set("tables", entries);
  body.set("order", order);
  // The checksum is over Python's json.dumps(body, sort_keys=True), which dump(false) is.
  const std::string text = body.dump(false);
  Json manifest = Json::object();
  manifest.set("body", body);
  manifest.set("crc32", Json::unsigned_integer(internal::crc32(text.data(), text.size())));
  internal::write_atomic(directory + "/MANIFEST.json", manifest.dump(false));
  for (size_t k = 0; k < snaps.size(); ++k) snaps[k]->commit(ids[k]);
  std::error_code ec;
  for (const auto& f : fs::directory_iterator(directory, ec)) {
    const std::string name = f.path().filename().string();
    if ((is_table_file(name) && files.count(name) == 0) || is_temporary_file(name)) {
      fs::remove(f.path(), ec);
    }
  }
}

}  // namespace embstore
