// File: tests/cpp/test_util.hpp
//
// Helpers shared by the C++ tests (test_*.cpp, stress_index.cpp): the array aliases the
// core's batch API takes, and random inputs.
#pragma once

#include <algorithm>  // std::sort
#include <cstddef>    // size_t
#include <cstdint>    // uint64_t, int64_t
#include <random>     // std::mt19937_64
#include <vector>     // std::vector

namespace embstore_test {

using Ids = std::vector<uint64_t>;
using Floats = std::vector<float>;
using Offsets = std::vector<int64_t>;

// Random CSR offsets for `n` ids in `bags` bags (some empty).
inline Offsets random_offsets(std::mt19937_64& rng, size_t n, size_t bags) {
  Offsets cuts(bags - 1);
  for (int64_t& c : cuts) c = static_cast<int64_t>(rng() % (n + 1));
  std::sort(cuts.begin(), cuts.end());
  Offsets off{0};
  off.insert(off.end(), cuts.begin(), cuts.end());
  off.push_back(static_cast<int64_t>(n));
  return off;
}

}  // namespace embstore_test
