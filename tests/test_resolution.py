"""Lookup, then apply: an apply reuses the rows its training lookup resolved (no index
probe) for the ids those rows still hold, so every result equals the reference."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from helpers import Config, assert_rows_equal, assert_same_state, u64
from hypothesis import given
from hypothesis import strategies as st
from reference import AdagradSpec, AdamSpec, ReferenceTable, SGDSpec

import embstore

UNIVERSE = np.arange(16, dtype=np.uint64)


def _two_bags(keys: np.ndarray) -> np.ndarray:
    return np.array([0, keys.shape[0] // 2, keys.shape[0]], dtype=np.int64)


def _grads(n: int, dim: int, salt: int) -> np.ndarray:
    return np.linspace(-1, 1 + salt, n * dim, dtype=np.float32).reshape(n, dim)


def _lookup_then_apply(t: embstore.Table, ref: ReferenceTable, keys: np.ndarray, salt: int) -> None:
    """A training step on both sides: lookup (rows compared), then apply of the same keys."""
    assert_rows_equal(t.lookup(keys), ref.lookup(keys))
    g = _grads(keys.shape[0], t.dim, salt)
    t.apply_gradients(keys, g)
    ref.apply_gradients(keys, g)


def test_training_step_reuses_every_row() -> None:
    """A warm table's lookup_sum then apply_gradients of the same keys probes nothing."""
    t, ref = Config(dim=4, optimizer=AdagradSpec(lr=0.1), num_shards=8).pair()
    keys = u64(np.arange(0, 300, 3))
    t.lookup(keys)
    ref.lookup(keys)
    batch = np.ascontiguousarray(keys[::-1][:64].repeat(2))  # duplicates too
    off = _two_bags(batch)
    assert_rows_equal(t.lookup_sum(batch, off), ref.lookup_sum(batch, off))
    g = _grads(2, 4, 0)
    t.apply_gradients(batch, g, offsets=off)
    ref.apply_gradients(batch, g, offsets=off)
    assert t.stats()["reused_rows"] == batch.shape[0]
    # Used once: the same apply again probes the index.
    t.apply_gradients(batch, g, offsets=off)
    ref.apply_gradients(batch, g, offsets=off)
    assert t.stats()["reused_rows"] == batch.shape[0]
    assert_same_state(t, ref, keys)


def test_consecutive_training_steps_match_the_reference() -> None:
    """Many steps of lookup_sum then apply on a warm multi-shard table, each batch full of
    duplicates and overlapping the last: the apply takes the lookup's rows as they are (no
    write came between) and sums duplicates in its per-thread scratch, which must be clean
    again for the next step. Outputs and state equal the reference at every step."""
    t, ref = Config(dim=4, optimizer=AdagradSpec(lr=0.1), num_shards=8, num_threads=2).pair()
    universe = u64(np.arange(0, 4000, 7))
    t.lookup(universe)
    ref.lookup(universe)
    rng = np.random.default_rng(5)
    reused = 0
    for step in range(12):
        batch = rng.choice(universe[: 150 + 20 * step], size=3000)  # ~20x duplicated ids
        off = np.arange(0, 3001, 10, dtype=np.int64)
        assert_rows_equal(t.lookup_sum(batch, off), ref.lookup_sum(batch, off))
        g = _grads(300, 4, step)
        t.apply_gradients(batch, g, offsets=off)
        ref.apply_gradients(batch, g, offsets=off)
        reused += batch.shape[0]
        assert t.stats()["reused_rows"] == reused
    assert_same_state(t, ref, universe)


def test_group_step_reuses_rows_of_every_table() -> None:
    cfg = Config(dim=3, optimizer=SGDSpec(lr=0.5), num_shards=4)
    tables = {"a": cfg.table(), "b": cfg.table()}
    group = embstore.TableGroup(tables)
    keys = u64(np.arange(50))
    off = _two_bags(keys)
    group.lookup_sum({n: (keys, off) for n in tables})  # inserts: locked path, no reuse
    group.lookup_sum({n: (keys, off) for n in tables})
    group.apply_gradients({n: (keys, off, _grads(2, 3, 1)) for n in tables})
    assert [t.stats()["reused_rows"] for t in tables.values()] == [50, 50]


