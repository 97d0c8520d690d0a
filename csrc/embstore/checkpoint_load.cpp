// Checkpoint loading: load (with deltas, overrides, keep_recent and keep_id), read_header and
// load_group (checkpoint.hpp).
#include <algorithm>   // std::sort, std::min
#include <atomic>      // std::atomic
#include <cerrno>      // errno
#include <chrono>      // std::chrono::steady_clock
#include <exception>   // std::exception_ptr
#include <fstream>     // std::ifstream
#include <map>         // std::map
#include <sstream>     // std::stringstream
#include <system_error>  // std::system_error
#include <thread>      // std::thread

#include "embstore/checkpoint.hpp"
#include "embstore/errors.hpp"                      // CheckpointError, CapacityError
#include "embstore/internal/channel.hpp"            // Channel, chunk_rows
#include "embstore/internal/checkpoint_file.hpp"    // FileReader, SectionInfo
#include "embstore/internal/checkpoint_header.hpp"  // parse_header, SavedTable
#include "embstore/internal/crc32.hpp"              // crc32
#include "embstore/internal/float_env.hpp"          // DenormalScope
#include "embstore/internal/json.hpp"               // Json

namespace embstore {
namespace {

using internal::Channel;
using internal::FileReader;
using internal::SavedTable;
using internal::SectionInfo;
using Readers = std::vector<std::unique_ptr<FileReader>>;
using Masks = std::vector<std::vector<uint8_t>>;

// Opens base + deltas and checks that they make a chain (before anything is imported).
void open_chain(const std::string& base, const std::vector<std::string>& deltas, Readers& readers,
                std::vector<SavedTable>& configs) {
  readers.push_back(std::make_unique<FileReader>(base));
  for (const auto& d : deltas) readers.push_back(std::make_unique<FileReader>(d));
  for (const auto& r : readers) configs.push_back(internal::parse_header(*r));
  if (configs[0].kind != "full") {
    readers[0]->fail("a delta checkpoint, not a full one (pass it in deltas=)");
  }
  for (size_t k = 1; k < readers.size(); ++k) {
    const FileReader &r = *readers[k], &prev = *readers[k - 1];
    if (configs[k].kind != "delta")
      r.fail("a full checkpoint, not a delta (deltas must be deltas)");
    if (r.parent_id() != prev.checkpoint_id()) {
      r.fail("this delta follows checkpoint " + r.parent_id() + ", not " + prev.path() + " (" +
             prev.checkpoint_id() +
             "): the chain does not fit (wrong order, a missing delta, or a delta of another "
             "table)");
    }
    if (!configs[k].same_shape(configs[0])) {
      r.fail("a delta of a table of another shape than " + readers[0]->path());
    }
  }
}

// One event of the chain for the pre-pass: a row (pos >= 0) or a removal (pos == -1).
struct Event {
  uint64_t id;
  uint64_t seq;  // order in the chain (removals of a file before its rows)
  int64_t pos;   // row in its file
  uint32_t file;
  uint32_t step;
};

// Pre-pass over every file (ids, last steps and removed ids only; rows are checksummed):
// which rows make the final table. The last version of every kept id that no later delta
// removes, and with keep_recent at most `capacity` of them (largest last step first, ties in
// file order). Returns per-file masks; `dropped` counts rows left out by keep_recent or
// keep_id.
Masks select_rows(Readers& readers, size_t capacity, const LoadOptions& o, size_t& dropped) {
  dropped = 0;
  std::vector<Event> events;
  std::vector<size_t> sizes;
  uint64_t seq = 0;
  for (uint32_t f = 0; f < readers.size(); ++f) {
    FileReader& r = *readers[f];
    std::vector<uint64_t> ids, removed, buf;
    std::vector<uint32_t> steps, sbuf;
    SectionInfo sec;
    while (r.next(sec)) {
      if (sec.name == "ids" || sec.name == "removed") {
        buf.resize(sec.rows);
        r.read_payload(sec, buf.data());
        auto& dst = sec.name == "ids" ? ids : removed;
        dst.insert(dst.end(), buf.begin(), buf.end());
      } else if (sec.name == "last_step") {
        sbuf.resize(sec.rows);
        r.read_payload(sec, sbuf.data());
        steps.insert(steps.end(), sbuf.begin(), sbuf.end());
      } else {
        r.skip_payload(sec);
      }
    }
    if (steps.size() != ids.size() || ids.size() != r.num_rows()) {
      r.fail("corrupted (ids and last steps differ in length)");
    }
    sizes.push_back(ids.size());
    for (uint64_t id : removed) {
      if (!o.keep_id || o.keep_id(id)) events.push_back({id, seq, -1, f, 0});
      ++seq;
    }
    for (size_t k = 0; k < ids.size(); ++k) {
      if (!o.keep_id || o.keep_id(ids[k])) {
        events.push_back({ids[k], seq, static_cast<int64_t>(k), f, steps[k]});
      } else {
        ++dropped;
      }
      ++seq;
    }
  }
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    return a.id != b.id ? a.id < b.id : a.seq < b.seq;
  });
  std::vector<Event> final_rows;
  for (size_t k = 0; k < events.size(); ++k) {
    const bool last = k + 1 == events.size() || events[k + 1].id != events[k].id;
    if (last && events[k].pos >= 0) final_rows.push_back(events[k]);
  }
  std::vector<Event>().swap(events);
  if (o.keep_recent && final_rows.size() > capacity) {
    std::sort(final_rows.begin(), final_rows.end(), [](const Event& a, const Event& b) {
      return a.step != b.step ? a.step > b.step : a.seq < b.seq;
    });
    dropped += final_rows.size() - capacity;
    final_rows.resize(capacity);
  }
  Masks masks(readers.size());
  for (size_t f = 0; f < readers.size(); ++f) masks[f].assign(sizes[f], 0);
  for (const Event& e : final_rows) masks[e.file][static_cast<size_t>(e.pos)] = 1;
  return masks;
}

