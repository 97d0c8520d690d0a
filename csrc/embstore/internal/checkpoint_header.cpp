#include "embstore/internal/checkpoint_header.hpp"

#include <chrono>     // std::chrono::system_clock
#include <cmath>      // std::isfinite
#include <cstdio>     // std::snprintf
#include <random>     // std::random_device
#include <stdexcept>  // std::runtime_error
#include <tuple>      // std::tuple
#include <vector>     // std::vector

#include "embstore/errors.hpp"    // CheckpointError
#include "embstore/snapshot.hpp"  // Snapshot
#include "embstore/table.hpp"     // Table

#ifndef EMBSTORE_VERSION
#define EMBSTORE_VERSION "unknown"
#endif

namespace embstore::internal {
namespace {

using Layout = std::vector<std::tuple<std::string, size_t, std::string>>;

Layout state_layout(const OptimizerConfig& o, size_t dim) {
  switch (o.kind) {
    case OptimizerKind::kSgd:
      if (o.momentum > 0.0f) return {{"momentum", dim, "float32"}};
      return {};
    case OptimizerKind::kAdagrad: return {{"accumulator", dim, "float32"}};
    case OptimizerKind::kRowWiseAdagrad: return {{"accumulator", 1, "float32"}};
    case OptimizerKind::kAdam:
      return {{"m", dim, "float32"}, {"v", dim, "float32"}, {"step", 1, "uint32"}};
    case OptimizerKind::kFtrl: return {{"z", dim, "float32"}, {"n", dim, "float32"}};
  }
  return {};
}

const char* optimizer_name(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::kSgd: return "SGD";
    case OptimizerKind::kAdagrad: return "Adagrad";
    case OptimizerKind::kRowWiseAdagrad: return "RowWiseAdagrad";
    case OptimizerKind::kAdam: return "Adam";
    case OptimizerKind::kFtrl: return "FTRL";
  }
  return "?";
}

// The Python dataclass fields of each optimizer -> the config's floats.
struct Field {
  const char* name;
  float OptimizerConfig::* member;
};
std::vector<Field> optimizer_fields(OptimizerKind k) {
  using O = OptimizerConfig;
  switch (k) {
    case OptimizerKind::kSgd: return {{"lr", &O::lr}, {"momentum", &O::momentum}};
    case OptimizerKind::kAdagrad:
    case OptimizerKind::kRowWiseAdagrad:
      return {{"lr", &O::lr}, {"eps", &O::eps}, {"initial_accumulator", &O::initial_accumulator}};
    case OptimizerKind::kAdam:
      return {{"lr", &O::lr},
              {"beta1", &O::beta1},
              {"beta2", &O::beta2},
              {"eps", &O::eps},
              {"weight_decay", &O::weight_decay}};
    case OptimizerKind::kFtrl:
      return {{"alpha", &O::lr}, {"beta", &O::ftrl_beta}, {"l1", &O::l1}, {"l2", &O::l2}};
  }
  return {};
}

const char* initializer_name(InitializerKind k) {
  switch (k) {
    case InitializerKind::kZeros: return "Zeros";
    case InitializerKind::kUniform: return "Uniform";
    case InitializerKind::kNormal: return "Normal";
    case InitializerKind::kTruncatedNormal: return "TruncatedNormal";
  }
  return "?";
}

Json optimizer_json(const OptimizerConfig& o, float lr) {
  Json j = Json::object();
  j.set("type", Json::string(optimizer_name(o.kind)));
  OptimizerConfig current = o;
  current.lr = lr;  // the learning rate when the snapshot began
  for (const Field& f : optimizer_fields(o.kind)) j.set(f.name, Json::number(current.*f.member));
  return j;
}

Json initializer_json(const InitializerConfig& i) {
  Json j = Json::object();
  j.set("type", Json::string(initializer_name(i.kind)));
  if (i.kind == InitializerKind::kUniform) {
    j.set("low", Json::number(i.a));
    j.set("high", Json::number(i.b));
  } else if (i.kind != InitializerKind::kZeros) {
    j.set("mean", Json::number(i.a));
    j.set("std", Json::number(i.b));
  }
  if (i.kind != InitializerKind::kZeros) j.set("seed", Json::unsigned_integer(i.seed));
  return j;
}

[[noreturn]] void bad(const std::string& what) { throw std::runtime_error(what); }

OptimizerConfig parse_optimizer(const Json& j) {
  OptimizerConfig o;
  const std::string type = j.member("type").as_string();
  bool known = false;
  for (auto k : {OptimizerKind::kSgd, OptimizerKind::kAdagrad, OptimizerKind::kRowWiseAdagrad,
                 OptimizerKind::kAdam, OptimizerKind::kFtrl}) {
    if (type == optimizer_name(k)) {
      o.kind = k;
      known = true;
    }
  }
  if (!known) bad("unknown optimizer in the header: " + type);
  const auto fields = optimizer_fields(o.kind);
  if (!j.find(fields[0].name)) bad("bad optimizer settings in the header: no learning rate");
  for (const Field& f : fields) {
    if (const Json* v = j.find(f.name)) {
      const double d = v->as_double();
      if (!std::isfinite(d) || d < 0.0) bad(std::string("bad optimizer settings: ") + f.name);
      o.*f.member = static_cast<float>(d);
    }
  }
  if (!(o.lr > 0.0f)) bad("bad optimizer settings in the header: learning rate");
  return o;
}

InitializerConfig parse_initializer(const Json& j) {
  InitializerConfig i;
  const std::string type = j.member("type").as_string();
  bool known = false;
  for (auto k : {InitializerKind::kZeros, InitializerKind::kUniform, InitializerKind::kNormal,
                 InitializerKind::kTruncatedNormal}) {
    if (type == initializer_name(k)) {
      i.kind = k;
      known = true;
    }
  }
  if (!known) bad("unknown initializer in the header: " + type);
  // Python's defaults when a field is absent (embstore/initializers.py).
  if (i.kind == InitializerKind::kUniform) {
    i.a = j.find("low") ? j.member("low").as_double() : -0.01;
    i.b = j.find("high") ? j.member("high").as_double() : 0.01;
  } else if (i.kind != InitializerKind::kZeros) {
    i.a = j.find("mean") ? j.member("mean").as_double() : 0.0;
    i.b = j.find("std") ? j.member("std").as_double() : 0.01;
  }
  if (i.kind != InitializerKind::kZeros && j.find("seed")) i.seed = j.member("seed").as_u64();
  return i;
}

}  // namespace