def test_lookup_that_inserts_leaves_its_rows_too() -> None:
    t = Config(dim=2, num_shards=2).table()
    keys = u64([1, 2, 3])
    t.lookup(keys)  # three inserts: the locked path records their rows
    t.apply_gradients(keys, _grads(3, 2, 0))
    assert t.stats()["reused_rows"] == 3


def test_a_row_that_changed_hands_is_probed() -> None:
    """Id 5's row is freed and taken by id 8 between the lookup and the apply: the recorded
    row no longer holds 5, so 5 is found (here: re-inserted) by probing, and 8 keeps its
    own update. An apply of other keys leaves the kept resolution in place."""
    t, ref = Config(dim=2, num_shards=1).pair()
    keys = u64([5, 6, 7])
    for side in (t, ref):
        side.lookup(keys)
        side.erase(u64([5]))
        side.apply_gradients(u64([8]), _grads(1, 2, 3))  # takes 5's freed row
    g = _grads(3, 2, 0)
    t.apply_gradients(keys, g)
    ref.apply_gradients(keys, g)
    assert t.stats()["reused_rows"] == 2
    assert_same_state(t, ref, [5, 6, 7, 8])


def test_a_row_evicted_later_in_the_same_lookup_is_probed() -> None:
    """A training lookup whose own inserts evict a row it read earlier: 1 is read, then 5's
    insert sweeps the whole ring (clearing 1's bit) and comes round to 1's row. The apply of
    the same keys must not take that row for 1 (it holds 5 now): 1 is inserted again."""
    t, ref = Config(dim=2, capacity=4, num_shards=1, optimizer=SGDSpec(lr=0.5)).pair()
    for side in (t, ref):
        side.lookup(u64([1, 2, 3, 4]))
    keys = u64([1, 5, 6])
    _lookup_then_apply(t, ref, keys, salt=0)
    assert_same_state(t, ref, [1, 2, 3, 4, 5, 6])


def test_locked_lookup_rows_are_taken_as_they_are_when_no_row_was_passed_twice() -> None:
    """A training lookup that inserts (the locked path) into a table with room: nothing it
    read was evicted, so the apply takes every row as recorded; state equals the reference."""
    t, ref = Config(dim=2, capacity=64, num_shards=1, optimizer=SGDSpec(lr=0.5)).pair()
    keys = u64([7, 3, 7, 9, 3, 11])
    _lookup_then_apply(t, ref, keys, salt=1)
    assert t.stats()["reused_rows"] == 6
    assert_same_state(t, ref, [3, 7, 9, 11])


def test_ids_a_lookup_did_not_admit_are_probed_by_the_apply() -> None:
    """With an admission filter, a training lookup leaves ids it has not admitted without a
    row (and without a recorded place). The apply of the same keys takes the recorded rows
    as they are, finds the others missing and, not admitted, drops their gradients."""
    t, ref = Config(dim=2, capacity=64, num_shards=1, optimizer=SGDSpec(lr=0.5), min_count=2).pair()
    for side in (t, ref):
        side.lookup(u64([1, 1, 2, 2]))  # admitted at their second sighting: inserted
    keys = u64([1, 9, 2, 9, 10])  # 9 admitted at its second sighting here; 10 not
    _lookup_then_apply(t, ref, keys, salt=2)
    assert_same_state(t, ref, [1, 2, 9, 10])


def test_changed_keys_are_probed() -> None:
    """Keys rewritten in place between the lookup and the apply are not the lookup's."""
    t, ref = Config(dim=2, num_shards=1).pair()
    keys = u64([5, 6, 7])
    for side in (t, ref):
        side.lookup(keys)
    t.lookup(keys)
    keys[1] = 9  # absent: the apply must insert it
    g = _grads(3, 2, 0)
    t.apply_gradients(keys, g)
    ref.apply_gradients(keys, g)
    assert t.stats()["reused_rows"] == 0
    assert_same_state(t, ref, [5, 6, 7, 9], counters=False)


