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

// The route of `id` in [0, num_routes): the high word of splitmix64(id ^ salt) * num_routes,
// from 32-bit halves (no 128-bit type; exact, and no overflow since num_routes < 2^32).
inline uint32_t route_of(uint64_t id, uint64_t salt, uint32_t num_routes) noexcept {
  const uint64_t h = splitmix64(id ^ salt);
  const uint64_t low = ((h & 0xFFFFFFFFULL) * num_routes) >> 32;
  return static_cast<uint32_t>(((h >> 32) * num_routes + low) >> 32);
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

// Runs the checks a batch call runs (offsets, then grads, then weights finite), request by
// request; throws the first error, exactly as the batch call would.
void validate_route_requests(const std::vector<RouteRequest>& requests);

// A request split by route, in two passes so the caller can allocate the outputs between
// them (count_routes, then fill_routes). Route r holds the ids at positions
// order[key_start[r]:key_start[r+1]] of the request (in request order) and its bags,
// bags[bag_start[r]:bag_start[r+1]] (increasing), as its own CSR batch: its keys (and
// weights, coef) are the same slices of `keys` (`weights`, `coef`), and its offsets,
// relative to its first key, are offsets[bag_start[r] + r : bag_start[r+1] + r + 1].
// A route's bags are those with at least one of its ids; or, when every route touches at
// least kDenseNumerator / kDenseDenominator of the bags (`dense`, usual when bags hold
// several ids), every bag of the request, empty ones included: then each route's partial
// sums cover the whole batch (added without a scatter) and an apply takes the bag gradients
// as they are (no gather), for at most 1/8 more rows of partial sums.
constexpr size_t kDenseNumerator = 7;
constexpr size_t kDenseDenominator = 8;
struct RouteCounts {
  std::vector<int64_t> key_start;  // [num_routes + 1]
  std::vector<int64_t> bag_start;  // [num_routes + 1]
  bool dense = false;              // every route holds every bag
  size_t num_keys() const { return static_cast<size_t>(key_start.back()); }
  size_t num_bags() const { return static_cast<size_t>(bag_start.back()); }
  size_t num_offsets() const { return num_bags() + key_start.size() - 1; }
};

struct RouteOutput {
  int64_t* order;    // [num_keys], or nullptr: not wanted (only an exact lookup reads it)
  uint64_t* keys;    // [num_keys]
  float* weights;    // [num_keys] or nullptr (needs request weights)
  float* coef;       // [num_keys] or nullptr: an apply's factor per id in mean mode,
                // (weight or 1) / bag size, the apply kernel's float32 division
  int64_t* bags;  // [num_bags]
  int64_t* offsets;  // [num_offsets]
};

// Pass 1 over a valid request: each id's route into route[0, n), and the counts per route.
RouteCounts count_routes(const RouteRequest& request, uint32_t num_routes, uint64_t salt,
                         uint32_t* route);
// Pass 2: scatters the request into `out` by the routes of pass 1.
void fill_routes(const RouteRequest& request, const uint32_t* route, const RouteCounts& counts,
                 const RouteOutput& out);

// count_routes + fill_routes in one pass for two routes: the same RouteCounts and outputs,
// into outputs sized for the most a request can need: n keys (order, weights, coef alike),
// 2 * num_bags bags and 2 * num_bags + 2 offsets, of which the counts say how many are used.
RouteCounts split_two_routes(const RouteRequest& request, uint64_t salt, const RouteOutput& out);

// Whether to split `requests` with split_two_routes: two routes, and bags of at least
// kOnePassIdsPerBag ids on average. With one id a bag the sparse split's second pass over
// every bag's offsets costs more than the count pass it saves (docs/tuning.md, "Route
// kernel: two routes in one pass").
constexpr size_t kOnePassIdsPerBag = 2;
bool split_in_one_pass(const std::vector<RouteRequest>& requests, uint32_t num_routes);

// split_two_routes of every request, one task per request on up to `workers` threads of the
// global pool.
std::vector<RouteCounts> split_two_routes_many(const std::vector<RouteRequest>& requests,
                                               uint64_t salt,
                                               const std::vector<RouteOutput>& outputs,
                                               size_t workers);

// Below this many ids in all, a batch is routed on the calling thread alone (handing
// tasks to helper threads costs more than it saves).
constexpr size_t kParallelRouteIds = 32768;

// The threads to route `requests` on: one per request up to the machine's threads, or 1
// for a small batch; makes sure the global pool has the helpers.
size_t route_workers(const std::vector<RouteRequest>& requests);

// Where each request's routes start in a route array shared by all of them:
// [0, n_0, n_0 + n_1, ...] (requests.size() + 1 entries; the last is the total).
std::vector<size_t> route_starts(const std::vector<RouteRequest>& requests);

// count_routes / fill_routes of every request, one task per request on up to `workers`
// threads of the global pool; request k's routes live at route[route_starts(requests)[k]].
std::vector<RouteCounts> count_routes_many(const std::vector<RouteRequest>& requests,
                                           uint32_t num_routes, uint64_t salt, uint32_t* route,
                                           size_t workers);
void fill_routes_many(const std::vector<RouteRequest>& requests, const uint32_t* route,
                      const std::vector<RouteCounts>& counts,
                      const std::vector<RouteOutput>& outputs, size_t workers);

// out[bags[j]] += rows[j] for j in [0, count) (rows of `dim` floats): adds one route's
// partial pooled sums into the whole batch's. Bags must be < the rows of `out`.
void add_rows(float* out, size_t dim, const int64_t* bags, size_t count,
              const float* rows) noexcept;

// One route's partial pooled sums of a table: rows of `sums` for every bag of the batch in
// order (`every_bag`), or for the `count` bags in `bags`.
struct PartialSums {
  bool every_bag = false;
  const int64_t* bags = nullptr;
  size_t count = 0;
  const float* sums = nullptr;
};

// A table's pooled sums from its routes' parts: out = parts[0] + parts[1] + ... per bag, in
// route order. When parts[0] covers every bag, out starts as its values (out may be
// parts[0].sums itself: it is then added into in place); otherwise out starts as zeros.
struct ReduceRequest {
  float* out = nullptr;  // [num_bags, dim]
  size_t num_bags = 0;
  size_t dim = 0;
  std::vector<PartialSums> parts;
};

// Every request's reduce, one task per request on up to `workers` threads of the global pool.
// Bags must be < num_bags; an out must overlap no part of any request, except that it may
// be its own parts[0].sums exactly.
void reduce_partials_many(const std::vector<ReduceRequest>& requests, size_t workers);

// The threads to reduce `requests` on: one per request up to the machine's threads, or 1
// when they hold fewer than kParallelReduceFloats floats of output in all (makes sure the
// global pool has the helpers). The bound is of kParallelRouteIds' kind: handing a task over
// costs ~10 us, about what adding 256 KiB of partial sums takes.
constexpr size_t kParallelReduceFloats = 65536;
size_t reduce_workers(const std::vector<ReduceRequest>& requests);

// out[j] = rows[bags[j]] for j in [0, count): gathers the bag gradients of one route's bags.
// Bags must be < the rows of `rows`.
void gather_rows(float* out, size_t dim, const int64_t* bags, size_t count,
                 const float* rows) noexcept;

// out[i] = route_of(keys[i], salt, num_routes).
void route_ids(const uint64_t* keys, size_t n, uint64_t salt, uint32_t num_routes,
               uint32_t* out) noexcept;

}  // namespace embstore
