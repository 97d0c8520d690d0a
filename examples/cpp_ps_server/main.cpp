// embstore_ps_server: the reference C++ parameter server.
//
//   embstore_ps_server [--host 127.0.0.1] [--port 50051] [--tables t0,...,t7] [--dim 32]
//                      [--capacity 131072] [--lr 0.01] [--core-threads 0] [--pollers 4]
//                      [--checkpoint-dir DIR]
//
// Tables as examples/ps/tables.json describes them (Adagrad, lr 0.01, eps 1e-8; Normal
// initializer, std 0.01, seed 0, like embstore.Table's defaults), or, when DIR holds a group
// checkpoint (MANIFEST.json), the tables loaded from it. Save requests write below DIR.
// Stops on SIGINT/SIGTERM.
#include <grpcpp/grpcpp.h>
#ifdef __GLIBC__
#include <malloc.h>  // mallopt
#endif

#include <atomic>    // std::atomic
#include <chrono>    // std::chrono::milliseconds
#include <csignal>   // std::signal
#include <cstdio>    // std::printf, std::fprintf
#include <cstdlib>   // std::strtod, std::strtoull
#include <cstring>   // std::strcmp
#include <exception>  // std::exception
#include <filesystem>  // std::filesystem
#include <memory>    // std::unique_ptr, std::make_unique
#include <sstream>   // std::stringstream
#include <string>    // std::string
#include <thread>    // std::this_thread::sleep_for
#include <utility>   // std::move
#include <vector>    // std::vector

#include "embstore/checkpoint.hpp"  // embstore::load_group
#include "service.hpp"

namespace {

std::atomic<bool> g_stop{false};

struct Options {
  std::string host = "127.0.0.1";
  int port = 50051;
  std::vector<std::string> tables = {"t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7"};
  size_t dim = 32;
  size_t capacity = 131072;
  float lr = 0.01f;
  size_t core_threads = 0;  // 0: the machine's hardware threads
  int pollers = 4;          // gRPC sync-server threads polling for calls (at most)
  std::string checkpoint_dir;  // "": Save writes where the request says
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--host")
      o->host = value;
    else if (flag == "--port")
      o->port = std::atoi(value.c_str());
    else if (flag == "--tables")
      o->tables = split(value);
    else if (flag == "--dim")
      o->dim = std::strtoull(value.c_str(), nullptr, 10);
    else if (flag == "--capacity")
      o->capacity = std::strtoull(value.c_str(), nullptr, 10);
    else if (flag == "--lr")
      o->lr = static_cast<float>(std::strtod(value.c_str(), nullptr));
    else if (flag == "--core-threads")
      o->core_threads = std::strtoull(value.c_str(), nullptr, 10);
    else if (flag == "--pollers")
      o->pollers = std::atoi(value.c_str());
    else if (flag == "--checkpoint-dir")
      o->checkpoint_dir = std::filesystem::absolute(value).lexically_normal().string();
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return false;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "every flag takes a value\n");
    return false;
  }
  return !o->tables.empty() && o->dim > 0 && o->capacity > 0 && o->pollers > 0;
}

std::vector<embstore_ps::NamedTable> make_tables(const Options& o) {
  std::vector<embstore_ps::NamedTable> tables;
  if (!o.checkpoint_dir.empty() &&
      std::filesystem::exists(std::filesystem::path(o.checkpoint_dir) / "MANIFEST.json")) {
    embstore::LoadOptions options;
    if (o.core_threads > 0) options.num_threads = o.core_threads;
    for (auto& [name, loaded] : embstore::load_group(o.checkpoint_dir, options)) {
      tables.emplace_back(name, std::move(loaded.table));
    }
    return tables;
  }
  for (const auto& name : o.tables) {
    embstore::TableConfig cfg;
    cfg.dim = o.dim;
    cfg.capacity = o.capacity;
    cfg.num_threads = o.core_threads;
    cfg.optimizer.kind = embstore::OptimizerKind::kAdagrad;
    cfg.optimizer.lr = o.lr;
    cfg.initializer = {embstore::InitializerKind::kNormal, 0.0, 0.01, 0};
    tables.emplace_back(name, std::make_unique<embstore::Table>(cfg));
  }
  return tables;
}

}  // namespace

int main(int argc, char** argv) {
#ifdef __GLIBC__
  // Keep freed message buffers (MiB each) in the heap: else every call maps, faults in and
  // zeroes them afresh (docs/tuning.md, "PS: keep freed message buffers").
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
  mallopt(M_TOP_PAD, 16 << 20);
#endif
  Options o;
  if (!parse(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: %s [--host H] [--port P] [--tables a,b] [--dim D] "
                 "[--capacity N] [--lr LR] [--core-threads N] [--pollers N] "
                 "[--checkpoint-dir DIR]\n",
                 argv[0]);
    return 2;
  }
  std::vector<embstore_ps::NamedTable> tables;
  try {
    tables = make_tables(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cannot load %s: %s\n", o.checkpoint_dir.c_str(), e.what());
    return 1;
  }
  embstore_ps::Service service(std::move(tables), o.checkpoint_dir);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(o.host + ":" + std::to_string(o.port), grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(256 << 20);  // W1's push is 3.2 MiB; gRPC's default 4 MiB
  builder.SetMaxSendMessageSize(256 << 20);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, o.pollers);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "could not listen on %s:%d\n", o.host.c_str(), o.port);
    return 1;
  }
  std::printf("embstore_ps_server: %zu tables on %s:%d\n", service.num_tables(), o.host.c_str(),
              port);
  std::fflush(stdout);
  std::signal(SIGINT, [](int) { g_stop = true; });
  std::signal(SIGTERM, [](int) { g_stop = true; });
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