_IDS = st.lists(st.integers(0, 15), min_size=1, max_size=8)
_OP = st.one_of(
    st.tuples(st.just("forward"), _IDS),  # a training lookup_sum; its keys become `last`
    st.just(("backward",)),  # apply_gradients of `last` (reuse when nothing moved)
    st.tuples(st.just("apply"), _IDS),
    st.tuples(st.just("erase"), _IDS),
    st.tuples(st.just("read"), _IDS),  # lookup(insert=False)
    st.tuples(st.just("mutate"), st.integers(0, 15)),  # rewrite last[0] in place
)


@given(
    ops=st.lists(_OP, max_size=25),
    opt=st.sampled_from([SGDSpec(lr=0.5), AdagradSpec(lr=0.2), AdamSpec(lr=0.1)]),
    small=st.booleans(),
)
def test_reuse_never_changes_a_result(ops: list[tuple[Any, ...]], opt: Any, small: bool) -> None:
    """Random step sequences interleaved with the writes that must invalidate a kept
    resolution (inserts, CLOCK evictions, erases, other applies, rewritten keys): every
    output and the final state equal the reference's. `small`: a one-shard table of 12 rows
    (CLOCK churn, exact in the reference); else 4 shards that never fill."""
    cfg = Config(dim=3, optimizer=opt, capacity=12 if small else 1000, num_shards=1 if small else 4)
    t, ref = cfg.pair()
    for side in (t, ref):
        side.lookup(UNIVERSE[:10])  # present ids: lookups of them keep a resolution
    last = u64([0])
    for k, op in enumerate(ops):
        kind = op[0]
        if kind == "forward":
            last = u64(op[1])
            off = _two_bags(last)
            assert_rows_equal(t.lookup_sum(last, off), ref.lookup_sum(last, off))
        elif kind == "backward":
            g = _grads(last.shape[0], 3, k)
            t.apply_gradients(last, g)
            ref.apply_gradients(last, g)
        elif kind == "apply":
            keys = u64(op[1])
            g = _grads(keys.shape[0], 3, k)
            t.apply_gradients(keys, g)
            ref.apply_gradients(keys, g)
        elif kind == "erase":
            assert t.erase(u64(op[1])) == ref.erase(u64(op[1]))
        elif kind == "read":
            keys = u64(op[1])
            assert_rows_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False))
        else:
            last[0] = op[1]
    assert_same_state(t, ref, UNIVERSE)


def test_concurrent_writers_never_let_a_stale_row_through() -> None:
    """One thread trains (lookup_sum then apply of the same keys) while another erases and
    re-inserts some of those ids. Id i gets gradient -(i + 1) per step (SGD, lr 1, zeros
    initializer), so its row must hold a whole multiple of i + 1: all 300 steps for ids no
    erase touched, the steps since its last re-insert for the others. A reused row that no
    longer held its id would receive another id's update and break that."""
    t = embstore.Table(
        dim=2,
        capacity=10_000,
        optimizer=embstore.SGD(lr=1.0),
        initializer=embstore.Zeros(),
        num_shards=4,
    )
    keys = u64(np.arange(256))
    t.lookup(keys)
    off = np.arange(257, dtype=np.int64)
    grads = -np.repeat((keys + 1).astype(np.float32)[:, None], 2, axis=1)
    victims = u64(np.arange(0, 256, 7))
    zeros = np.zeros((victims.shape[0], 2), np.float32)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            t.erase(victims)
            t.apply_gradients(victims, zeros)  # re-inserts them (an apply keeps no resolution)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(300):
            t.lookup_sum(keys, off)
            t.apply_gradients(keys, grads, offsets=off)
    finally:
        stop.set()
        worker.join()
    rows = t.lookup(keys, insert=False)
    steps = rows / (keys + 1).astype(np.float32)[:, None]
    assert np.array_equal(steps, np.round(steps))
    assert np.all((steps >= 0) & (steps <= 300))
    untouched = ~np.isin(keys, victims)
    assert np.all(steps[untouched] == 300)
    assert t.stats()["reused_rows"] > 0
