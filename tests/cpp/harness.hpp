// File: tests/cpp/harness.hpp
//
// The C++ tests' harness (no framework: the build must work offline): CHECK macros that
// abort a case with file:line, and the registry TEST_CASE adds each case to. test_main.cpp
// runs the registered cases; every tests/cpp/test_*.cpp file adds its own.
#pragma once

#include <algorithm>   // std::shuffle, std::find, std::count
#include <atomic>      // std::atomic
#include <chrono>      // std::chrono
#include <cmath>       // std::sqrt, std::log, std::cos, std::sin, std::isnan, std::fabs
#include <cstdint>     // uint64_t, int64_t, uintptr_t
#include <cstdio>      // std::printf, std::fprintf
#include <cstdlib>     // std::exit
#include <cstring>     // std::memcmp, std::strcmp, std::strstr
#include <exception>   // std::exception
#include <functional>  // std::function
#include <limits>      // std::numeric_limits
#include <map>         // std::map
#include <memory>      // std::unique_ptr
#include <random>      // std::mt19937_64
#include <set>         // std::set
#include <stdexcept>   // std::invalid_argument, std::runtime_error
#include <string>      // std::string
#include <thread>      // std::thread
#include <vector>      // std::vector

namespace embstore_test {

struct CheckFailure {};  // thrown by CHECK; deliberately not a std::exception

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  throw CheckFailure{};
}

struct TestCase {
  const char* name;
  void (*fn)();
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> cases;
  return cases;
}

struct Register {
  Register(const char* name, void (*fn)()) { registry().push_back({name, fn}); }
};

}  // namespace embstore_test

// Aborts the current test case, printing file:line and the failing expression.
#define CHECK(cond)                                                \
  do {                                                             \
    if (!(cond)) ::embstore_test::fail(__FILE__, __LINE__, #cond); \
  } while (0)

// CHECK with a message (a std::string expression) appended to the report.
#define CHECK_MSG(cond, msg)                                                      \
  do {                                                                            \
    if (!(cond)) {                                                                \
      ::embstore_test::fail(__FILE__, __LINE__,                                   \
                            std::string(#cond) + "  [" + std::string(msg) + "]"); \
    }                                                                             \
  } while (0)

// Expects `stmt` to throw `type` (or a subclass); any other exception fails the check.
#define CHECK_THROWS(type, stmt)                                                               \
  do {                                                                                         \
    bool caught_ = false;                                                                      \
    try {                                                                                      \
      stmt;                                                                                    \
    } catch (const type&) {                                                                    \
      caught_ = true;                                                                          \
    } catch (const std::exception& e_) {                                                       \
      ::embstore_test::fail(__FILE__, __LINE__,                                                \
                            std::string(#stmt) + " threw another exception: " + e_.what());    \
    }                                                                                          \
    if (!caught_) {                                                                            \
      ::embstore_test::fail(__FILE__, __LINE__, std::string(#stmt) + " did not throw " #type); \
    }                                                                                          \
  } while (0)

// Element-wise bitwise float equality, reporting the first mismatch with its values.
#define CHECK_FLOATS_EQ(a, b) ::embstore_test::check_floats_eq(__FILE__, __LINE__, #a, #b, (a), (b))
// Bit-for-bit equality.
#define CHECK_BITS_EQ(a, b) ::embstore_test::check_bits_eq(__FILE__, __LINE__, #a, #b, (a), (b))

#define TEST_CASE(name)                                           \
  static void name();                                             \
  static ::embstore_test::Register register_##name(#name, &name); \
  static void name()

namespace embstore_test {

inline void check_floats_eq(const char* file, int line, const char* an, const char* bn,
                            const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) {
    fail(file, line,
         std::string(an) + " == " + bn + ": sizes " + std::to_string(a.size()) +
             " != " + std::to_string(b.size()));
  }
  for (size_t i = 0; i < a.size(); ++i) {
    // Bit for bit (docs/semantics.md: a float32 implementation of the documented lines
    // reproduces the core's results exactly, signs of zeros included).
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, ": first mismatch at [%zu]: %.9g != %.9g (of %zu)", i,
                    static_cast<double>(a[i]), static_cast<double>(b[i]), a.size());
      fail(file, line, std::string(an) + " == " + bn + buf);
    }
  }
}

inline void check_bits_eq(const char* file, int line, const char* an, const char* bn,
                          const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() ||
      (!a.empty() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0)) {
    size_t i = 0;
    while (i < a.size() && i < b.size() && std::memcmp(&a[i], &b[i], sizeof(float)) == 0) {
      ++i;
    }
    fail(file, line,
         std::string(an) + " bitwise== " + bn + ": first difference at element " +
             std::to_string(i));
  }
}

}  // namespace embstore_test
