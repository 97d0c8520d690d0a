"""Step-based eviction: set_step, per-row last step, evict(older_than=, with_state=)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import (
    Config,
    assert_counters,
    assert_rows_equal,
    assert_same_state,
    random_op,
    u64,
)
from reference import (
    AdagradSpec,
    AdamSpec,
    FTRLSpec,
    OptSpec,
    RowState,
    RowWiseAdagradSpec,
    SGDSpec,
)

import embstore

OPTIMIZERS: list[OptSpec] = [
    SGDSpec(lr=0.5),
    SGDSpec(lr=0.1, momentum=0.9),
    AdagradSpec(lr=0.1, eps=1e-6, initial_accumulator=0.1),
    RowWiseAdagradSpec(lr=0.1, eps=1e-6, initial_accumulator=0.0),
    AdamSpec(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01),
    FTRLSpec(alpha=0.5, beta=1.0, l1=0.01, l2=0.1),
]


def _state_entries(spec: OptSpec, st: RowState) -> dict[str, np.ndarray]:
    """The reference state of one row, named as ``Table.evict(with_state=True)`` names it."""
    if isinstance(spec, RowWiseAdagradSpec):
        return {"accumulator": st.acc[0]}
    if isinstance(spec, AdagradSpec):
        return {"accumulator": st.acc}
    if isinstance(spec, SGDSpec):
        return {"momentum": st.buf} if spec.momentum > 0 else {}
    if isinstance(spec, AdamSpec):
        return {"m": st.m, "v": st.v, "step": np.uint32(st.t)}
    return {"z": st.z, "n": st.n}


@pytest.mark.parametrize("spec", OPTIMIZERS, ids=lambda s: type(s).__name__)
def test_evict_older_than_matches_reference(spec: OptSpec, rng: np.random.Generator) -> None:
    """Random lookups/applies over advancing steps, with CLOCK churn (one shard: the
    reference is exact); every evict returns the reference's rows, in slot order, with
    their optimizer state, and leaves the same table behind."""
    cfg = Config(dim=5, capacity=24, num_shards=1, optimizer=spec)
    t, ref = cfg.pair()
    universe = np.arange(60, dtype=np.uint64)
    for step in range(1, 40):
        t.set_step(step)
        ref.set_step(step)
        for _ in range(3):
            random_op(t, ref, rng, universe)
        if step % 5 == 0:
            bound = step - int(rng.integers(0, 4))
            got = t.evict(older_than=bound, with_state=True)
            ids, values, states = ref.evict(bound)
            assert got["ids"].dtype == np.uint64
            assert got["ids"].tolist() == ids
            assert_rows_equal(got["values"], values, ids)
            assert set(got) == {"ids", "values", *t.state_names()}
            for j, st in enumerate(states):
                for name, want in _state_entries(spec, st).items():
                    np.testing.assert_array_equal(got[name][j], want, err_msg=name)
            assert_same_state(t, ref, universe)
    assert_counters(t, ref)


def test_last_step_is_recorded_by_lookups_and_updates() -> None:
    """Scripted: a row survives evict(older_than=s) exactly when it was looked up (with or
    without insert), pooled or updated at a step >= s."""
    t = Config(dim=2, capacity=100, num_shards=4).table()
    t.lookup(u64(range(10)))  # step 0: never set
    assert t.step == 0
    t.set_step(3)
    t.lookup(u64([1]), insert=False)
    t.lookup_sum(u64([2, 3]), [0, 2])
    t.apply_gradients(u64([4]), np.ones((1, 2), np.float32))
    t.apply_gradients(u64([20]), np.ones((1, 2), np.float32))  # inserted by the apply
    t.set_step(5)
    t.lookup(u64([5, 30]))  # hit and insert at step 5
    assert t.step == 5
    got = t.evict(older_than=3)
    assert sorted(got["ids"].tolist()) == [0, 6, 7, 8, 9]
    assert got["values"].shape == (5, 2)
    assert set(got) == {"ids", "values"}
    assert sorted(t.evict(older_than=5)["ids"].tolist()) == [1, 2, 3, 4, 20]
    assert sorted(u64(range(40))[t.contains(u64(range(40)))].tolist()) == [5, 30]
    assert t.evict(older_than=5)["ids"].size == 0
    assert sorted(t.evict(older_than=2**40)["ids"].tolist()) == [5, 30]
    assert len(t) == 0
    st = t.stats()
    assert st["evictions"] == 12
    assert st["inserts"] - st["evictions"] - st["erased"] == len(t)


def test_evict_without_steps_and_rows_reused() -> None:
    """Without set_step every row's step is 0: older_than=0 removes nothing, 1 removes all.
    Freed rows are reused and the capacity (with borrowed pool rows) is whole again."""
    t = Config(dim=3, capacity=64, num_shards=4, eviction="none").table()
    keys = u64(range(48))  # 48 hashed ids fit the 4 shards' quotas plus the pool
    t.lookup(keys)
    assert t.evict(older_than=0)["ids"].size == 0
    removed = t.evict(older_than=1)
    assert sorted(removed["ids"].tolist()) == list(range(48))
    assert_rows_equal(removed["values"][np.argsort(removed["ids"])], t.initial_values(keys), keys)
    assert len(t) == 0
    t.lookup(keys[::-1])  # eviction="none": fits again only if every borrowed row came back
    assert len(t) == 48


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, True, "3"])
def test_set_step_rejects_bad_values(bad: object) -> None:
    t = Config(dim=2, capacity=10).table()
    with pytest.raises((ValueError, TypeError)):
        t.set_step(bad)  # type: ignore[arg-type]
    assert t.step == 0


@pytest.mark.parametrize("bad", [-1, 1.0, None, False])
def test_evict_rejects_bad_bounds(bad: object) -> None:
    t = Config(dim=2, capacity=10).table()
    t.lookup(u64([1, 2]))
    with pytest.raises((ValueError, TypeError)):
        t.evict(older_than=bad)  # type: ignore[arg-type]
    assert len(t) == 2


def test_step_and_evict_on_closed_table() -> None:
    t = Config(dim=2, capacity=10).table()
    t.close()
    with pytest.raises(ValueError, match="closed"):
        t.set_step(1)
    with pytest.raises(ValueError, match="closed"):
        t.evict(older_than=1)


def test_group_set_step() -> None:
    a, b = Config(dim=2, capacity=10).table(), Config(dim=3, capacity=10).table()
    group = embstore.TableGroup({"a": a, "b": b})
    group.set_step(7)
    assert a.step == 7
    assert b.step == 7


def test_evict_while_training_threads_run() -> None:
    """evict(older_than=) runs while other threads look up and apply at advancing steps:
    no row is lost or duplicated (counters stay consistent) and nothing evicted is still
    present unless it was touched again afterwards."""
    t = Config(dim=4, capacity=4096, num_shards=8, num_threads=2).table()
    universe = np.arange(3000, dtype=np.uint64)
    stop = threading.Event()
    errors: list[BaseException] = []

    def train(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                keys = rng.choice(universe, size=256)
                t.lookup_sum(keys, np.arange(0, 257, 8))
                t.apply_gradients(keys, np.full((256, 4), 0.01, np.float32))
        except Exception as exc:  # noqa: BLE001 - the main thread asserts none happened
            errors.append(exc)

    workers = [threading.Thread(target=train, args=(s,)) for s in range(2)]
    for w in workers:
        w.start()
    try:
        total = 0
        for step in range(1, 30):
            t.set_step(step)
            got = t.evict(older_than=max(0, step - 2))
            assert np.unique(got["ids"]).size == got["ids"].size
            total += got["ids"].size
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert not errors, errors
    st = t.stats()
    assert st["inserts"] - st["evictions"] - st["erased"] == len(t)
    assert st["evictions"] >= total
    assert int(t.contains(universe).sum()) == len(t)
