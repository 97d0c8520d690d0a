"""lookup and lookup_sum against the reference, bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import (
    Config,
    assert_counters,
    assert_rows_equal,
    assert_same_state,
    random_offsets,
    u64,
)
from reference import SGDSpec, ZerosSpec, pool

DIMS = [1, 3, 8, 32, 130]


def _batch(rng: np.random.Generator, n: int, universe: int) -> np.ndarray:
    """n keys drawn from a small universe (duplicates guaranteed) plus extreme ids."""
    keys = rng.integers(0, universe, size=n).astype(np.uint64)
    if n >= 4:
        keys[rng.integers(0, n)] = np.uint64(2**64 - 1)
        keys[rng.integers(0, n)] = np.uint64(0)
    return keys


@pytest.mark.parametrize("num_shards", [1, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 300])
@pytest.mark.parametrize("dim", DIMS)
def test_lookup_matches_reference(
    dim: int, n: int, num_shards: int, rng: np.random.Generator
) -> None:
    """lookup(insert=True) inserts misses with their initial rows, hits read stored rows,
    and counters count each occurrence; then insert=False reads zeros for misses."""
    t, ref = Config(dim=dim, num_shards=num_shards).pair()
    universe = max(2 * n, 4)
    for _ in range(3):
        keys = _batch(rng, n, universe)
        assert_rows_equal(t.lookup(keys), ref.lookup(keys), keys)
        assert_counters(t, ref)
    probe = _batch(rng, n, 2 * universe)  # about half of these are missing
    assert_rows_equal(t.lookup(probe, insert=False), ref.lookup(probe, insert=False), probe)
    assert_same_state(t, ref, np.arange(2 * universe, dtype=np.uint64))


def test_insert_false_misses_read_zeros_and_are_not_inserted() -> None:
    """insert=False: a miss reads zeros, is not inserted and counts a miss each time."""
    t = Config(dim=5).table()
    t.lookup(u64([1]))
    st0 = t.stats()
    keys = u64([2, 1, 2, 3])
    got = t.lookup(keys, insert=False)
    assert np.array_equal(got[[0, 2, 3]], np.zeros((3, 5), np.float32))
    assert_rows_equal(got[1:2], t.initial_values(u64([1])))
    assert not t.contains(u64([2, 3])).any()
    st = t.stats()
    assert (st["hits"] - st0["hits"], st["misses"] - st0["misses"]) == (1, 3)
    assert st["inserts"] == st0["inserts"] == 1
    assert len(t) == 1
    pooled = t.lookup_sum(keys, [0, 2, 4], insert=False)
    assert_rows_equal(pooled, np.stack([got[0] + got[1], got[2] + got[3]]))
    assert len(t) == 1


def test_duplicate_missing_key_inserted_once() -> None:
    """A missing id repeated in one training batch is inserted once; all copies equal."""
    t, ref = Config(dim=4).pair()
    keys = u64([9, 9, 9, 4, 9])
    got = t.lookup(keys)
    assert_rows_equal(got, ref.lookup(keys), keys)
    assert len(t) == 2
    assert t.stats()["inserts"] == 2
    assert_counters(t, ref)


@pytest.mark.parametrize("insert", [True, False])
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("n", "bags"), [(0, 0), (0, 3), (1, 1), (5, 9), (200, 40), (600, 7)])
@pytest.mark.parametrize("dim", DIMS)
def test_lookup_sum_matches_reference(
    dim: int,
    n: int,
    bags: int,
    weighted: bool,
    mode: str,
    insert: bool,
    rng: np.random.Generator,
) -> None:
    """Pooled sums equal the in-order float32 reference sum (weights, mean, empty bags)."""
    t, ref = Config(dim=dim, num_shards=4).pair()
    warm = _batch(rng, 50, 100)
    t.lookup(warm)
    ref.lookup(warm)
    keys = _batch(rng, n, 150)
    off = random_offsets(rng, n, bags)
    w = rng.normal(size=n).astype(np.float32) if weighted else None
    got = t.lookup_sum(keys, off, weights=w, mode=mode, insert=insert)
    want = ref.lookup_sum(keys, off, weights=w, mode=mode, insert=insert)
    assert got.shape == (bags, dim)
    assert_rows_equal(got, want)
    assert_same_state(t, ref, np.arange(150, dtype=np.uint64))


def test_lookup_sum_order_is_specified() -> None:
    """Bag sums are taken in caller order from zero: with rows 1, 1e8, -1e8 (float32) the
    order [1, 1e8, -1e8] sums to 0 and [1e8, -1e8, 1] to 1, as the in-order formula says."""
    t = Config(dim=1, initializer=ZerosSpec(), optimizer=SGDSpec(lr=1.0)).table()
    keys = u64([1, 2, 3])
    target = np.array([[1.0], [1e8], [-1e8]], np.float32)
    t.apply_gradients(keys, -target)  # w = 0 - 1 * (-target) = target exactly
    rows = t.lookup(keys, insert=False)
    assert_rows_equal(rows, target)
    for order in ([0, 1, 2], [1, 2, 0], [2, 0, 1]):
        s = np.float32(0)
        for i in order:
            s = np.float32(s + rows[i, 0])
        got = t.lookup_sum(keys[order], [0, 3])
        assert got[0, 0] == s, (order, got[0, 0], s)
    assert t.lookup_sum(keys[[1, 2, 0]], [0, 3])[0, 0] == np.float32(1.0)
    assert t.lookup_sum(keys, [0, 3])[0, 0] == np.float32(0.0)


def test_weighted_mean_divides_by_count() -> None:
    """mean mode divides the weighted sum by the bag's id count, not by the weight total."""
    t = Config(dim=3).table()
    keys = u64([1, 2])
    rows = t.lookup(keys)
    w = np.array([2.0, 4.0], np.float32)
    got = t.lookup_sum(keys, [0, 2], weights=w, mode="mean")
    want = pool(rows, [0, 2], w, "mean")
    assert_rows_equal(got, want)
    assert_rows_equal(
        got, ((np.float32(0) + w[0] * rows[0] + w[1] * rows[1]) / np.float32(2))[None]
    )


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_results_identical_for_any_thread_count(mode: str, rng: np.random.Generator) -> None:
    """Large lookups and pooled lookups are bitwise identical for num_threads 1, 2, 4 and
    equal the reference."""
    dim, n, bags = 32, 40_000, 4000
    keys = _batch(rng, n, 30_000)
    off = random_offsets(rng, n, bags)
    w = rng.uniform(-2, 2, size=n).astype(np.float32)
    cfg = Config(dim=dim, capacity=100_000, num_shards=8)
    ref = cfg.reference()
    want_rows = ref.lookup(keys)
    want_pool = pool(want_rows, off, w, mode)
    for threads in (1, 2, 4):
        t = cfg.table(num_threads=threads)
        assert t.num_threads == threads
        assert_rows_equal(t.lookup(keys), want_rows, keys)
        assert_rows_equal(t.lookup_sum(keys, off, weights=w, mode=mode), want_pool)
        assert_rows_equal(
            t.lookup_sum(keys, off, mode=mode, insert=False), pool(want_rows, off, None, mode)
        )
        assert len(t) == len(ref)


