// File: tests/cpp/test_route.cpp
//
// The route kernel (embstore/route.hpp): route_of against the 128-bit product it stands for,
// count_routes + fill_routes (and split_two_routes) against a direct per-route reconstruction of
// random batches (with duplicates, empty bags, weights and mean coefficients); the reduce of the
// routes' partial sums against a part-by-part sum.
#include <algorithm>  // std::equal
#include <cstdint>   // uint64_t, int64_t
#include <cstdio>    // std::printf, std::fprintf
#include <random>    // std::mt19937_64
#include <stdexcept>  // std::invalid_argument
#include <string>     // std::string
#include <vector>    // std::vector

#include "embstore/hash.hpp"   // splitmix64
#include "embstore/route.hpp"        // route_of, count_routes, fill_routes
#include "embstore/thread_pool.hpp"  // ThreadPool
#include "test_util.hpp"       // random_offsets

namespace {

int failures = 0;

void check(bool ok, const char* what, int line) {
  if (!ok) {
    std::fprintf(stderr, "test_route.cpp:%d: check failed: %s\n", line, what);
    ++failures;
  }
}
#define CHECK(cond) check((cond), #cond, __LINE__)

void route_of_is_the_high_word_of_the_product() {
  std::mt19937_64 rng(1);
  for (int t = 0; t < 100000; ++t) {
    const uint64_t id = rng();
    const uint32_t n = t % 3 == 0 ? static_cast<uint32_t>(rng()) | 1u : 1 + t % 9;
    __extension__ const unsigned __int128 p =
        static_cast<unsigned __int128>(embstore::splitmix64(id ^ embstore::kRouteSalt)) * n;
    CHECK(embstore::route_of(id, embstore::kRouteSalt, n) == static_cast<uint32_t>(p >> 64));
  }
}

void split_matches_a_direct_reconstruction() {
  std::mt19937_64 rng(2);
  int dense_trials = 0, sparse_trials = 0, dense_one_pass = 0, sparse_one_pass = 0;
  for (int t = 0; t < 300; ++t) {
    // Odd trials: bags of ~8 ids over 2 routes, mostly dense.
    const size_t bags = 1 + rng() % 12, n = t % 2 == 1 ? 8 * bags : rng() % 80;
    const uint32_t R = t % 2 == 1 ? 2 : 1 + rng() % 4;
    embstore_test::Ids keys(n);
    for (uint64_t& k : keys) k = rng() % 25;  // duplicates
    const embstore_test::Offsets off = embstore_test::random_offsets(rng, n, bags);
    embstore_test::Floats w(n);
    for (float& x : w) x = static_cast<float>(rng() % 1000) / 7.0f;
    embstore::RouteRequest r;
    r.keys = keys.data();
    r.n = n;
    r.offsets = off.data();
    r.num_bags = bags;
    r.weights = w.data();
    std::vector<uint32_t> route(n);
    const embstore::RouteCounts c = embstore::count_routes(r, R, 7, route.data());
    std::vector<int64_t> order(n), sub_bags(c.num_bags()), sub_off(c.num_offsets());
    embstore_test::Ids out_keys(n);
    embstore_test::Floats out_w(n), coef(n);
    embstore::fill_routes(r, route.data(), c,
                          {order.data(), out_keys.data(), out_w.data(), coef.data(),
                           sub_bags.data(), sub_off.data()});
    {  // without positions (order == nullptr): the same split
      embstore_test::Ids keys0(n);
      std::vector<int64_t> bags0(c.num_bags()), off0(c.num_offsets());
      embstore::fill_routes(r, route.data(), c,
                            {nullptr, keys0.data(), nullptr, nullptr, bags0.data(), off0.data()});
      CHECK(keys0 == out_keys && bags0 == sub_bags && off0 == sub_off);
    }
    // Dense exactly when every route touches at least 7/8 of the bags.
    bool dense = bags > 0;
    for (uint32_t s = 0; s < R; ++s) {
      size_t touched = 0;
      for (size_t b = 0; b < bags; ++b) {
        bool hit = false;
        for (int64_t i = off[b]; i < off[b + 1]; ++i) hit |= embstore::route_of(keys[i], 7, R) == s;
        touched += hit;
      }
      dense = dense && touched * 8 >= bags * 7;
    }
    CHECK(c.dense == dense);
    ++(dense ? dense_trials : sparse_trials);
    for (uint32_t s = 0; s < R; ++s) {
      // Expected: this route's ids in request order, and the bags they touch.
      std::vector<int64_t> pos, touched;
      for (size_t b = 0; b < bags; ++b) {
        for (int64_t i = off[b]; i < off[b + 1]; ++i) {
          if (embstore::route_of(keys[i], 7, R) != s) continue;
          if (touched.empty() || touched.back() != static_cast<int64_t>(b)) touched.push_back(b);
          pos.push_back(i);
        }
      }
      if (c.dense) {  // every bag, touched or not
        touched.resize(bags);
        for (size_t b = 0; b < bags; ++b) touched[b] = static_cast<int64_t>(b);
      }
      const int64_t k0 = c.key_start[s], b0 = c.bag_start[s];
      CHECK(c.key_start[s + 1] - k0 == static_cast<int64_t>(pos.size()));
      CHECK(c.bag_start[s + 1] - b0 == static_cast<int64_t>(touched.size()));
      for (size_t j = 0; j < pos.size(); ++j) {
        CHECK(order[k0 + j] == pos[j]);
        CHECK(out_keys[k0 + j] == keys[pos[j]]);
        CHECK(out_w[k0 + j] == w[pos[j]]);
        int64_t b = 0;
        while (off[b + 1] <= pos[j]) ++b;
        CHECK(coef[k0 + j] == w[pos[j]] / static_cast<float>(off[b + 1] - off[b]));
      }
      const int64_t* so = sub_off.data() + b0 + s;
      CHECK(so[0] == 0 && so[touched.size()] == static_cast<int64_t>(pos.size()));
      for (size_t j = 0; j < touched.size(); ++j) {
        CHECK(sub_bags[b0 + j] == touched[j]);
        for (int64_t i = so[j]; i < so[j + 1]; ++i) {  // every id of sub-bag j is in bag j
          CHECK(off[touched[j]] <= pos[i] && pos[i] < off[touched[j] + 1]);
        }
      }
    }
    if (R == 2) {  // the one-pass split: the same counts and arrays
      std::vector<int64_t> order2(n), bags2(2 * bags), off2(2 * bags + 2);
      embstore_test::Ids keys2(n);
      embstore_test::Floats w2(n), coef2(n);
      const embstore::RouteCounts c2 = embstore::split_two_routes(
          r, 7, {order2.data(), keys2.data(), w2.data(), coef2.data(), bags2.data(), off2.data()});
      CHECK(c2.dense == c.dense && c2.key_start == c.key_start && c2.bag_start == c.bag_start);
      CHECK(order2 == order && keys2 == out_keys && w2 == out_w && coef2 == coef);
      CHECK(std::equal(sub_bags.begin(), sub_bags.end(), bags2.begin()));
      CHECK(std::equal(sub_off.begin(), sub_off.end(), off2.begin()));
      // Without positions (order == nullptr): the same split.
      embstore_test::Ids keys3(n);
      std::vector<int64_t> bags3(2 * bags), off3(2 * bags + 2);
      const embstore::RouteCounts c3 = embstore::split_two_routes(
          r, 7, {nullptr, keys3.data(), nullptr, nullptr, bags3.data(), off3.data()});
      CHECK(c3.key_start == c.key_start && c3.bag_start == c.bag_start && keys3 == out_keys);
      CHECK(bags3 == bags2 && off3 == off2);
      ++(c.dense ? dense_one_pass : sparse_one_pass);
    }
  }
  CHECK(dense_trials > 20 && sparse_trials > 20);  // both layouts exercised
  CHECK(dense_one_pass > 20 && sparse_one_pass > 10);
}

void many_requests_on_the_pool_match_one_by_one() {
  std::mt19937_64 rng(3);
  const size_t R = 7;
  const uint32_t routes = 3;
  std::vector<embstore_test::Ids> keys(R);
  std::vector<embstore_test::Offsets> offs(R);
  std::vector<embstore::RouteRequest> requests(R);
  size_t total = 0;
  for (size_t k = 0; k < R; ++k) {
    const size_t n = rng() % 5000, bags = 1 + rng() % 600;
    keys[k].resize(n);
    for (uint64_t& x : keys[k]) x = rng() % 3000;
    offs[k] = embstore_test::random_offsets(rng, n, bags);
    requests[k].keys = keys[k].data();
    requests[k].n = n;
    requests[k].offsets = offs[k].data();
    requests[k].num_bags = bags;
    total += n;
  }
  std::vector<uint32_t> route(total), one_route(total);
  const std::vector<embstore::RouteCounts> counts =
      embstore::count_routes_many(requests, routes, 7, route.data(), 2);
  std::vector<std::vector<int64_t>> order(R), bags(R), off(R);
  std::vector<embstore_test::Ids> out_keys(R);
  std::vector<embstore::RouteOutput> outputs(R);
  for (size_t k = 0; k < R; ++k) {
    order[k].resize(counts[k].num_keys());
    out_keys[k].resize(counts[k].num_keys());
    bags[k].resize(counts[k].num_bags());
    off[k].resize(counts[k].num_offsets());
    outputs[k] = {order[k].data(), out_keys[k].data(), nullptr,
                  nullptr,         bags[k].data(),     off[k].data()};
  }
  embstore::fill_routes_many(requests, route.data(), counts, outputs, 2);
  size_t first = 0;
  for (size_t k = 0; k < R; ++k) {
    const embstore::RouteCounts c =
        embstore::count_routes(requests[k], routes, 7, one_route.data() + first);
    CHECK(c.key_start == counts[k].key_start && c.bag_start == counts[k].bag_start);
    std::vector<int64_t> o(c.num_keys()), b(c.num_bags()), f(c.num_offsets());
    embstore_test::Ids ks(c.num_keys());
    embstore::fill_routes(requests[k], one_route.data() + first, c,
                          {o.data(), ks.data(), nullptr, nullptr, b.data(), f.data()});
    CHECK(o == order[k] && ks == out_keys[k] && b == bags[k] && f == off[k]);
    first += requests[k].n;
  }
  CHECK(route == one_route);
}

void validation_raises_the_batch_calls_errors() {
  const uint64_t keys[3] = {1, 2, 3};
  const int64_t bad[2] = {0, 2};
  embstore::RouteRequest r;
  r.keys = keys;
  r.n = 3;
  r.offsets = bad;
  r.num_bags = 1;
  r.label = "u";
  bool thrown = false;
  try {
    embstore::validate_route_requests({r});
  } catch (const std::invalid_argument& e) {
    thrown = std::string(e.what()).rfind("table 'u': offsets[-1] must equal len(keys)=3", 0) == 0;
  }
  CHECK(thrown);
}

// split_two_routes_many on two threads (each with its own scratch) against
// split_two_routes one request at a time.
void two_routes_on_the_pool_match_one_by_one() {
  std::mt19937_64 rng(4);
  const size_t R = 9;
  std::vector<embstore_test::Ids> keys(R);
  std::vector<embstore_test::Offsets> offs(R);
  std::vector<embstore::RouteRequest> requests(R);
  for (size_t k = 0; k < R; ++k) {
    // Every third request has bags of 8 ids (a dense split), the others random bags.
    const size_t bags = 1 + rng() % 600, n = k % 3 == 0 ? 8 * bags : rng() % 3000;
    keys[k].resize(n);
    for (uint64_t& x : keys[k]) x = rng() % 3000;
    if (k % 3 == 0) {
      offs[k].resize(bags + 1);
      for (size_t b = 0; b <= bags; ++b) offs[k][b] = static_cast<int64_t>(8 * b);
    } else {
      offs[k] = embstore_test::random_offsets(rng, n, bags);
    }
    requests[k].keys = keys[k].data();
    requests[k].n = n;
    requests[k].offsets = offs[k].data();
    requests[k].num_bags = bags;
  }
  // Outputs at their largest size, filled with a marker: both runs must write the same.
  const auto outputs_for = [&](std::vector<std::vector<int64_t>>& ints,
                               std::vector<embstore_test::Ids>& ks) {
    std::vector<embstore::RouteOutput> outs(R);
    ints.assign(3 * R, {});
    ks.assign(R, {});
    for (size_t k = 0; k < R; ++k) {
      const size_t n = requests[k].n, nb = requests[k].num_bags;
      ints[3 * k].assign(n, -7);
      ints[3 * k + 1].assign(2 * nb, -7);
      ints[3 * k + 2].assign(2 * nb + 2, -7);
      ks[k].assign(n, 7);
      outs[k] = {ints[3 * k].data(),     ks[k].data(),          nullptr, nullptr,
                 ints[3 * k + 1].data(), ints[3 * k + 2].data()};
    }
    return outs;
  };
  std::vector<std::vector<int64_t>> ints_pool, ints_one;
  std::vector<embstore_test::Ids> keys_pool, keys_one;
  const std::vector<embstore::RouteOutput> pool_out = outputs_for(ints_pool, keys_pool);
  const std::vector<embstore::RouteOutput> one_out = outputs_for(ints_one, keys_one);
  embstore::ThreadPool::global().ensure_helpers(1);
  const std::vector<embstore::RouteCounts> counts =
      embstore::split_two_routes_many(requests, 7, pool_out, 2);
  int dense = 0;
  for (size_t k = 0; k < R; ++k) {
    const embstore::RouteCounts c = embstore::split_two_routes(requests[k], 7, one_out[k]);
    CHECK(c.dense == counts[k].dense && c.key_start == counts[k].key_start &&
          c.bag_start == counts[k].bag_start);
    dense += c.dense;
  }
  CHECK(ints_pool == ints_one && keys_pool == keys_one);
  CHECK(dense > 0 && dense < static_cast<int>(R));  // both layouts
}

// reduce_partials_many against sums added one part at a time, in order: parts over every
// bag or over random subsets (empty ones included), a first part that is the output itself,
// on the pool (two workers) and on the caller.
void reduce_matches_parts_added_in_order() {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  for (int round = 0; round < 50; ++round) {
    const size_t R = 1 + rng() % 6;
    std::vector<embstore::ReduceRequest> requests(R);
    std::vector<std::vector<float>> outs(R), want(R);
    std::vector<std::vector<std::vector<float>>> sums(R);
    std::vector<std::vector<std::vector<int64_t>>> bags(R);
    for (size_t k = 0; k < R; ++k) {
      embstore::ReduceRequest& r = requests[k];
      r.num_bags = rng() % 300;
      r.dim = 1 + rng() % 40;
      const size_t P = rng() % 4, floats = r.num_bags * r.dim;
      sums[k].resize(P);
      bags[k].resize(P);
      want[k].assign(floats, 0.0f);
      const bool in_place = P > 0 && rng() % 2 == 0;
      for (size_t p = 0; p < P; ++p) {
        embstore::PartialSums part;
        part.every_bag = (p == 0 && in_place) || rng() % 2 == 0;
        if (!part.every_bag) {
          for (size_t b = 0; b < r.num_bags; ++b) {
            if (rng() % 3 == 0) bags[k][p].push_back(static_cast<int64_t>(b));
          }
        }
        const size_t rows = part.every_bag ? r.num_bags : bags[k][p].size();
        for (size_t j = 0; j < rows * r.dim; ++j) sums[k][p].push_back(value(rng));
        for (size_t j = 0; j < rows; ++j) {
          const size_t b = part.every_bag ? j : static_cast<size_t>(bags[k][p][j]);
          for (size_t d = 0; d < r.dim; ++d) {
            float& w = want[k][b * r.dim + d];
            w = p == 0 && part.every_bag ? sums[k][p][j * r.dim + d]
                                         : w + sums[k][p][j * r.dim + d];
          }
        }
        part.bags = bags[k][p].data();
        part.count = bags[k][p].size();
        part.sums = sums[k][p].data();
        r.parts.push_back(part);
      }
      outs[k].assign(floats, 7.0f);  // the reduce writes every value
      r.out = in_place ? sums[k][0].data() : outs[k].data();
    }
    embstore::ThreadPool::global().ensure_helpers(1);
    embstore::reduce_partials_many(requests, round % 2 == 0 ? 2 : 1);  // the pool, or not
    for (size_t k = 0; k < R; ++k) {
      const float* got = requests[k].out;
      bool same = true;
      for (size_t j = 0; j < want[k].size(); ++j) same = same && got[j] == want[k][j];
      CHECK(same);
    }
  }
}

}  // namespace

int main() {
  route_of_is_the_high_word_of_the_product();
  split_matches_a_direct_reconstruction();
  many_requests_on_the_pool_match_one_by_one();
  validation_raises_the_batch_calls_errors();
  two_routes_on_the_pool_match_one_by_one();
  reduce_matches_parts_added_in_order();
  if (failures != 0) {
    std::fprintf(stderr, "test_route: %d checks failed\n", failures);
    return 1;
  }
  std::printf("test_route: ok\n");
  return 0;
}