std::string new_checkpoint_id() {
  std::random_device rd;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  // The uuid4 version and variant nibbles, so the id is a valid uuid4 like Python's.
  buf[12] = '4';
  buf[16] = "89ab"[buf[16] % 4];
  return std::string(buf, 32);
}

Json make_header(const Table& table, const Snapshot& snap, const std::string& kind,
                 const std::string& checkpoint_id, const std::string& parent_id,
                 const TableLabel& label) {
  const TableConfig& c = table.config();
  Json t = Json::object();
  t.set("name", label.name ? Json::string(*label.name) : Json());
  t.set("dim", Json::unsigned_integer(c.dim));
  t.set("capacity", Json::unsigned_integer(c.capacity));
  t.set("num_shards", Json::unsigned_integer(table.num_shards()));
  t.set("num_threads", label.num_threads ? Json::unsigned_integer(*label.num_threads) : Json());
  t.set("eviction", Json::string(c.eviction == Eviction::kClock ? "clock" : "none"));
  t.set("optimizer", optimizer_json(c.optimizer, snap.lr()));
  t.set("initializer", initializer_json(c.initializer));
  if (c.admission.enabled()) {
    Json a = Json::object();
    a.set("type", Json::string("CountFilter"));
    a.set("min_count", Json::unsigned_integer(c.admission.min_count));
    a.set("width", Json::unsigned_integer(c.admission.width));
    a.set("depth", Json::unsigned_integer(c.admission.depth));
    t.set("admission", a);
  } else {
    t.set("admission", Json());
  }
  t.set("step", Json::unsigned_integer(snap.step()));
  t.set("step_tracking", Json::boolean(snap.step_tracking()));
  // Written only when set, as the Python writer did: older readers ignore it.
  if (label.padding_id) t.set("padding_id", Json::integer(*label.padding_id));

  Json layout = Json::array();
  for (const auto& [name, width, dtype] : state_layout(c.optimizer, c.dim)) {
    layout.push(
        Json::array({Json::string(name), Json::unsigned_integer(width), Json::string(dtype)}));
  }
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  Json h = Json::object();
  h.set("format", Json::string(kFormatName));
  h.set("version", Json::unsigned_integer(kFormatVersion));
  h.set("kind", Json::string(kind));
  h.set("checkpoint_id", Json::string(checkpoint_id));
  h.set("parent_id", parent_id.empty() ? Json() : Json::string(parent_id));
  h.set("created_unix", Json::number(now));
  h.set("embstore_version", Json::string(EMBSTORE_VERSION));
  h.set("consistency", Json::string("point-in-time"));
  h.set("table", t);
  h.set("row_width", Json::unsigned_integer(snap.row_width()));
  h.set("state_layout", layout);
  return h;
}

