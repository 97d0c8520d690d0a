#include "embstore/route.hpp"

#include <algorithm>  // std::min
#include <cstring>    // std::memcpy, std::memset

#include "embstore/thread_pool.hpp"  // ThreadPool
#include "embstore/validate.hpp"     // validate_offsets, validate_finite

namespace embstore {

void validate_route_requests(const std::vector<RouteRequest>& requests) {
  for (const RouteRequest& r : requests) {
    validate_offsets(r.offsets, r.num_bags, r.n, r.label);
    if (r.grads != nullptr) validate_finite(r.grads, r.num_bags * r.dim, "grads", r.label);
    if (r.weights != nullptr) validate_finite(r.weights, r.n, "weights", r.label);
  }
}

namespace {

// Pass 1's per-id work, into key_count[s] and bag_count[s] (ids and bags on route s). Two
// routes keep their counters in registers: with counters in memory, consecutive ids on the
// same route chain through store-to-load forwarding (half of them at two routes).
void count_two(const RouteRequest& r, uint64_t salt, uint32_t* route, int64_t* key_count,
               int64_t* bag_count) {
  int64_t keys1 = 0, bags0 = 0, bags1 = 0;
  for (size_t b = 0; b < r.num_bags; ++b) {
    uint32_t any0 = 0, any1 = 0;
    for (int64_t i = r.offsets[b]; i < r.offsets[b + 1]; ++i) {
      const uint32_t s = route_of(r.keys[i], salt, 2);
      route[i] = s;
      keys1 += s;
      any1 |= s;
      any0 |= s ^ 1u;
    }
    bags0 += any0;
    bags1 += any1;
  }
  key_count[0] = r.offsets[r.num_bags] - r.offsets[0] - keys1;
  key_count[1] = keys1;
  bag_count[0] = bags0;
  bag_count[1] = bags1;
}

void count_any(const RouteRequest& r, uint32_t num_routes, uint64_t salt, uint32_t* route,
               int64_t* key_count, int64_t* bag_count) {
  std::vector<int64_t> last_bag(num_routes, -1);
  for (size_t b = 0; b < r.num_bags; ++b) {
    const int64_t bag = static_cast<int64_t>(b);
    for (int64_t i = r.offsets[b]; i < r.offsets[b + 1]; ++i) {
      const uint32_t s = route_of(r.keys[i], salt, num_routes);
      route[i] = s;
      ++key_count[s];
      bag_count[s] += last_bag[s] != bag;  // branch-free: which route comes next is random
      last_bag[s] = bag;
    }
  }
}

}  // namespace

RouteCounts count_routes(const RouteRequest& r, uint32_t num_routes, uint64_t salt,
                         uint32_t* route) {
  const size_t R = num_routes;
  std::vector<int64_t> key_count(R, 0), bag_count(R, 0);
  if (num_routes == 2) {
    count_two(r, salt, route, key_count.data(), bag_count.data());
  } else {
    count_any(r, num_routes, salt, route, key_count.data(), bag_count.data());
  }
  RouteCounts c;
  c.dense = r.num_bags > 0;
  for (size_t s = 0; s < R; ++s) {
    c.dense = c.dense &&
              static_cast<size_t>(bag_count[s]) * kDenseDenominator >= r.num_bags * kDenseNumerator;
  }
  c.key_start.assign(R + 1, 0);
  c.bag_start.assign(R + 1, 0);
  for (size_t s = 0; s < R; ++s) {
    c.key_start[s + 1] = c.key_start[s] + key_count[s];
    c.bag_start[s + 1] =
        c.bag_start[s] + (c.dense ? static_cast<int64_t>(r.num_bags) : bag_count[s]);
  }
  return c;
}

void fill_routes(const RouteRequest& r, const uint32_t* route, const RouteCounts& c,
                 const RouteOutput& out) {
  const size_t R = c.key_start.size() - 1;
  std::vector<int64_t> key_at(c.key_start.begin(), c.key_start.end() - 1);
  std::vector<int64_t> bag_at(c.bag_start.begin(), c.bag_start.end() - 1);
  std::vector<int64_t> last_bag(R, -1);
  // Two routes' key cursors live in registers (see count_two).
  int64_t at0 = key_at[0], at1 = R == 2 ? key_at[1] : 0;
  // Opens bag `bag`'s sub-bag on route s: its index and its offset (the route's next key).
  const auto open_bag = [&](size_t s, int64_t bag) {
    last_bag[s] = bag;
    const size_t at = static_cast<size_t>(bag_at[s]++);
    out.bags[at] = bag;
    const int64_t next = R == 2 ? (s == 0 ? at0 : at1) : key_at[s];
    out.offsets[at + s] = next - c.key_start[s];
  };
  for (size_t b = 0; b < r.num_bags; ++b) {
    const int64_t bag = static_cast<int64_t>(b);
    const float size = static_cast<float>(r.offsets[b + 1] - r.offsets[b]);
    if (c.dense) {  // every route opens every bag, empty or not
      for (size_t s = 0; s < R; ++s) open_bag(s, bag);
    }
    for (int64_t i = r.offsets[b]; i < r.offsets[b + 1]; ++i) {
      const uint32_t s = route[i];
      if (!c.dense && last_bag[s] != bag) open_bag(s, bag);  // the bag's first id on route s
      size_t k;
      if (R == 2) {
        k = static_cast<size_t>(s != 0 ? at1 : at0);
        at0 += static_cast<int64_t>(s ^ 1u);
        at1 += static_cast<int64_t>(s);
      } else {
        k = static_cast<size_t>(key_at[s]++);
      }
      if (out.order != nullptr) out.order[k] = i;
      out.keys[k] = r.keys[i];
      const float w = r.weights != nullptr ? r.weights[i] : 1.0f;
      if (out.weights != nullptr) out.weights[k] = w;
      if (out.coef != nullptr) out.coef[k] = w / size;
    }
  }
  for (size_t s = 0; s < R; ++s) {
    out.offsets[static_cast<size_t>(c.bag_start[s + 1]) + s] = c.key_start[s + 1] - c.key_start[s];
  }
}

namespace {

// split_two_routes keeps its per-thread scratch between calls up to this many ids.
constexpr size_t kKeepScratchIds = size_t{1} << 20;

// Route r's sub-bags, stored for every bag at offsets[at..at + num_bags] (offset of bag b's
// first id, then the route's id count), made sparse: only the bags the route touches, their
// indices into bags[bag_at...], their offsets moved down to offsets[to...]. Moving down
// (to <= at) overwrites only entries already read. Returns the number of bags kept.
int64_t keep_touched(int64_t* offsets, size_t at, size_t to, size_t num_bags, int64_t* bags) {
  int64_t kept = 0;
  for (size_t b = 0; b < num_bags; ++b) {
    const int64_t begin = offsets[at + b], end = offsets[at + b + 1];
    if (end == begin) continue;
    bags[kept] = static_cast<int64_t>(b);
    offsets[to + static_cast<size_t>(kept)] = begin;
    ++kept;
  }
  offsets[to + static_cast<size_t>(kept)] = offsets[at + num_bags];
  return kept;
}

}  // namespace

// Each id is written to both routes' next slots and only its own route's cursor advances
// (branch-free: which route comes next is random); route 0's slots are the output's, route
// 1's a scratch copied in after route 0's ids at the end. Both routes' offsets are written
// for every bag, then made sparse in place when the split is not dense.
RouteCounts split_two_routes(const RouteRequest& r, uint64_t salt, const RouteOutput& out) {
  const size_t nb = r.num_bags;
  thread_local std::vector<uint64_t> keys1;
  thread_local std::vector<int64_t> order1;
  thread_local std::vector<float> weights1, coef1;
  const auto grow = [n = r.n](auto& v) {  // never shrink: no zeroing of a regrown tail
    if (v.size() < n) v.resize(n);
  };
  grow(keys1);
  if (out.order != nullptr) grow(order1);
  if (out.weights != nullptr) grow(weights1);
  if (out.coef != nullptr) grow(coef1);
  int64_t* off0 = out.offsets;
  int64_t* off1 = out.offsets + nb + 1;
  int64_t at0 = 0, at1 = 0, bags0 = 0, bags1 = 0;
  for (size_t b = 0; b < nb; ++b) {
    off0[b] = at0;
    off1[b] = at1;
    const int64_t first0 = at0, first1 = at1;
    const float size = static_cast<float>(r.offsets[b + 1] - r.offsets[b]);
    for (int64_t i = r.offsets[b]; i < r.offsets[b + 1]; ++i) {
      const uint64_t key = r.keys[i];
      const int64_t s = route_of(key, salt, 2);
      out.keys[at0] = key;
      keys1[at1] = key;
      if (out.order != nullptr) {
        out.order[at0] = i;
        order1[at1] = i;
      }
      const float w = r.weights != nullptr ? r.weights[i] : 1.0f;
      if (out.weights != nullptr) out.weights[at0] = weights1[at1] = w;
      if (out.coef != nullptr) out.coef[at0] = coef1[at1] = w / size;
      at0 += 1 - s;
      at1 += s;
    }
    bags0 += at0 != first0;
    bags1 += at1 != first1;
  }
  off0[nb] = at0;
  off1[nb] = at1;
  const auto n1 = static_cast<size_t>(at1);
  std::memcpy(out.keys + at0, keys1.data(), n1 * sizeof(uint64_t));
  if (out.order != nullptr) std::memcpy(out.order + at0, order1.data(), n1 * sizeof(int64_t));
  if (out.weights != nullptr) std::memcpy(out.weights + at0, weights1.data(), n1 * sizeof(float));
  if (out.coef != nullptr) std::memcpy(out.coef + at0, coef1.data(), n1 * sizeof(float));
  if (keys1.capacity() > kKeepScratchIds) {  // a huge batch's scratch is not kept for good
    keys1 = {};
    order1 = {};
    weights1 = {};
    coef1 = {};
  }
  RouteCounts c;
  c.dense = nb > 0 && static_cast<size_t>(bags0) * kDenseDenominator >= nb * kDenseNumerator &&
            static_cast<size_t>(bags1) * kDenseDenominator >= nb * kDenseNumerator;
  c.key_start = {0, at0, at0 + at1};
  if (c.dense) {  // every route holds every bag: its offsets are where they were written
    for (size_t b = 0; b < nb; ++b) out.bags[b] = out.bags[nb + b] = static_cast<int64_t>(b);
    c.bag_start = {0, static_cast<int64_t>(nb), static_cast<int64_t>(2 * nb)};
  } else {
    const int64_t kept0 = keep_touched(out.offsets, 0, 0, nb, out.bags);
    const int64_t kept1 =
        keep_touched(out.offsets, nb + 1, static_cast<size_t>(kept0) + 1, nb, out.bags + kept0);
    c.bag_start = {0, kept0, kept0 + kept1};
  }
  return c;
}

bool split_in_one_pass(const std::vector<RouteRequest>& requests, uint32_t num_routes) {
  size_t ids = 0, bags = 0;
  for (const RouteRequest& r : requests) {
    ids += r.n;
    bags += r.num_bags;
  }
  return num_routes == 2 && ids >= kOnePassIdsPerBag * bags;
}

std::vector<RouteCounts> split_two_routes_many(const std::vector<RouteRequest>& requests,
                                               uint64_t salt,
                                               const std::vector<RouteOutput>& outputs,
                                               size_t workers) {
  std::vector<RouteCounts> counts(requests.size());
  ThreadPool::global().run(requests.size(), workers, [&](size_t k) {
    counts[k] = split_two_routes(requests[k], salt, outputs[k]);
  });
  return counts;
}

std::vector<size_t> route_starts(const std::vector<RouteRequest>& requests) {
  std::vector<size_t> first(requests.size() + 1, 0);
  for (size_t k = 0; k < requests.size(); ++k) first[k + 1] = first[k] + requests[k].n;
  return first;
}

namespace {

// One worker per task up to the machine's threads, or 1 when the work is too small to hand
// over; makes sure the global pool has the helpers.
size_t workers_for(size_t tasks, bool small) {
  if (tasks < 2 || small) return 1;
  const size_t workers = std::min(tasks, ThreadPool::hardware_threads());
  ThreadPool::global().ensure_helpers(workers - 1);
  return workers;
}

}  // namespace

size_t route_workers(const std::vector<RouteRequest>& requests) {
  size_t n = 0;
  for (const RouteRequest& r : requests) n += r.n;
  return workers_for(requests.size(), n < kParallelRouteIds);
}

std::vector<RouteCounts> count_routes_many(const std::vector<RouteRequest>& requests,
                                           uint32_t num_routes, uint64_t salt, uint32_t* route,
                                           size_t workers) {
  const std::vector<size_t> first = route_starts(requests);
  std::vector<RouteCounts> counts(requests.size());
  ThreadPool::global().run(requests.size(), workers, [&](size_t k) {
    counts[k] = count_routes(requests[k], num_routes, salt, route + first[k]);
  });
  return counts;
}

void fill_routes_many(const std::vector<RouteRequest>& requests, const uint32_t* route,
                      const std::vector<RouteCounts>& counts,
                      const std::vector<RouteOutput>& outputs, size_t workers) {
  const std::vector<size_t> first = route_starts(requests);
  ThreadPool::global().run(requests.size(), workers, [&](size_t k) {
    fill_routes(requests[k], route + first[k], counts[k], outputs[k]);
  });
}

void add_rows(float* out, size_t dim, const int64_t* bags, size_t count,
              const float* rows) noexcept {
  for (size_t j = 0; j < count; ++j) {
    float* __restrict dst = out + static_cast<size_t>(bags[j]) * dim;
    const float* __restrict src = rows + j * dim;
    for (size_t k = 0; k < dim; ++k) dst[k] = dst[k] + src[k];
  }
}

namespace {

// out = out + rows, element by element (out and rows do not overlap).
void add_into(float* __restrict out, const float* __restrict rows, size_t count) noexcept {
  for (size_t k = 0; k < count; ++k) out[k] = out[k] + rows[k];
}

void reduce_partials(const ReduceRequest& r) {
  const size_t floats = r.num_bags * r.dim;
  size_t first = 0;
  if (!r.parts.empty() && r.parts[0].every_bag) {
    if (r.parts[0].sums != r.out) std::memcpy(r.out, r.parts[0].sums, floats * sizeof(float));
    first = 1;
  } else {
    std::memset(r.out, 0, floats * sizeof(float));
  }
  for (size_t p = first; p < r.parts.size(); ++p) {
    const PartialSums& part = r.parts[p];
    if (part.every_bag) {
      add_into(r.out, part.sums, floats);
    } else {
      add_rows(r.out, r.dim, part.bags, part.count, part.sums);
    }
  }
}

}  // namespace

void reduce_partials_many(const std::vector<ReduceRequest>& requests, size_t workers) {
  ThreadPool::global().run(requests.size(), workers,
                           [&](size_t k) { reduce_partials(requests[k]); });
}

size_t reduce_workers(const std::vector<ReduceRequest>& requests) {
  size_t floats = 0;
  for (const ReduceRequest& r : requests) floats += r.num_bags * r.dim;
  return workers_for(requests.size(), floats < kParallelReduceFloats);
}

void gather_rows(float* out, size_t dim, const int64_t* bags, size_t count,
                 const float* rows) noexcept {
  for (size_t j = 0; j < count; ++j) {
    std::memcpy(out + j * dim, rows + static_cast<size_t>(bags[j]) * dim, dim * sizeof(float));
  }
}

void route_ids(const uint64_t* keys, size_t n, uint64_t salt, uint32_t num_routes,
               uint32_t* out) noexcept {
  for (size_t i = 0; i < n; ++i) out[i] = route_of(keys[i], salt, num_routes);
}

}  // namespace embstore