struct Group {  // one row group read from a file, or a sketch section
  std::vector<uint64_t> ids;
  std::vector<float> rows;
  std::vector<uint32_t> steps;
  size_t n = 0;
  uint32_t sketch_shard = internal::kNoShard;  // != kNoShard: a sketch in `sketch`
  std::vector<uint16_t> sketch;
};

// Reads every section of `r` in order (checking each) on a thread of its own and hands over
// row groups and sketches through `out`, so file reads and checksums overlap the caller's
// imports. Three group buffers circulate (`pool`).
class GroupReader {
 public:
  GroupReader(FileReader& r, size_t width) : r_(r), width_(width) {
    for (auto& g : buffers_) pool_.push(&g);
    thread_ = std::thread([this] { run(); });
  }
  ~GroupReader() { stop(); }
  bool next(Group*& g) { return out_.pop(g); }
  void release(Group* g) {
    if (g->sketch_shard == internal::kNoShard)
      pool_.push(g);
    else
      delete g;
  }
  void finish() {  // after next() returned false: rethrows the reader's error
    stop();
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  void stop() {
    pool_.close();
    out_.close();
    if (thread_.joinable()) thread_.join();
  }
  void run() {
    try {
      read_all();
    } catch (...) {
      failure_ = std::current_exception();
    }
    out_.close();
  }
  void read_all() {
    static const char* names[3] = {"ids", "rows", "last_step"};
    SectionInfo sec;
    Group* g = nullptr;
    size_t have = 0;
    while (r_.next(sec)) {
      if (sec.name == "sketch") {
        auto* s = new Group;
        s->sketch.resize(sec.rows);
        r_.read_payload(sec, s->sketch.data());
        s->sketch_shard = sec.shard;
        if (sec.shard == internal::kNoShard || !out_.push(s)) delete s;
        continue;
      }
      if (sec.name == "removed") {  // the pre-pass applied them; here only checked
        r_.skip_payload(sec);
        continue;
      }
      if (sec.name != names[have] || (have && sec.rows != g->n)) {
        r_.fail("corrupted (section " + std::to_string(sec.number) + " out of place)");
      }
      if (sec.name == "rows" && sec.cols != width_) {
        r_.fail("corrupted (section " + std::to_string(sec.number) + " has rows of width " +
                std::to_string(sec.cols) + ", expected " + std::to_string(width_) + ")");
      }
      if (have == 0) {
        if (!pool_.pop(g)) return;  // stopped
        g->n = sec.rows;
        if (g->ids.size() < g->n) {  // bigger chunks than this writer's: grow once
          g->ids.resize(g->n);
          g->rows.resize(g->n * width_);
          g->steps.resize(g->n);
        }
      }
      void* target = have == 0   ? static_cast<void*>(g->ids.data())
                     : have == 1 ? static_cast<void*>(g->rows.data())
                                 : static_cast<void*>(g->steps.data());
      r_.read_payload(sec, target);
      if (++have == 3) {
        if (!out_.push(g)) return;
        have = 0;
      }
    }
    if (have) r_.fail("corrupted (an incomplete row group)");
  }

  FileReader& r_;
  size_t width_;
  Group buffers_[3];
  Channel<Group*> pool_{3};
  Channel<Group*> out_{2};
  std::exception_ptr failure_;
  std::thread thread_;
};

TableConfig new_config(const SavedTable& cfg, size_t capacity, const LoadOptions& o) {
  TableConfig c = cfg.config;
  c.capacity = capacity;
  c.num_shards = o.num_shards.value_or(cfg.config.num_shards);
  if (!o.num_shards && c.num_shards > capacity) c.num_shards = 0;  // let the table choose
  if (o.num_threads) c.num_threads = *o.num_threads;
  if (o.eviction) c.eviction = *o.eviction;
  c.stage_evicted = o.stage_evicted;
  return c;
}

// Imports the rows a file keeps (its mask, or keep_id) into `table`. Returns the rows
// offered; `not_placed` counts those no shard had room for, `filtered` those keep_id left out.
size_t import_file(FileReader& r, const std::vector<uint8_t>* mask, const LoadOptions& o,
                   Table& table, size_t& not_placed, size_t& filtered,
                   std::map<uint32_t, std::vector<uint16_t>>& sketches) {
  const size_t width = table.row_width();
  GroupReader reader(r, width);
  std::map<uint32_t, std::vector<uint16_t>> file_sketch;
  size_t seen = 0, offered = 0;
  Group* g = nullptr;
  while (reader.next(g)) {
    if (g->sketch_shard != internal::kNoShard) {
      file_sketch[g->sketch_shard] = std::move(g->sketch);
      reader.release(g);
      continue;
    }
    size_t k = 0;  // compacts the kept rows to the front, in order
    for (size_t i = 0; i < g->n; ++i) {
      const bool keep =
          mask != nullptr ? (*mask)[seen + i] != 0 : !o.keep_id || o.keep_id(g->ids[i]);
      if (!keep) {
        if (mask == nullptr) ++filtered;
        continue;
      }
      if (k != i) {
        g->ids[k] = g->ids[i];
        g->steps[k] = g->steps[i];
        std::copy_n(g->rows.data() + i * width, width, g->rows.data() + k * width);
      }
      ++k;
    }
    if (mask != nullptr && mask->size() < seen + g->n) r.fail("corrupted (row count differs)");
    seen += g->n;
    if (k) {
      const size_t stored = table.import_rows(g->ids.data(), k, g->rows.data(), g->steps.data(),
                                              ImportMode::kRestore, nullptr);
      not_placed += k - stored;
      offered += k;
    }
    reader.release(g);
  }
  reader.finish();
  if (seen != r.num_rows()) r.fail("corrupted (row count differs from the trailer)");
  if (!file_sketch.empty()) sketches = std::move(file_sketch);  // the latest file's counters
  return offered;
}

}  // namespace