bool SavedTable::same_shape(const SavedTable& o) const noexcept {
  return config.dim == o.config.dim && row_width == o.row_width &&
         config.optimizer.kind == o.config.optimizer.kind &&
         state_layout(config.optimizer, config.dim) ==
             state_layout(o.config.optimizer, o.config.dim);
}

SavedTable parse_header(const FileReader& r) {
  const Json& h = r.header();
  SavedTable s;
  try {
    const Json& t = h.member("table");
    const Json& name = t.member("name");
    if (!name.is_null()) s.label.name = name.as_string();
    const Json& threads = t.member("num_threads");
    if (!threads.is_null()) s.label.num_threads = threads.as_u64();
    const Json* padding = t.find("padding_id");
    if (padding != nullptr && !padding->is_null()) {  // int64 or uint64 text: the same 64 bits
      const bool negative = padding->dump(true).front() == '-';
      s.label.padding_id = negative ? padding->as_i64() : static_cast<int64_t>(padding->as_u64());
    }
    TableConfig& c = s.config;
    c.dim = t.member("dim").as_u64();
    c.capacity = t.member("capacity").as_u64();
    c.num_shards = t.member("num_shards").as_u64();
    c.num_threads = s.label.num_threads.value_or(0);
    const std::string ev = t.member("eviction").as_string();
    if (ev != "clock" && ev != "none") bad("eviction " + ev);
    c.eviction = ev == "clock" ? Eviction::kClock : Eviction::kNone;
    c.optimizer = parse_optimizer(t.member("optimizer"));
    c.initializer = parse_initializer(t.member("initializer"));
    const Json& adm = t.member("admission");
    if (!adm.is_null()) {
      if (adm.member("type").as_string() != "CountFilter") bad("unknown admission");
      const uint64_t min_count = adm.member("min_count").as_u64();
      if (min_count > 1) {  // as the Python facade: min_count 1 is no filter
        c.admission.min_count = static_cast<uint32_t>(min_count);
        c.admission.width = adm.member("width").as_u64();
        c.admission.depth = adm.member("depth").as_u64();
      }
    }
    const uint64_t step = t.member("step").as_u64();
    if (step > 0xFFFFFFFFu) bad("step out of range");
    s.step = static_cast<uint32_t>(step);
    s.step_tracking = t.member("step_tracking").as_bool();
    s.row_width = h.member("row_width").as_u64();
    Layout layout;
    for (const Json& e : h.member("state_layout").items()) {
      const auto& it = e.items();
      if (it.size() != 3) bad("state_layout entry");
      layout.emplace_back(it[0].as_string(), it[1].as_u64(), it[2].as_string());
    }
    size_t width = c.dim;
    for (const auto& e : layout) width += std::get<1>(e);
    if (layout != state_layout(c.optimizer, c.dim) || s.row_width != width) {
      r.fail("corrupted header (state layout does not match the optimizer)");
    }
    s.kind = h.member("kind").as_string();
  } catch (const std::runtime_error& e) {
    if (dynamic_cast<const CheckpointError*>(&e) != nullptr) throw;
    r.fail(std::string("corrupted header (bad table configuration: ") + e.what() + ")");
  }
  if (s.kind != "full" && s.kind != "delta") {
    r.fail("corrupted header (unknown kind '" + s.kind + "')");
  }
  return s;
}

}  // namespace embstore::internal