def test_pooled_sum_starts_from_positive_zero() -> None:
    """s = 0; s = s + w_i * row_i: the sum starts from +0.0, so a bag whose only terms are
    -0.0 (negative weight times a zero row) gives +0.0, bit for bit, as the reference does:
    on the inserting and the lock-free path, for a generic and a fixed-width kernel, in bags
    of one id (their own path) and of two, summed or averaged."""
    for dim in (2, 16):
        t = Config(dim=dim, initializer=ZerosSpec()).table()
        keys = u64([1, 2])
        w = np.array([-1.0, -1.0], np.float32)
        for off, mode in itertools.product(([0, 1, 2], [0, 2]), ("sum", "mean")):
            want = pool(np.zeros((2, dim), np.float32), off, w, mode)
            assert not np.signbit(want).any()
            for _ in range(2):  # the first call inserts, the second reads lock-free
                got = t.lookup_sum(keys, off, weights=w, mode=mode)
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), got


def test_lock_free_reads_match_reference_at_every_length_around_the_pipeline() -> None:
    """The lock-free read kernel prefetches index slots and rows some ids ahead of the id it
    sums (table.cpp: kReadSlotAhead, kReadRowAhead), with separate paths for a batch's first
    ids, its steady middle and its last ones. Every length from 0 to 80 ids crosses each
    boundary between them: stored ids (nothing inserted), with misses read as zeros."""
    t, ref = Config(dim=8, num_shards=4).pair()
    stored = np.arange(0, 200, 2, dtype=np.uint64)  # even ids stored, odd ones missing
    t.lookup(stored)
    ref.lookup(stored)
    rng = np.random.default_rng(7)
    for n in range(81):
        hits = rng.choice(stored, size=n)
        mixed = rng.integers(0, 200, size=n).astype(np.uint64)
        for keys, insert in ((hits, True), (mixed, False)):
            assert_rows_equal(t.lookup(keys, insert=insert), ref.lookup(keys, insert=insert), keys)
            off = random_offsets(rng, n, max(1, n // 3))
            assert_rows_equal(
                t.lookup_sum(keys, off, insert=insert), ref.lookup_sum(keys, off, insert=insert)
            )
    assert len(t) == len(stored)
    assert_counters(t, ref)
