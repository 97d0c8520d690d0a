#include "embstore/route.hpp"

#include "embstore/validate.hpp"  // validate_offsets, validate_finite

namespace embstore {

void validate_route_requests(const std::vector<RouteRequest>& requests) {
  for (const RouteRequest& r : requests) {
    validate_offsets(r.offsets, r.num_bags, r.n, r.label);
    if (r.grads != nullptr) validate_finite(r.grads, r.num_bags * r.dim, "grads", r.label);
    if (r.weights != nullptr) validate_finite(r.weights, r.n, "weights", r.label);
  }
}

RoutePlan route_request(const RouteRequest& r, uint32_t num_routes, uint64_t salt, bool mean) {
  const size_t R = num_routes;
  RoutePlan p;
  std::vector<uint32_t> route(r.n);
  std::vector<int64_t> key_count(R, 0), bag_count(R, 0), last_bag(R, -1);
  // Pass 1: each id's route, and per route its ids and touched bags.
  for (size_t b = 0; b < r.num_bags; ++b) {
    const int64_t bag = static_cast<int64_t>(b);
    for (int64_t i = r.offsets[b]; i < r.offsets[b + 1]; ++i) {
      const uint32_t s = route_of(r.keys[i], salt, num_routes);
      route[static_cast<size_t>(i)] = s;
      ++key_count[s];
      if (last_bag[s] != bag) {
        last_bag[s] = bag;
        ++bag_count[s];
      }
    }
  }
  p.key_start.assign(R + 1, 0);
  p.bag_start.assign(R + 1, 0);
  for (size_t s = 0; s < R; ++s) {
    p.key_start[s + 1] = p.key_start[s] + key_count[s];
    p.bag_start[s + 1] = p.bag_start[s] + bag_count[s];
  }
  p.order.resize(r.n);
  p.keys.resize(r.n);
  if (r.weights != nullptr) p.weights.resize(r.n);
  if (mean) p.coef.resize(r.n);
  p.bags.resize(static_cast<size_t>(p.bag_start[R]));
  p.offsets.resize(static_cast<size_t>(p.bag_start[R]) + R);
  std::vector<int64_t> key_at(p.key_start.begin(), p.key_start.end() - 1);
  std::vector<int64_t> bag_at(p.bag_start.begin(), p.bag_start.end() - 1);
  last_bag.assign(R, -1);
  // Pass 2: scatter ids (in request order within each route) and open each touched bag.
  for (size_t b = 0; b < r.num_bags; ++b) {
    const int64_t bag = static_cast<int64_t>(b);
    const float size = static_cast<float>(r.offsets[b + 1] - r.offsets[b]);
    for (int64_t i = r.offsets[b]; i < r.offsets[b + 1]; ++i) {
      const uint32_t s = route[static_cast<size_t>(i)];
      if (last_bag[s] != bag) {
        last_bag[s] = bag;
        const size_t at = static_cast<size_t>(bag_at[s]++);
        p.bags[at] = bag;
        p.offsets[at + s] = key_at[s] - p.key_start[s];
      }
      const size_t k = static_cast<size_t>(key_at[s]++);
      p.order[k] = i;
      p.keys[k] = r.keys[i];
      const float w = r.weights != nullptr ? r.weights[i] : 1.0f;
      if (r.weights != nullptr) p.weights[k] = w;
      if (mean) p.coef[k] = w / size;  // as the apply kernel: c = c / count
    }
  }
  for (size_t s = 0; s < R; ++s) {
    p.offsets[static_cast<size_t>(p.bag_start[s + 1]) + s] = key_count[s];
  }
  return p;
}

void route_ids(const uint64_t* keys, size_t n, uint64_t salt, uint32_t num_routes,
               uint32_t* out) noexcept {
  for (size_t i = 0; i < n; ++i) out[i] = route_of(keys[i], salt, num_routes);
}

}  // namespace embstore
