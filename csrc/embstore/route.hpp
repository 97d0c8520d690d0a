// File: embstore/route.hpp
//
// Routing of ids to N stores (processes or machines) that each hold a slice of every table,
// and the split of a pooled batch by route in one pass. The route is a salted multiply-shift
// of splitmix64: salting first makes it independent of mix64's bits, which a Table already
// uses for its own shards (high bits) and index slots (low bits); reusing either would leave
// each store filling 1/N of its internal shards or clustering its probes.
#pragma once

#include <cstddef>  // size_t
#include <cstdint>  // uint64_t, uint32_t, int64_t
#include <string>   // std::string
#include <vector>   // std::vector

#include "embstore/hash.hpp"  // splitmix64

namespace embstore {

// The salt of the documented route (recorded in sharded checkpoints with its name).
constexpr uint64_t kRouteSalt = 0xA0761D6478BD642FULL;

// The route of `id` in [0, num_routes): the high bits of (splitmix64(id ^ salt) * num_routes).
inline uint32_t route_of(uint64_t id, uint64_t salt, uint32_t num_routes) noexcept {
  const unsigned __int128 product =
      static_cast<unsigned __int128>(splitmix64(id ^ salt)) * num_routes;
  return static_cast<uint32_t>(product >> 64);
}

// One table's part of a batch, as a lookup or apply takes it.
struct RouteRequest {
  const uint64_t* keys = nullptr;
  size_t n = 0;
  const int64_t* offsets = nullptr;  // [num_bags + 1]
  size_t num_bags = 0;
  const float* weights = nullptr;  // [n] or nullptr
  const float* grads = nullptr;    // [num_bags, dim] or nullptr (only validated)
  size_t dim = 0;
  std::string label;  // the table's name, for errors
};

// A request split by route. Route r holds the ids order[key_start[r]:key_start[r+1]] (their
// positions in the request, in request order), and the bags with at least one of them,
// bags[bag_start[r]:bag_start[r+1]] (increasing), as its own CSR batch: its keys and weights
// are the same slices of `keys` and `weights`, and its offsets (relative to its first key)
// are offsets[bag_start[r] + r : bag_start[r + 1] + r + 1].
struct RoutePlan {
  std::vector<int64_t> order;
  std::vector<uint64_t> keys;
  std::vector<float> weights;  // empty without weights
  std::vector<float> coef;     // with `mean`: an apply's factor per id, (weight or 1) / bag size
  std::vector<int64_t> key_start;
  std::vector<int64_t> bags;
  std::vector<int64_t> bag_start;
  std::vector<int64_t> offsets;
};

// Runs the checks a batch call runs (offsets, then grads, then weights finite), request by
// request; throws the first error, exactly as the batch call would.
void validate_route_requests(const std::vector<RouteRequest>& requests);

// Splits a request by route (the request must be valid). `mean` fills coef as an apply in
// mean mode scales each id's bag gradient (the same float32 division).
RoutePlan route_request(const RouteRequest& request, uint32_t num_routes, uint64_t salt,
                        bool mean);

// out[i] = route_of(keys[i], salt, num_routes).
void route_ids(const uint64_t* keys, size_t n, uint64_t salt, uint32_t num_routes,
               uint32_t* out) noexcept;

}  // namespace embstore
