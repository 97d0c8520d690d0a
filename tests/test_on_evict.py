"""on_evict: the rows CLOCK evicts reach the callback exactly once, after the call, with no
lock held (a callback may call back into the table)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import Config, assert_rows_equal, assert_same_state, u64

import embstore

ONE_SHARD = Config(dim=3, capacity=16, num_shards=1)


class Recorder:
    """An on_evict callback that keeps every batch it receives."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.threads: set[int] = set()

    def __call__(self, ids: np.ndarray, values: np.ndarray) -> None:
        assert ids.dtype == np.uint64
        assert values.dtype == np.float32
        assert values.shape == (ids.shape[0], 3)
        self.ids.append(ids)
        self.values.append(values)
        self.threads.add(threading.get_ident())

    def all_ids(self) -> list[int]:
        return [int(k) for batch in self.ids for k in batch]

    def all_values(self) -> np.ndarray:
        return np.concatenate(self.values) if self.values else np.zeros((0, 3), np.float32)


def test_evicted_rows_match_reference(rng: np.random.Generator) -> None:
    """One shard: the callback receives exactly the reference's CLOCK victims, in order,
    with the values they held (after updates), from lookups, pooled lookups and applies."""
    rec = Recorder()
    t, ref = ONE_SHARD.pair(on_evict=rec)
    universe = np.arange(50, dtype=np.uint64)
    for step in range(80):
        keys = rng.choice(universe, size=int(rng.integers(1, 8)))
        if step % 3 == 0:
            t.lookup(keys)
            ref.lookup(keys)
        elif step % 3 == 1:
            t.lookup_sum(keys, [0, keys.shape[0]])
            ref.lookup_sum(keys, [0, keys.shape[0]])
        else:
            g = rng.standard_normal((keys.shape[0], 3)).astype(np.float32)
            t.apply_gradients(keys, g)
            ref.apply_gradients(keys, g)
    want_ids = [k for k, _ in ref.evicted_log]
    assert rec.all_ids() == want_ids
    assert_rows_equal(rec.all_values(), np.array([v for _, v in ref.evicted_log]), want_ids)
    assert t.stats()["evictions"] == len(want_ids) > 0
    assert_same_state(t, ref, universe)


def test_group_calls_deliver_to_each_table() -> None:
    rec_a, rec_b = Recorder(), Recorder()
    a = ONE_SHARD.table(on_evict=rec_a)
    b = ONE_SHARD.table(on_evict=rec_b)
    group = embstore.TableGroup({"a": a, "b": b})
    keys = u64(range(40))
    off = np.arange(41, dtype=np.int64)
    group.lookup_sum({"a": (keys, off), "b": (keys[:20], off[:21])})
    assert len(rec_a.all_ids()) == 24
    assert len(rec_b.all_ids()) == 4
    grads = np.ones((10, 3), np.float32)  # 10 distinct ids: an apply pins its rows
    group.apply_gradients({"a": (keys[:10] + np.uint64(100), off[:11], grads)})
    assert len(rec_a.all_ids()) == 24 + 10
    assert len(rec_b.all_ids()) == 4


def test_reentrant_callback_does_not_deadlock() -> None:
    """The callback looks up, applies, erases and reads stats on the same table: no lock is
    held, and rows evicted by those nested calls reach the callback too, through the outer
    delivery loop (never a nested callback). Every eviction is delivered exactly once."""
    seen: list[int] = []
    depth = {"now": 0, "max": 0}
    t: embstore.Table

    def callback(ids: np.ndarray, values: np.ndarray) -> None:
        depth["now"] += 1
        depth["max"] = max(depth["max"], depth["now"])
        try:
            seen.extend(int(k) for k in ids)
            if len(seen) < 200:  # keep churning for a while from inside the callback
                base = 10_000 + 4 * depth.setdefault("calls", 0)
                depth["calls"] += 1
                fresh = np.arange(base, base + 4, dtype=np.uint64)
                t.lookup(fresh)
                t.apply_gradients(fresh, np.ones((fresh.shape[0], 3), np.float32))
                t.stats()
                t.erase(fresh[:1])
        finally:
            depth["now"] -= 1

    t = ONE_SHARD.table(on_evict=callback)
    done = threading.Event()

    def run() -> None:
        t.lookup(u64(range(40)))
        done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert done.is_set(), "a call from on_evict deadlocked"
    assert depth["max"] == 1
    assert t.stats()["evictions"] == len(seen) >= 200


def test_callback_error_propagates_and_table_stays_usable() -> None:
    calls = {"n": 0}

    def failing(ids: np.ndarray, values: np.ndarray) -> None:
        calls["n"] += 1
        msg = "spill failed"
        raise OSError(msg)

    t = ONE_SHARD.table(on_evict=failing)
    t.lookup(u64(range(16)))
    with pytest.raises(OSError, match="spill failed"):
        t.lookup(u64(range(100, 104)))
    assert len(t) == 16
    assert t.contains(u64(range(100, 104))).all()  # the call itself completed
    t.erase(u64(range(100, 104)))
    t.lookup(u64(range(200, 204)))  # free rows: nothing evicted, the callback is not called
    assert calls["n"] == 1


def test_not_called_without_eviction_and_bad_callback() -> None:
    rec = Recorder()
    t = Config(dim=3, capacity=100).table(on_evict=rec)
    t.lookup(u64(range(50)))
    t.erase(u64(range(10)))
    t.evict(older_than=1)  # evict() returns its rows; it does not call on_evict
    assert rec.ids == []
    with pytest.raises(TypeError, match="callable"):
        Config(dim=3, capacity=10).table(on_evict=42)


def test_concurrent_callers_deliver_every_eviction_once() -> None:
    """Four threads churn one table (8 shards); the union of delivered ids has no duplicate
    (id, value) rows beyond re-evictions and its size equals the evictions counter."""
    rec_lock = threading.Lock()
    delivered: list[np.ndarray] = []

    def callback(ids: np.ndarray, values: np.ndarray) -> None:
        with rec_lock:
            delivered.append(ids)

    t = Config(dim=3, capacity=512, num_shards=8, num_threads=2).table(on_evict=callback)

    def churn(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(60):
            t.lookup(rng.integers(0, 5000, size=128).astype(np.uint64))

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    total = sum(batch.shape[0] for batch in delivered)
    assert total == t.stats()["evictions"] > 0
