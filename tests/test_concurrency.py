"""Several Python threads on one table at once, checked with exact arithmetic.

Values are powers of two (Zeros init, SGD lr=1, gradients k * 2**-4) so every sum is exact
and the final state does not depend on the order the threads ran in. Each test prints its
seed (shown by pytest on failure); set EMBSTORE_TEST_SEED to replay one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import UNIFORM, Config, assert_rows_equal
from reference import SGDSpec, ZerosSpec, pool

import embstore

STEP = np.float32(2.0**-4)
THREADS = 4


def _seed(default: int) -> int:
    seed = int(os.environ.get("EMBSTORE_TEST_SEED", default))
    print(f"seed={seed}")
    return seed


def _run_threads(workers: list[Callable[[], None]]) -> None:
    """Starts every worker at once (barrier) and re-raises the first worker exception."""
    barrier = threading.Barrier(len(workers))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            barrier.wait()
            fn()

        return run

    with ThreadPoolExecutor(max_workers=len(workers)) as ex:
        futures = [ex.submit(wrap(w)) for w in workers]
        for f in futures:
            f.result()


def _summing_table(dim: int, capacity: int, num_shards: int) -> embstore.Table:
    """SGD(lr=1) on zero rows, 2 threads: every row is minus the sum of its gradients."""
    return Config(
        dim=dim,
        capacity=capacity,
        optimizer=SGDSpec(lr=1.0),
        initializer=ZerosSpec(),
        num_shards=num_shards,
        num_threads=2,
    ).table()


def _check_row_consistent(rows: np.ndarray, low: float) -> None:
    """Every row has equal elements (no half-applied update), is a multiple of STEP and
    lies in [low, 0]."""
    assert np.all(rows == rows[:, :1]), "torn row: elements of one row differ"
    assert np.all(rows <= 0)
    assert np.all(rows >= low)
    assert np.all(rows / STEP == np.round(rows / STEP))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_shards", [1, 16])
def test_concurrent_applies_are_exact(num_shards: int) -> None:
    """Threads applying per-id and pooled SGD updates (with duplicates and weights) while
    others read: every read is row-consistent and the final rows equal the exact total."""
    seed = _seed(1234 + num_shards)
    dim, universe, rounds = 64, 512, 60
    t = _summing_table(dim, 10_000, num_shards)
    counts = [np.zeros(universe, np.int64) for _ in range(THREADS)]
    stop = threading.Event()
    max_total = float(rounds * 400 * 4 * THREADS * STEP)

    def writer(w: int) -> Callable[[], None]:
        def run() -> None:
            rng = np.random.default_rng(seed + w)
            for r in range(rounds):
                keys = rng.integers(0, universe, size=200).astype(np.uint64)
                if r % 2 == 0:
                    mult = rng.integers(1, 4, size=200)
                    g = (mult * STEP)[:, None] * np.ones((1, dim), np.float32)
                    t.apply_gradients(keys, g.astype(np.float32))
                    np.add.at(counts[w], keys.astype(np.int64), mult)
                else:
                    off = np.sort(rng.integers(0, 201, size=21))
                    off[0], off[-1] = 0, 200
                    weights = rng.choice(np.array([1.0, 2.0, 0.5], np.float32), size=200)
                    # grads[b] = 2 * STEP; weights in {0.5, 1, 2}: contributions 1, 2, 4 STEP.
                    g = np.full((20, dim), 2 * STEP, np.float32)
                    t.apply_gradients(keys, g, offsets=off, weights=weights)
                    np.add.at(counts[w], keys.astype(np.int64), (2 * weights).astype(np.int64))

        return run

    def reader() -> None:
        rng = np.random.default_rng(seed - 1)
        while not stop.is_set():
            keys = rng.integers(0, universe, size=300).astype(np.uint64)
            _check_row_consistent(t.lookup(keys, insert=False), -max_total)
            off = np.array([0, 100, 300])
            pooled = t.lookup_sum(keys, off, insert=False)
            assert np.all(pooled == pooled[:, :1]), "torn row inside a pooled sum"

    def writers_then_stop() -> None:
        try:
            with ThreadPoolExecutor(THREADS) as ex:
                for f in [ex.submit(writer(w)) for w in range(THREADS)]:
                    f.result()
        finally:
            stop.set()

    _run_threads([writers_then_stop, reader, reader])
    total = np.sum(counts, axis=0)
    keys = np.arange(universe, dtype=np.uint64)
    want = -(total.astype(np.float32) * STEP)[:, None] * np.ones((1, dim), np.float32)
    present = np.asarray(total > 0)
    assert t.contains(keys).tolist() == present.tolist()
    assert_rows_equal(t.lookup(keys, insert=False), want.astype(np.float32), keys)
    assert len(t) == int(present.sum())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_shards", [1, 8])
def test_concurrent_churn_never_reads_another_ids_row(num_shards: int) -> None:
    """Threads inserting (with eviction), pooling, erasing and probing a small table: every
    row read is the id's own initial row (fingerprint), and len never exceeds capacity."""
    seed = _seed(99 + num_shards)
    dim, capacity, universe = 8, 128, 4000
    cfg = Config(dim=dim, capacity=capacity, initializer=UNIFORM, num_shards=num_shards)
    t = cfg.table(num_threads=2)
    ids = np.arange(universe, dtype=np.uint64)
    init = t.initial_values(ids)
    deadline = time.monotonic() + 4.0

    def worker(w: int) -> Callable[[], None]:
        def run() -> None:
            rng = np.random.default_rng(seed + w)
            while time.monotonic() < deadline:
                idx = rng.integers(0, universe, size=rng.integers(1, 300))
                keys = ids[idx]
                op = rng.integers(0, 4)
                if op == 0:
                    assert_rows_equal(t.lookup(keys), init[idx], keys)
                elif op == 1:
                    off = np.array([0, idx.shape[0] // 3, idx.shape[0]])
                    got = t.lookup_sum(keys, off)
                    assert_rows_equal(got, pool(init[idx], off))
                elif op == 2:
                    got = t.lookup(keys, insert=False)
                    hit = np.any(got != 0, axis=1)
                    assert_rows_equal(got[hit], init[idx][hit])
                else:
                    t.erase(keys[:5])
                    t.contains(keys)
                assert len(t) <= capacity

        return run

    _run_threads([worker(w) for w in range(THREADS)])
    present = t.contains(ids)
    assert 0 < present.sum() <= capacity
    assert present.sum() == len(t)
    assert_rows_equal(t.lookup(ids[present], insert=False), init[present])
    st = t.stats()
    assert st["inserts"] - st["evictions"] - st["erased"] == len(t)


@pytest.mark.timeout(120)
def test_concurrent_applies_with_eviction_stay_consistent() -> None:
    """Applies racing with evicting inserts on a small table: every row read is
    row-consistent (equal elements, a whole number of updates), never beyond the total."""
    seed = _seed(7)
    dim, capacity, universe, rounds = 32, 64, 400, 80
    t = _summing_table(dim, capacity, 4)
    max_total = float(rounds * 16 * THREADS * STEP)

    def writer(w: int) -> Callable[[], None]:
        def run() -> None:
            rng = np.random.default_rng(seed + w)
            for _ in range(rounds):
                keys = np.unique(rng.integers(0, universe, size=16)).astype(np.uint64)
                t.apply_gradients(keys, np.full((keys.shape[0], dim), STEP, np.float32))
                t.lookup(rng.integers(0, universe, size=16).astype(np.uint64))
                got = t.lookup(keys, insert=False)
                _check_row_consistent(got, -max_total)
                assert len(t) <= capacity

        return run

    _run_threads([writer(w) for w in range(THREADS)])
    ids = np.arange(universe, dtype=np.uint64)
    present = t.contains(ids)
    _check_row_consistent(t.lookup(ids[present], insert=False), -max_total)
    st = t.stats()
    assert st["inserts"] - st["evictions"] - st["erased"] == len(t) <= capacity


@pytest.mark.timeout(60)
def test_concurrent_eviction_none_raises_cleanly() -> None:
    """Threads filling an eviction='none' table get CapacityError (never a crash or an
    overfull table); rows present afterwards are intact."""
    seed = _seed(5)
    t = Config(dim=4, capacity=200, initializer=UNIFORM, num_shards=4, eviction="none").table()
    errors = [0] * THREADS

    def worker(w: int) -> Callable[[], None]:
        def run() -> None:
            rng = np.random.default_rng(seed + w)
            for _ in range(100):
                keys = rng.integers(0, 5000, size=10).astype(np.uint64)
                try:
                    t.lookup(keys)
                except embstore.CapacityError:
                    errors[w] += 1
                assert len(t) <= 200

        return run

    _run_threads([worker(w) for w in range(THREADS)])
    assert sum(errors) > 0
    ids = np.arange(5000, dtype=np.uint64)
    present = t.contains(ids)
    assert present.sum() == len(t) <= 200
    assert_rows_equal(t.lookup(ids[present], insert=False), t.initial_values(ids[present]))


@pytest.mark.parametrize("insert", [False, True])
def test_reads_racing_an_apply_are_redone_row_by_row(insert: bool) -> None:
    """A lookup whose lock-free pass a writer got in the way of redoes that part row by row
    (each row validated alone, or read under its shard lock) instead of falling back to the
    locked path for the whole batch: every row and every pooled sum stays consistent, and
    the rows are exact once the writer is done."""
    dim, universe, applies = 16, 40_000, 40
    t = _summing_table(dim, universe, 8)
    keys = np.arange(universe, dtype=np.uint64)
    t.lookup(keys)  # all present: the reads never need the locked path to insert
    off = np.arange(0, universe + 1, 4, dtype=np.int64)
    done = threading.Event()

    def writer() -> None:
        try:
            g = np.full((universe, dim), STEP, np.float32)
            for _ in range(applies):
                t.apply_gradients(keys, g)
        finally:
            done.set()

    th = threading.Thread(target=writer)
    th.start()
    reads = 0
    while not done.is_set() or reads == 0:
        pooled = t.lookup_sum(keys, off, insert=insert)
        assert np.all(pooled == pooled[:, :1]), "torn row inside a pooled sum"
        _check_row_consistent(t.lookup(keys[::7], insert=insert), -applies * float(STEP))
        reads += 1
    th.join()
    np.testing.assert_array_equal(t.lookup(keys), np.full((universe, dim), -applies * STEP))
    if t.stats()["read_retries"] == 0:
        pytest.skip(f"no read raced the writer in {reads} reads on this run")
