#!/usr/bin/env bash
# Builds the C++ core and its tests (tests/cpp) three ways from the repository root and runs
# ctest in each build:
#   build/ctest  plain Release
#   build/asan   AddressSanitizer + UndefinedBehaviorSanitizer (any report fails the run)
#   build/tsan   ThreadSanitizer
# No Python is needed. Every build runs even when an earlier one fails; the exit status is
# non-zero if any configure, build or test failed.
#
# Usage: .ci/sanitizers.sh [ctest] [asan] [tsan]      (default: all three, in that order)
# Environment: JOBS (default 2); STRESS_SECONDS / STRESS_THREADS / STRESS_SEED (the
# stress_index arguments ctest passes; default 5 / 4 / 12345); TEST_CORE_ARGS / STRESS_ARGS
# (extra arguments, ;-separated, e.g. TEST_CORE_ARGS=-cross_shard STRESS_ARGS='--skip;cross-shard'
# to leave out a case while a known bug is open).
set -euo pipefail

cd "$(dirname "$0")/.."
mkdir -p build

JOBS="${JOBS:-2}"
STRESS_SECONDS="${STRESS_SECONDS:-5}"
STRESS_THREADS="${STRESS_THREADS:-4}"
STRESS_SEED="${STRESS_SEED:-12345}"

# Sanitizer runtime options: leaks are errors; the first ASan/UBSan/TSan report stops the
# process with a non-zero status so ctest sees the failure.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"

common=(
  -DEMBSTORE_BUILD_TESTS=ON
  -DEMBSTORE_BUILD_PYTHON=OFF
  -DEMBSTORE_STRESS_SECONDS="${STRESS_SECONDS}"
  -DEMBSTORE_STRESS_THREADS="${STRESS_THREADS}"
  -DEMBSTORE_STRESS_SEED="${STRESS_SEED}"
  -DEMBSTORE_TEST_CORE_ARGS="${TEST_CORE_ARGS:-}"
  -DEMBSTORE_STRESS_ARGS="${STRESS_ARGS:-}"
)

flavour_args() {
  case "$1" in
    ctest) echo "-DCMAKE_BUILD_TYPE=Release -DEMBSTORE_SANITIZE= -DCMAKE_CXX_FLAGS=" ;;
    # -fno-sanitize-recover: UBSan otherwise prints and continues (exit status 0).
    asan) echo "-DCMAKE_BUILD_TYPE=RelWithDebInfo -DEMBSTORE_SANITIZE=address,undefined -DCMAKE_CXX_FLAGS=-fno-sanitize-recover=undefined" ;;
    tsan) echo "-DCMAKE_BUILD_TYPE=RelWithDebInfo -DEMBSTORE_SANITIZE=thread -DCMAKE_CXX_FLAGS=" ;;
    *) echo "unknown build '$1' (expected ctest, asan or tsan)" >&2; return 1 ;;
  esac
}

builds=("$@")
if [ "${#builds[@]}" -eq 0 ]; then builds=(ctest asan tsan); fi

failed=()
summary=()
for name in "${builds[@]}"; do
  args="$(flavour_args "$name")"
  dir="build/${name}"
  echo "=== ${name}: configure + build (${dir}) ==="
  t0=$(date +%s)
  # shellcheck disable=SC2086  # $args is a list of -D flags without spaces inside them
  if ! cmake -S . -B "${dir}" "${common[@]}" ${args} >"${dir}.configure.log" 2>&1; then
    cat "${dir}.configure.log" >&2 || true
    failed+=("${name}: configure")
    continue
  fi
  if ! cmake --build "${dir}" -j "${JOBS}"; then
    failed+=("${name}: build")
    continue
  fi
  t1=$(date +%s)
  echo "=== ${name}: ctest ==="
  status=ok
  if ! (cd "${dir}" && ctest --output-on-failure); then
    failed+=("${name}: ctest")
    status=FAILED
  fi
  t2=$(date +%s)
  summary+=("${name}: build $((t1 - t0)) s, tests $((t2 - t1)) s, ${status}")
done

echo "=== summary ==="
for line in "${summary[@]}"; do echo "  ${line}"; done
if [ "${#failed[@]}" -ne 0 ]; then
  for f in "${failed[@]}"; do echo "  FAILED: ${f}"; done
  exit 1
fi
echo "  all passed"
