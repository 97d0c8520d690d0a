"""Admission filter (CountFilter): exact behaviour vs the reference, statistics of the
count-min sketch's over-admission, and argument checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import Config, assert_counters, assert_rows_equal, assert_same_state, random_op, u64
from reference import AdagradSpec

import embstore


@pytest.mark.parametrize("min_count", [2, 3])
@pytest.mark.parametrize("num_shards", [1, 4])
def test_admission_matches_reference(
    min_count: int, num_shards: int, rng: np.random.Generator
) -> None:
    """Random lookups (both kinds), pooled lookups and applies with a wide sketch (exact
    counts): rows, zeros before admission, dropped gradients and the admitted / rejected
    counters all equal the reference's."""
    cfg = Config(
        dim=4,
        capacity=10_000,
        num_shards=num_shards,
        optimizer=AdagradSpec(lr=0.1, eps=1e-6, initial_accumulator=0.1),
        min_count=min_count,
    )
    t, ref = cfg.pair()
    universe = np.arange(40, dtype=np.uint64)
    for _ in range(120):
        random_op(t, ref, rng, universe)
        assert_counters(t, ref)
    assert_same_state(t, ref, universe)
    st = t.stats()
    assert st["admitted"] == st["inserts"] > 0
    assert st["rejected"] > 0


def test_scripted_admission() -> None:
    """min_count=3: two sightings read zeros and leave no row; an apply before admission is
    dropped; the third sighting inserts the initial row; lookups without insert and applies
    never count."""
    t = embstore.Table(
        dim=2,
        capacity=100,
        optimizer=embstore.SGD(lr=1.0),
        initializer=embstore.Uniform(seed=3),
        admission=embstore.CountFilter(min_count=3, width=4096, depth=4),
    )
    k = u64([42])
    zero = np.zeros((1, 2), np.float32)
    for _ in range(5):
        t.lookup(k, insert=False)  # never counts
    assert_rows_equal(t.lookup(k), zero)
    t.apply_gradients(k, np.ones((1, 2), np.float32))  # dropped, not counted
    assert_rows_equal(t.lookup(k), zero)
    assert len(t) == 0
    assert_rows_equal(t.lookup(k), t.initial_values(k))  # third sighting: admitted
    assert len(t) == 1
    t.apply_gradients(k, np.ones((1, 2), np.float32))
    assert_rows_equal(t.lookup(k, insert=False), t.initial_values(k) - 1.0)
    st = t.stats()
    assert (st["admitted"], st["rejected"]) == (1, 3)
    # After an eviction the id is admitted again at once: the sketch remembers it.
    t.erase(k)
    t.apply_gradients(k, np.ones((1, 2), np.float32))
    assert len(t) == 1


def test_without_filter_counts_are_zero() -> None:
    t = embstore.Table(dim=2, capacity=10, admission=embstore.CountFilter(min_count=1))
    t.lookup(u64([1, 2]))
    st = t.stats()
    assert len(t) == 2
    assert (st["admitted"], st["rejected"]) == (0, 0)
    assert t.admission == embstore.CountFilter(min_count=1)


@pytest.mark.parametrize(("load", "depth"), [(0.5, 2), (1.0, 3), (2.0, 4)])
def test_over_admission_rate_within_bound(load: float, depth: int) -> None:
    """``load * width`` distinct ids seen once each (min_count=2) fill the sketch; then 2,000
    fresh ids are looked up once: each is admitted at once only if collisions already lifted
    all its counters. The measured rate stays under CountFilter.over_admission_bound (plain
    count-min, counting the probes' own sightings; conservative update does better) plus 4
    binomial sigmas, and is not zero (the test does see over-admission)."""
    width, probes = 1 << 15, 2000
    n = int(load * width)
    flt = embstore.CountFilter(min_count=2, width=width, depth=depth)
    t = embstore.Table(dim=1, capacity=probes + n, num_shards=8, admission=flt)
    t.lookup(np.arange(n, dtype=np.uint64) + np.uint64(1 << 40))
    before = len(t)  # ids of the load phase that collided into admission themselves
    t.lookup(np.arange(probes, dtype=np.uint64))
    rate = (len(t) - before) / probes
    bound = flt.over_admission_bound(n + probes)
    sigma = math.sqrt(bound * (1 - bound) / probes)
    assert rate <= bound + 4 * sigma, (rate, bound)
    assert rate > 0.0


def test_sketch_memory_in_stats() -> None:
    small = embstore.Table(dim=4, capacity=1024, num_shards=1)
    filtered = embstore.Table(
        dim=4,
        capacity=1024,
        num_shards=1,
        admission=embstore.CountFilter(min_count=2, width=1 << 16, depth=4),
    )
    extra = (filtered.stats()["bytes_per_row"] - small.stats()["bytes_per_row"]) * 1024
    assert extra == pytest.approx(embstore.CountFilter(width=1 << 16, depth=4).bytes, rel=0.01)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"min_count": 0}, ValueError),
        ({"min_count": 70_000}, ValueError),
        ({"min_count": 2.0}, TypeError),
        ({"width": 0}, ValueError),
        ({"depth": 0}, ValueError),
        ({"depth": 17}, ValueError),
    ],
)
def test_count_filter_rejects_bad_settings(kwargs: dict[str, object], error: type) -> None:
    with pytest.raises(error):
        embstore.CountFilter(**kwargs)  # type: ignore[arg-type]


def test_table_rejects_bad_admission() -> None:
    with pytest.raises(TypeError, match="CountFilter"):
        embstore.Table(dim=2, capacity=10, admission=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="width"):  # fewer columns than shards
        embstore.Table(
            dim=2,
            capacity=1024,
            num_shards=8,
            admission=embstore.CountFilter(min_count=2, width=4),
        )
