#include "embstore/scoped_timer.hpp"

#include <map>        // std::map
#include <memory>     // std::unique_ptr
#include <mutex>      // std::mutex
#include <stdexcept>  // std::invalid_argument

namespace embstore::metrics {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, std::unique_ptr<LatencyHistogram>> by_name;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: timers may record during exit
  return *r;
}

}  // namespace

LatencyHistogram& histogram(const std::string& name) {
  const size_t dot = name.find('.');
  if (dot == std::string::npos || dot == 0 || dot + 1 == name.size()) {
    throw std::invalid_argument(
        "name: a timer is named '<layer>.<name>' (e.g. "
        "'server.Lookup.Handle'), got '" +
        name + "'");
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto& slot = r.by_name[name];
  if (!slot) slot = std::make_unique<LatencyHistogram>();
  return *slot;
}

std::vector<std::pair<std::string, HistogramSnapshot>> snapshot_all() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::pair<std::string, HistogramSnapshot>> out;
  out.reserve(r.by_name.size());
  for (const auto& [name, h] : r.by_name) out.emplace_back(name, h->snapshot());
  return out;
}

void reset_all() noexcept {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& entry : r.by_name) entry.second->reset();
}

}  // namespace embstore::metrics
