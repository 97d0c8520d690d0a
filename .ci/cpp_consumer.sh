#!/usr/bin/env bash
# Installs the C++ core to a temporary prefix (cmake --install), builds
# examples/cpp_consumer against it with find_package(embstore) and aggressive flags
# (-O3 -march=native -ffast-math), runs it (a multi-threaded save/load check), then has the
# Python package replay its fixed batches and compare bit for bit (tests/test_cpp_consumer.py;
# needs an importable embstore: the CI venv, or PYTHONPATH=src with a built _core).
#
# Usage: .ci/cpp_consumer.sh        Environment: JOBS (default 2), PYTHON (default python).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python}"
tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT

echo "=== core: configure, build, install to ${tmp}/prefix"
cmake -S . -B "${tmp}/core" -DCMAKE_BUILD_TYPE=Release -DEMBSTORE_BUILD_TESTS=OFF \
  -DEMBSTORE_BUILD_PYTHON=OFF >"${tmp}/core.log" 2>&1 || { cat "${tmp}/core.log"; exit 1; }
cmake --build "${tmp}/core" -j "${JOBS}"
cmake --install "${tmp}/core" --prefix "${tmp}/prefix" >/dev/null

echo "=== consumer: find_package(embstore), -O3 -march=native -ffast-math"
cmake -S examples/cpp_consumer -B "${tmp}/consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="${tmp}/prefix" -DCMAKE_CXX_FLAGS="-O3 -march=native -ffast-math" \
  >"${tmp}/consumer.log" 2>&1 || { cat "${tmp}/consumer.log"; exit 1; }
cmake --build "${tmp}/consumer" -j "${JOBS}"

echo "=== consumer: run"
mkdir -p "${tmp}/out"
(cd "${tmp}/out" && "${tmp}/consumer/cpp_consumer" "${tmp}/out")

echo "=== Python replays the consumer's batches (bit for bit)"
EMBSTORE_CPP_CONSUMER_OUT="${tmp}/out" "${PYTHON}" -m pytest tests/test_cpp_consumer.py -q \
  -p no:cacheprovider
