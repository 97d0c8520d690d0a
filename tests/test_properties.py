"""Hypothesis state machine: a one-shard table with a tiny CLOCK ring vs the reference."""

from __future__ import annotations

import numpy as np
from helpers import UNIFORM, Config, assert_counters, assert_rows_equal
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from reference import AdagradSpec, OptSpec, ReferenceTable, SGDSpec

import embstore

UNIVERSE = np.array([*range(10), 2**63, 2**64 - 1], dtype=np.uint64)
KEYS = st.lists(st.integers(0, UNIVERSE.shape[0] - 1), max_size=10).map(lambda ix: UNIVERSE[ix])
OPTS: list[OptSpec] = [
    SGDSpec(lr=0.5),
    AdagradSpec(lr=0.1),
    AdagradSpec(lr=0.25, eps=1e-4, initial_accumulator=0.5),
]


def _offsets(data: st.DataObject, n: int) -> np.ndarray:
    bags = data.draw(st.integers(0 if n == 0 else 1, 4), label="bags")
    if bags == 0:
        return np.zeros(1, np.int64)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=bags - 1, max_size=bags - 1)))
    return np.array([0, *cuts, n], np.int64)


def _weights(data: st.DataObject, n: int) -> np.ndarray | None:
    if not data.draw(st.booleans(), label="weighted"):
        return None
    w = data.draw(st.lists(st.sampled_from([0.5, -1.0, 2.0, 0.3, 1.0]), min_size=n, max_size=n))
    return np.array(w, np.float32)


class _TableMachine(RuleBasedStateMachine):
    """Rules shared by the machines below: random operation sequences, after every step the
    store equals the reference."""

    def __init__(self) -> None:
        super().__init__()
        self.t: embstore.Table | None = None
        self.ref: ReferenceTable | None = None
        self.rng = np.random.default_rng(0)

    def _pair(self) -> tuple[embstore.Table, ReferenceTable]:
        assert self.t is not None
        assert self.ref is not None
        return self.t, self.ref

    def _fit(self, keys: np.ndarray) -> np.ndarray:
        """Drops ids so that one apply touches at most `capacity` distinct ids (all pinned)."""
        _, ref = self._pair()
        first = list(dict.fromkeys(keys.tolist()))[: ref.capacity]
        return keys[np.isin(keys, np.array(first, np.uint64))]

    def _grads(self, rows: int) -> np.ndarray:
        _, ref = self._pair()
        return self.rng.normal(size=(rows, ref.dim)).astype(np.float32)

    @rule(keys=KEYS)
    def lookup(self, keys: np.ndarray) -> None:
        t, ref = self._pair()
        assert_rows_equal(t.lookup(keys), ref.lookup(keys), keys)

    @rule(keys=KEYS)
    def lookup_read_only(self, keys: np.ndarray) -> None:
        t, ref = self._pair()
        assert_rows_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False), keys)

    @rule(keys=KEYS, data=st.data(), mode=st.sampled_from(["sum", "mean"]), insert=st.booleans())
    def lookup_sum(self, keys: np.ndarray, data: st.DataObject, mode: str, insert: bool) -> None:
        t, ref = self._pair()
        off = _offsets(data, keys.shape[0])
        w = _weights(data, keys.shape[0])
        got = t.lookup_sum(keys, off, weights=w, mode=mode, insert=insert)
        assert_rows_equal(got, ref.lookup_sum(keys, off, weights=w, mode=mode, insert=insert))

    @rule(keys=KEYS)
    def apply_per_id(self, keys: np.ndarray) -> None:
        t, ref = self._pair()
        keys = self._fit(keys)
        g = self._grads(keys.shape[0])
        t.apply_gradients(keys, g)
        ref.apply_gradients(keys, g)

    @rule(keys=KEYS, data=st.data(), mode=st.sampled_from(["sum", "mean"]))
    def apply_pooled(self, keys: np.ndarray, data: st.DataObject, mode: str) -> None:
        t, ref = self._pair()
        keys = self._fit(keys)
        off = _offsets(data, keys.shape[0])
        w = _weights(data, keys.shape[0])
        g = self._grads(off.shape[0] - 1)
        t.apply_gradients(keys, g, offsets=off, weights=w, mode=mode)
        ref.apply_gradients(keys, g, offsets=off, weights=w, mode=mode)

    @rule(keys=KEYS)
    def erase(self, keys: np.ndarray) -> None:
        t, ref = self._pair()
        assert t.erase(keys) == ref.erase(keys)

    @rule(keys=KEYS)
    def contains(self, keys: np.ndarray) -> None:
        t, ref = self._pair()
        assert np.array_equal(t.contains(keys), ref.contains(keys))

    @precondition(lambda self: self.ref is not None and len(self.ref) > 0)
    @rule()
    def read_all_present(self) -> None:
        """Reads every stored row (insert=False also read-marks them for CLOCK)."""
        t, ref = self._pair()
        keys = np.array(ref.keys(), np.uint64)
        assert_rows_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False), keys)

    @invariant()
    def same_state(self) -> None:
        if self.t is None:
            return
        t, ref = self._pair()
        assert len(t) == len(ref)
        present = t.contains(UNIVERSE)
        assert np.array_equal(present, ref.contains(UNIVERSE)), (
            f"store holds {UNIVERSE[present].tolist()}, reference ring {ref.ring()}"
        )
        assert_counters(t, ref)


class TableVsReference(_TableMachine):
    """One shard with a tiny CLOCK ring (capacity 1-6): exact eviction order, pinning,
    free-list reuse, optimizer state reset on re-insert."""

    @initialize(
        capacity=st.integers(1, 6),
        dim=st.integers(1, 5),
        opt=st.sampled_from(OPTS),
        seed=st.integers(0, 2**32 - 1),
    )
    def setup(self, capacity: int, dim: int, opt: OptSpec, seed: int) -> None:
        cfg = Config(dim=dim, capacity=capacity, optimizer=opt, initializer=UNIFORM, num_shards=1)
        self.t, self.ref = cfg.pair()
        self.rng = np.random.default_rng(seed)


class ShardedTableVsReference(_TableMachine):
    """The same machine on a multi-shard, multi-thread table that never fills: no eviction,
    so the reference is exact whatever the shard layout (values, contains, counters)."""

    @initialize(
        dim=st.integers(1, 5),
        opt=st.sampled_from(OPTS),
        seed=st.integers(0, 2**32 - 1),
        num_shards=st.sampled_from([2, 8]),
        num_threads=st.sampled_from([1, 3]),
    )
    def setup_sharded(
        self, dim: int, opt: OptSpec, seed: int, num_shards: int, num_threads: int
    ) -> None:
        cfg = Config(dim=dim, capacity=64, optimizer=opt, num_shards=num_shards)
        self.t, self.ref = cfg.pair(num_threads=num_threads)
        self.rng = np.random.default_rng(seed)

    def _fit(self, keys: np.ndarray) -> np.ndarray:
        return keys


TableVsReference.TestCase.settings = settings(stateful_step_count=40)
ShardedTableVsReference.TestCase.settings = settings(stateful_step_count=40)
TestTableVsReference = TableVsReference.TestCase
TestShardedTableVsReference = ShardedTableVsReference.TestCase
