"""Pickling: a Table or TableGroup pickles with its spec and every row, and the copy trains
on bit for bit like the original (issue 31)."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
from typing import Any

import numpy as np
import pytest
from helpers import EVERY_OPTIMIZER, Config, assert_rows_equal, random_offsets, sorted_export, u64

import embstore

UNIVERSE = u64(range(300))


def _train(t: embstore.Table, rng: np.random.Generator, steps: int) -> None:
    for _ in range(steps):
        bags = int(rng.integers(1, 8))
        keys = u64(rng.integers(0, 300, size=int(rng.integers(0, 40))))
        off = random_offsets(rng, keys.shape[0], bags)
        w = rng.uniform(-1, 1, size=keys.shape[0]).astype(np.float32)
        t.lookup_sum(keys, off, weights=w)
        g = rng.normal(size=(bags, t.dim)).astype(np.float32)
        t.apply_gradients(keys, g, offsets=off, weights=w)


def _assert_equal_tables(a: embstore.Table, b: embstore.Table) -> None:
    assert a.spec == b.spec
    assert a.step == b.step
    assert len(a) == len(b)
    ea, eb = sorted_export(a), sorted_export(b)
    assert set(ea) == set(eb)
    for name in ea:
        np.testing.assert_array_equal(ea[name], eb[name], err_msg=name)


def _keep(ids: np.ndarray, values: np.ndarray) -> None:
    """A picklable on_evict."""


@pytest.mark.parametrize("spec", EVERY_OPTIMIZER, ids=lambda s: type(s).__name__)
def test_pickle_round_trip_trains_on_bit_for_bit(spec: Any, rng: np.random.Generator) -> None:
    """Same rows, state and steps after the round trip, identical lookups, and identical
    rows after the same further training steps (steps tracked, lr changed)."""
    t = Config(dim=3, capacity=1000, optimizer=spec, num_shards=4).table()
    _train(t, rng, 5)
    t.set_step(7)
    t.set_lr(0.05 if not isinstance(t.optimizer, embstore.FTRL) else 0.2)
    _train(t, rng, 3)
    u = pickle.loads(pickle.dumps(t))
    _assert_equal_tables(t, u)
    assert_rows_equal(u.lookup(UNIVERSE, insert=False), t.lookup(UNIVERSE, insert=False))
    seed = int(rng.integers(1 << 30))
    for table in (t, u):
        table.set_step(9)
        _train(table, np.random.default_rng(seed), 6)
    _assert_equal_tables(t, u)


def test_pickle_keeps_admission_counters_and_untracked_steps(rng: np.random.Generator) -> None:
    """Counts of ids not admitted yet survive the pickle; a table that never set a step
    still records none."""
    t = embstore.Table(
        dim=2, capacity=500, admission=embstore.CountFilter(min_count=3, width=256, depth=2)
    )
    t.lookup(u64([1, 2, 2, 3, 3, 3]))
    u = copy.deepcopy(t)
    assert u.export()["last_step"].tolist() == t.export()["last_step"].tolist()
    for table in (t, u):
        table.lookup(u64([1, 1, 2, 4]))
    np.testing.assert_array_equal(u.contains(u64([1, 2, 3, 4])), [True, True, True, False])
    _assert_equal_tables(t, u)
    assert u.stats()["admitted"] == t.stats()["admitted"] - 1  # stats restart: only "1"


def test_deepcopy_is_independent(rng: np.random.Generator) -> None:
    t = embstore.Table(dim=4, capacity=200, optimizer=embstore.SGD(lr=0.5), name="users")
    _train(t, rng, 3)
    before = t.export()
    u = copy.deepcopy(t)
    _train(u, rng, 3)
    u.erase(u64(range(100)))
    after = t.export()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])
    assert u.name == t.name == "users"
    u.close()
    assert not t.closed


def test_group_pickles_with_its_tables(rng: np.random.Generator) -> None:
    shared = embstore.Table(dim=2, capacity=100, on_evict=_keep)
    g = embstore.TableGroup({"a": shared, "b": embstore.Table(dim=3, capacity=100)})
    _train(g["a"], rng, 2)
    _train(g["b"], rng, 2)
    h = pickle.loads(pickle.dumps({"group": g, "alias": shared}))
    assert h["group"]["a"] is h["alias"]  # one table, pickled once
    assert h["group"].names == ["a", "b"]
    assert h["alias"].spec.on_evict is _keep
    for name in g:
        _assert_equal_tables(g[name], h["group"][name])
    feats = {"a": (u64([1, 2]), np.array([0, 2])), "b": (u64([3]), np.array([0, 1]))}
    out_g, out_h = g.lookup_sum(feats, insert=False), h["group"].lookup_sum(feats, insert=False)
    for name in feats:
        assert_rows_equal(out_g[name], out_h[name])


class _Labelled(embstore.Table):
    """A subclass (module-level, so pickle finds it)."""


def test_a_subclass_pickles_as_itself() -> None:
    t = _Labelled(dim=2, capacity=10)
    t.lookup(u64([1, 2]))
    u = pickle.loads(pickle.dumps(t))
    assert type(u) is _Labelled
    _assert_equal_tables(t, u)


def test_unpicklable_callback_and_closed_table_raise() -> None:
    t = embstore.Table(dim=2, capacity=10, on_evict=lambda ids, values: None)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(t)
    t.close()
    with pytest.raises(ValueError, match="closed"):
        pickle.dumps(t)


def _lookup_in_child(table: embstore.Table) -> np.ndarray:
    return table.lookup(u64(range(20)), insert=False)


def test_a_table_crosses_into_another_process(rng: np.random.Generator) -> None:
    t = embstore.Table(dim=3, capacity=100)
    _train(t, rng, 2)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_lookup_in_child, (t,))
    assert_rows_equal(got, t.lookup(u64(range(20)), insert=False))
