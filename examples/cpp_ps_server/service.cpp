#include "service.hpp"

#include <cerrno>     // ENOENT, EACCES, EPERM
#include <chrono>     // std::chrono::steady_clock
#include <cstdint>    // uint64_t, int64_t
#include <cstring>    // std::memcpy
#include <stdexcept>  // std::invalid_argument
#include <string>     // std::string
#include <system_error>   // std::system_error
#include <unordered_set>  // std::unordered_set

#include "embstore/checkpoint.hpp"    // embstore::save_group
#include "embstore/errors.hpp"        // embstore::CapacityError, CheckpointError
#include "embstore/scoped_timer.hpp"  // embstore::metrics::histogram, ScopedTimer
#include "save.hpp"                   // save_directory, save_group_delta

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

namespace embstore_ps {
namespace {

using embstore::metrics::ScopedTimer;

// A table name the server does not have (the Python client raises KeyError).
struct UnknownTable : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct LayerTimers {
  embstore::LatencyHistogram& queue;
  embstore::LatencyHistogram& decode;
  embstore::LatencyHistogram& handle;
  embstore::LatencyHistogram& encode;
};

LayerTimers& timers(bool lookup) {
  static LayerTimers l{embstore::metrics::histogram("server.Lookup.Queue"),
                       embstore::metrics::histogram("server.Lookup.Decode"),
                       embstore::metrics::histogram("server.Lookup.Handle"),
                       embstore::metrics::histogram("server.Lookup.Encode")};
  static LayerTimers p{embstore::metrics::histogram("server.PushGrad.Queue"),
                       embstore::metrics::histogram("server.PushGrad.Decode"),
                       embstore::metrics::histogram("server.PushGrad.Handle"),
                       embstore::metrics::histogram("server.PushGrad.Encode")};
  return lookup ? l : p;
}

// The client stamps CLOCK_MONOTONIC (steady_clock here) once encoded: same host only.
void record_queue(int64_t client_send_ns, embstore::LatencyHistogram& h) {
  if (client_send_ns <= 0 || !embstore::metrics_enabled()) return;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  if (now > client_send_ns) h.record(static_cast<uint64_t>(now - client_send_ns));
}

// A typed view of a bytes field: a pointer cast when aligned, else a copy into `scratch`.
template <typename T>
const T* view(const std::string& raw, const char* field, const std::string& table, size_t* n,
              std::vector<std::vector<uint64_t>>& scratch) {
  if (raw.size() % sizeof(T) != 0) {
    throw std::invalid_argument("features['" + table + "']: " + field + " is " +
                                std::to_string(raw.size()) + " bytes, not a whole number of " +
                                std::to_string(sizeof(T)) + "-byte values");
  }
  *n = raw.size() / sizeof(T);
  if (reinterpret_cast<uintptr_t>(raw.data()) % alignof(T) == 0) {
    return reinterpret_cast<const T*>(raw.data());
  }
  scratch.emplace_back((raw.size() + 7) / 8);
  std::memcpy(scratch.back().data(), raw.data(), raw.size());
  return reinterpret_cast<const T*>(scratch.back().data());
}

embstore::PoolMode pool_mode(int mode) {
  if (mode == embstore::ps::SUM) return embstore::PoolMode::kSum;
  if (mode == embstore::ps::MEAN) return embstore::PoolMode::kMean;
  throw std::invalid_argument("mode must be 'sum' or 'mean', got enum value " +
                              std::to_string(mode));
}

// The parts of one TableBatch both operations share.
struct Decoded {
  const uint64_t* keys;
  size_t n;
  const int64_t* offsets;
  size_t num_bags;
  const float* weights;
};

Decoded decode(const embstore::ps::TableBatch& tb, std::vector<std::vector<uint64_t>>& scratch) {
  Decoded d{};
  size_t num_offsets = 0, num_weights = 0;
  d.keys = view<uint64_t>(tb.keys(), "keys", tb.table(), &d.n, scratch);
  d.offsets = view<int64_t>(tb.offsets(), "offsets", tb.table(), &num_offsets, scratch);
  if (num_offsets == 0) {
    throw std::invalid_argument("offsets must hold at least one element (offsets[0] == 0)");
  }
  d.num_bags = num_offsets - 1;
  d.weights = nullptr;
  if (!tb.weights().empty()) {
    d.weights = view<float>(tb.weights(), "weights", tb.table(), &num_weights, scratch);
    if (num_weights != d.n) {
      throw std::invalid_argument("weights must have shape (" + std::to_string(d.n) +
                                  ",) like keys, got (" + std::to_string(num_weights) + ",)");
    }
  }
  return d;
}

void check_unique(std::unordered_set<std::string>& seen, const std::string& name) {
  if (!seen.insert(name).second) {
    throw std::invalid_argument("features['" + name + "']: the table appears twice in one request");
  }
}

// Runs `body`, turning the store's exceptions into the statuses the Python client maps back.
template <typename F>
grpc::Status guarded(grpc::ServerContext* ctx, F&& body) {
  const char* kind = "ValueError";
  grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
  std::string message;
  try {
    body();
    return grpc::Status::OK;
  } catch (const UnknownTable& e) {
    kind = "KeyError";
    message = e.what();
  } catch (const std::invalid_argument& e) {
    message = e.what();
  } catch (const embstore::CapacityError& e) {
    kind = "CapacityError";
    code = grpc::StatusCode::FAILED_PRECONDITION;
    message = e.what();
  } catch (const embstore::CheckpointError& e) {
    kind = "CheckpointError";
    code = grpc::StatusCode::FAILED_PRECONDITION;
    message = e.what();
  } catch (const std::system_error& e) {  // I/O: the Python server's OSError family
    const int err = e.code().value();
    kind = err == ENOENT                   ? "FileNotFoundError"
           : err == EACCES || err == EPERM ? "PermissionError"
                                           : "OSError";
    code = grpc::StatusCode::FAILED_PRECONDITION;
    message = e.what();
  } catch (const std::exception& e) {
    kind = "RuntimeError";
    code = grpc::StatusCode::INTERNAL;
    message = e.what();
  }
  ctx->AddTrailingMetadata("embstore-error", kind);
  return grpc::Status(code, message);
}

std::string histogram_bytes(const embstore::HistogramSnapshot& s) {
  return std::string(reinterpret_cast<const char*>(s.counts.data()), sizeof(s.counts));
}

void add_histogram(embstore::ps::StatsResponse* resp, const std::string& layer,
                   const std::string& table, const std::string& name,
                   const embstore::HistogramSnapshot& s) {
  auto* h = resp->add_histograms();
  h->set_layer(layer);
  h->set_table(table);
  h->set_name(name);
  h->set_counts(histogram_bytes(s));
  h->set_sum_ns(s.sum_ns);
  h->set_max_ns(s.max_ns);
  h->set_resets(s.resets);
}

}  // namespace

Service::Service(std::vector<NamedTable> tables, std::string checkpoint_dir)
    : tables_(std::move(tables)), checkpoint_dir_(std::move(checkpoint_dir)) {}

embstore::Table& Service::find(const std::string& name) const {
  for (const auto& [n, t] : tables_) {
    if (n == name) return *t;
  }
  std::string names;
  for (const auto& entry : tables_) names += (names.empty() ? "'" : ", '") + entry.first + "'";
  throw UnknownTable("unknown table '" + name + "'; the group has [" + names + "]");
}

grpc::Status Service::Lookup(grpc::ServerContext* ctx, const embstore::ps::LookupRequest* req,
                             embstore::ps::LookupResponse* resp) {
  LayerTimers& t = timers(true);
  record_queue(req->client_send_ns(), t.queue);
  return guarded(ctx, [&] {
    std::vector<std::vector<uint64_t>> scratch;
    std::vector<embstore::LookupSumRequest> batch;
    {
      ScopedTimer timed(t.decode);
      const embstore::PoolMode mode = pool_mode(req->mode());
      std::unordered_set<std::string> seen;
      batch.reserve(static_cast<size_t>(req->tables_size()));
      for (const auto& tb : req->tables()) {
        check_unique(seen, tb.table());
        embstore::Table& table = find(tb.table());
        const Decoded d = decode(tb, scratch);
        // The core pools straight into the reply's bytes: no intermediate buffer.
        std::string* out = resp->add_pooled();
        out->resize(d.num_bags * table.dim() * sizeof(float));
        resp->add_dims(static_cast<int64_t>(table.dim()));
        batch.push_back({&table, d.keys, d.n, d.offsets, d.num_bags, d.weights, mode, req->insert(),
                         reinterpret_cast<float*>(out->data()), tb.table()});
      }
    }
    ScopedTimer timed(t.handle);
    embstore::lookup_sum_many(batch, embstore::Timer::kGroupLookupSum);
  });
}

grpc::Status Service::PushGrad(grpc::ServerContext* ctx, const embstore::ps::PushGradRequest* req,
                               embstore::ps::PushGradResponse* /*resp*/) {
  LayerTimers& t = timers(false);
  record_queue(req->client_send_ns(), t.queue);
  return guarded(ctx, [&] {
    std::vector<std::vector<uint64_t>> scratch;
    std::vector<embstore::ApplyRequest> batch;
    {
      ScopedTimer timed(t.decode);
      const embstore::PoolMode mode = pool_mode(req->mode());
      std::unordered_set<std::string> seen;
      for (const auto& tb : req->tables()) {
        check_unique(seen, tb.table());
        embstore::Table& table = find(tb.table());
        const Decoded d = decode(tb, scratch);
        size_t num_grads = 0;
        const float* grads = view<float>(tb.grads(), "grads", tb.table(), &num_grads, scratch);
        if (num_grads != d.num_bags * table.dim()) {
          throw std::invalid_argument("grads must have shape (" + std::to_string(d.num_bags) +
                                      ", " + std::to_string(table.dim()) +
                                      ") (one row per bag), got " + std::to_string(num_grads) +
                                      " values");
        }
        batch.push_back(
            {&table, d.keys, d.n, grads, d.offsets, d.num_bags, d.weights, mode, tb.table()});
      }
    }
    ScopedTimer timed(t.handle);
    embstore::apply_gradients_many(batch, embstore::Timer::kGroupApplyGradients);
  });
}

grpc::Status Service::Save(grpc::ServerContext* ctx, const embstore::ps::SaveRequest* req,
                           embstore::ps::SaveResponse* /*resp*/) {
  static embstore::LatencyHistogram& handle = embstore::metrics::histogram("server.Save.Handle");
  return guarded(ctx, [&] {
    ScopedTimer timed(handle);
    const std::string directory = save_directory(checkpoint_dir_, req->dir());
    // Each table's snapshot is point-in-time: Lookups and PushGrads go on meanwhile.
    if (req->delta()) {
      save_group_delta(tables_, directory);
      return;
    }
    std::vector<std::pair<std::string, embstore::Table*>> group;
    for (const auto& [name, table] : tables_) group.emplace_back(name, table.get());
    embstore::save_group(group, directory);
  });
}

grpc::Status Service::Stats(grpc::ServerContext* /*ctx*/, const embstore::ps::StatsRequest*,
                            embstore::ps::StatsResponse* resp) {
  std::string json = "{";
  for (const auto& [name, table] : tables_) {
    auto* info = resp->add_tables();
    info->set_name(name);
    info->set_dim(static_cast<int64_t>(table->dim()));
    const embstore::TableStats s = table->stats();
    json += (json.size() > 1 ? ", \"" : "\"") + name + "\": {\"size\": " + std::to_string(s.size) +
            ", \"capacity\": " + std::to_string(s.capacity) +
            ", \"dim\": " + std::to_string(s.dim) + ", \"hits\": " + std::to_string(s.hits) +
            ", \"misses\": " + std::to_string(s.misses) +
            ", \"inserts\": " + std::to_string(s.inserts) +
            ", \"evictions\": " + std::to_string(s.evictions) + "}";
    const auto& timers_of = table->timers();
    for (size_t k = 0; k < timers_of.size(); ++k) {
      add_histogram(resp, "kv", name, embstore::timer_name(static_cast<embstore::Timer>(k)),
                    timers_of[k].snapshot());
    }
  }
  resp->set_tables_json(json + "}");
  for (const auto& [full, snap] : embstore::metrics::snapshot_all()) {
    const size_t dot = full.find('.');
    add_histogram(resp, full.substr(0, dot), "-", full.substr(dot + 1), snap);
  }
  return grpc::Status::OK;
}

grpc::Status Service::Ping(grpc::ServerContext*, const embstore::ps::PingRequest* req,
                           embstore::ps::PingResponse* resp) {
  constexpr int64_t kMaxReply = int64_t{128} << 20;  // below the 256 MiB message limit
  if (req->reply_bytes() < 0 || req->reply_bytes() > kMaxReply)
    return {grpc::StatusCode::INVALID_ARGUMENT, "reply_bytes must be in [0, 128 MiB]"};
  resp->mutable_payload()->resize(static_cast<size_t>(req->reply_bytes()));
  return grpc::Status::OK;
}

}  // namespace embstore_ps
