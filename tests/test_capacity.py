"""The capacity promise (docs/semantics.md, Eviction): a table holds ``capacity`` hashed ids
without evicting, at any shard count, for any random set of ids."""

from __future__ import annotations

import numpy as np
import pytest

import embstore

SEEDS = range(10)


def _distinct_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    ids = np.unique(rng.integers(0, 2**64, size=n + n // 8 + 64, dtype=np.uint64))
    rng.shuffle(ids)
    assert ids.shape[0] >= n
    return ids[:n]


@pytest.mark.parametrize(
    ("capacity", "num_shards"),
    [
        (4096, None),
        (4096, 16),
        (65536, None),
        (65536, 64),
        (131072, None),
        (131072, 16),
        (262144, None),
        (262144, 256),
    ],
)
def test_capacity_distinct_ids_never_evict(capacity: int, num_shards: int | None) -> None:
    for seed in SEEDS:
        rng = np.random.default_rng([capacity, num_shards or 0, seed])
        ids = _distinct_ids(rng, capacity)
        t = embstore.Table(dim=1, capacity=capacity, num_shards=num_shards, num_threads=1)
        for chunk in np.array_split(ids, 7):  # several calls, as a warm-up would
            t.lookup(chunk)
        st = t.stats()
        assert st["evictions"] == 0, (seed, st["num_shards"], st["evictions"])
        assert len(t) == capacity
        assert t.contains(ids).all()


@pytest.mark.parametrize("capacity", [4096, 131072])
def test_capacity_distinct_ids_fit_without_eviction_policy(capacity: int) -> None:
    """With eviction="none" the same ids fit: no CapacityError before the table is full,
    and the first id beyond capacity raises it."""
    rng = np.random.default_rng(capacity)
    ids = _distinct_ids(rng, capacity + 1)
    t = embstore.Table(dim=1, capacity=capacity, eviction="none")
    t.lookup(ids[:capacity])
    assert len(t) == capacity
    with pytest.raises(embstore.CapacityError):
        t.lookup(ids[capacity:])
    assert len(t) == capacity