LoadedTable load(const std::string& path, const std::vector<std::string>& deltas,
                 const LoadOptions& o) {
  // The header's doubles become the table's float settings: FTZ would flush a denormal.
  // Threads started in this scope inherit the cleared modes.
  const detail::DenormalScope ieee;
  const auto start = std::chrono::steady_clock::now();
  Readers readers;
  std::vector<SavedTable> configs;
  open_chain(path, deltas, readers, configs);
  const SavedTable& cfg = configs.back();
  const size_t capacity = o.capacity.value_or(cfg.config.capacity);
  size_t total = readers[0]->num_rows(), dropped = 0;
  Masks masks;
  if (readers.size() > 1 || (o.keep_recent && total > capacity)) {
    masks = select_rows(readers, capacity, o, dropped);
    total = 0;
    for (const auto& m : masks) total += static_cast<size_t>(std::count(m.begin(), m.end(), 1));
    for (auto& r : readers) r = std::make_unique<FileReader>(r->path());  // the main pass
  }
  if (!o.keep_id && total > capacity) {
    throw CapacityError(readers.back()->path() + ": the checkpoint holds " + std::to_string(total) +
                        " rows, more than capacity " + std::to_string(capacity) +
                        "; load with a larger capacity or keep='recent'");
  }
  LoadedTable out;
  out.table = std::make_unique<Table>(new_config(cfg, capacity, o));
  Table& table = *out.table;
  size_t not_placed = 0, filtered = 0;
  std::map<uint32_t, std::vector<uint16_t>> sketches;
  for (size_t f = 0; f < readers.size(); ++f) {
    out.rows += import_file(*readers[f], masks.empty() ? nullptr : &masks[f], o, table, not_placed,
                            filtered, sketches);
  }
  if (not_placed && !o.keep_recent) {
    if (out.rows > capacity) {
      throw CapacityError(
          readers.back()->path() + ": the checkpoint holds " + std::to_string(out.rows) +
          " rows that keep_id keeps, more than "
          "capacity " +
          std::to_string(capacity) + "; load with a larger capacity or keep='recent'");
    }
    throw CapacityError(readers.back()->path() + ": " + std::to_string(not_placed) +
                        " rows did not fit: a shard of the new table (capacity " +
                        std::to_string(capacity) + ", " + std::to_string(table.num_shards()) +
                        " shards) has no room for its share; load with a larger capacity or "
                        "keep='recent'");
  }
  out.rows -= not_placed;
  out.dropped = dropped + not_placed + filtered;
  if (table.config().admission.enabled() && table.num_shards() == cfg.config.num_shards) {
    for (const auto& [s, counters] : sketches) {
      if (s < table.num_shards()) table.restore_sketch(s, counters.data(), counters.size());
    }
  }
  if (cfg.step_tracking) table.set_step(cfg.step);
  out.label = cfg.label;
  out.checkpoint_id = out.dropped ? std::string() : readers.back()->checkpoint_id();
  table.set_checkpoint_id(out.checkpoint_id);
  const auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count();
  table.record_latency(Timer::kLoad, static_cast<uint64_t>(ns));
  return out;
}

