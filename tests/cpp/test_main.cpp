// File: tests/cpp/test_main.cpp
//
// The test_core executable: runs the unit tests of the embstore C++ core, which the
// test_*.cpp files beside it register, one file per area (arena and shard, CLOCK, table ops
// against a hand-written reference that follows docs/semantics.md, initializers, thread
// pool, admission and steps, snapshots, lock-free reads meeting a writer).
//
// Plain asserting executable (no test framework: the build must work offline). Usage:
//   test_core [--list] [NAME-SUBSTRING ...] [-EXCLUDED-NAME-SUBSTRING ...]
// runs every case (or those whose name contains a NAME-SUBSTRING, minus those containing an
// EXCLUDED one). Exit status 0 when every selected case passes.
//
// The tests also prove that a C++ parameter server can link the core without Python: the
// only non-standard headers they include are embstore/... headers.

#include "harness.hpp"

int main(int argc, char** argv) {
  using embstore_test::registry;
  std::vector<std::string> filters, excludes;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--list") == 0) {
      for (const auto& c : registry()) std::printf("%s\n", c.name);
      return 0;
    }
    if (argv[i][0] == '-' && argv[i][1] != '\0') {
      excludes.emplace_back(argv[i] + 1);
    } else {
      filters.emplace_back(argv[i]);
    }
  }
  int failed = 0, ran = 0;
  std::vector<std::string> failures;
  for (const auto& c : registry()) {
    bool selected = filters.empty();
    for (const std::string& f : filters) selected = selected || std::strstr(c.name, f.c_str());
    for (const std::string& f : excludes) selected = selected && !std::strstr(c.name, f.c_str());
    if (!selected) continue;
    ++ran;
    std::printf("[ RUN  ] %s\n", c.name);
    std::fflush(stdout);
    bool ok = false;
    try {
      c.fn();
      ok = true;
    } catch (const embstore_test::CheckFailure&) {
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: unexpected exception: %s\n", c.name, e.what());
    } catch (...) {
      std::fprintf(stderr, "%s: unexpected non-standard exception\n", c.name);
    }
    std::printf("[ %s ] %s\n", ok ? " OK " : "FAIL", c.name);
    std::fflush(stdout);
    if (!ok) {
      ++failed;
      failures.emplace_back(c.name);
    }
  }
  std::printf("%d of %d test cases passed\n", ran - failed, ran);
  for (const std::string& f : failures) std::printf("FAILED: %s\n", f.c_str());
  if (ran == 0) {
    std::fprintf(stderr, "no test case matched\n");
    return 2;
  }
  return failed == 0 ? 0 : 1;
}