std::string read_header(const std::string& path) {
  FileReader r(path);
  return r.header().dump(true);
}

std::vector<std::pair<std::string, LoadedTable>> load_group(const std::string& directory,
                                                            const LoadOptions& options) {
  const detail::DenormalScope ieee;  // as load
  const std::string mpath = directory + "/MANIFEST.json";
  std::ifstream in(mpath, std::ios::binary);
  if (!in) throw std::system_error(errno, std::generic_category(), mpath + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::pair<std::string, std::string>> files;  // name, file
  std::vector<std::string> ids;
  try {
    const internal::Json manifest = internal::Json::parse(text.str());
    const internal::Json& body = manifest.member("body");
    const std::string canonical = body.dump(false);
    const bool ok =
        internal::crc32(canonical.data(), canonical.size()) == manifest.member("crc32").as_u64();
    if (!ok || body.member("format").as_string() != "embstore.group") {
      throw std::runtime_error("checksum");
    }
    if (body.member("version").as_u64() != internal::kFormatVersion) {
      throw CheckpointError(mpath + ": unsupported group format version " +
                            body.member("version").dump(true));
    }
    for (const auto& n : body.member("order").items()) {
      const internal::Json& e = body.member("tables").member(n.as_string());
      files.emplace_back(n.as_string(), e.member("file").as_string());
      ids.push_back(e.member("checkpoint_id").as_string());
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::runtime_error&) {
    throw CheckpointError(mpath + ": not an embstore group manifest, or corrupted");
  }
  std::vector<std::pair<std::string, LoadedTable>> out;
  for (size_t k = 0; k < files.size(); ++k) {
    const std::string fpath = directory + "/" + files[k].second;
    LoadedTable t = load(fpath, {}, options);
    FileReader r(fpath);
    if (r.checkpoint_id() != ids[k]) {
      throw CheckpointError(fpath + ": not the checkpoint the manifest names (" + ids[k] + ")");
    }
    t.label.name = files[k].first;
    out.emplace_back(files[k].first, std::move(t));
  }
  return out;
}

}  // namespace embstore
