"""apply_gradients against the reference: SGD and Adagrad, per-id and pooled, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    Config,
    assert_rows_equal,
    assert_same_state,
    assert_unchanged,
    random_offsets,
    snapshot,
    u64,
)
from reference import AdagradSpec, OptSpec, SGDSpec, ZerosSpec

OPTIMIZERS: list[OptSpec] = [
    SGDSpec(lr=0.1),
    AdagradSpec(lr=0.05),
    AdagradSpec(lr=0.3, eps=1e-3, initial_accumulator=0.1),
]
OPT_IDS = ["sgd", "adagrad", "adagrad_acc"]


def _grads(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    g = rng.normal(scale=0.5, size=(rows, dim)).astype(np.float32)
    if g.size:
        g.flat[rng.integers(0, g.size)] = 0.0  # zero gradients are legal (Adagrad, acc 0)
    return g


@pytest.mark.parametrize("num_shards", [1, 16])
@pytest.mark.parametrize("dim", [1, 3, 8, 33])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_per_id_apply_matches_reference(
    opt: OptSpec, dim: int, num_shards: int, rng: np.random.Generator
) -> None:
    """Per-id grads: duplicates summed in order from zero, one update per distinct row,
    missing ids inserted then updated; repeated rounds accumulate optimizer state."""
    t, ref = Config(dim=dim, optimizer=opt, num_shards=num_shards).pair()
    universe = np.arange(60, dtype=np.uint64)
    for n in (0, 1, 5, 40, 200):
        keys = rng.choice(universe, size=n)
        g = _grads(rng, n, dim)
        t.apply_gradients(keys, g)
        ref.apply_gradients(keys, g)
        assert_same_state(t, ref, universe)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 4, 17])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_pooled_apply_matches_reference(
    opt: OptSpec, dim: int, weighted: bool, mode: str, rng: np.random.Generator
) -> None:
    """Pooled grads (the backward of lookup_sum): c_i = w_i (/count in mean), g_i = c_i *
    grads[bag], summed per distinct id in order; empty bags contribute nothing."""
    t, ref = Config(dim=dim, optimizer=opt, num_shards=4).pair()
    universe = np.arange(40, dtype=np.uint64)
    for n, bags in ((0, 0), (0, 2), (3, 1), (30, 8), (150, 20)):
        keys = rng.choice(universe, size=n)
        off = random_offsets(rng, n, bags)
        w = rng.uniform(-1.5, 1.5, size=n).astype(np.float32) if weighted else None
        g = _grads(rng, bags, dim)
        t.apply_gradients(keys, g, offsets=off, weights=w, mode=mode)
        ref.apply_gradients(keys, g, offsets=off, weights=w, mode=mode)
        assert_same_state(t, ref, universe)


def test_pooled_apply_equals_expanded_per_id(rng: np.random.Generator) -> None:
    """Unweighted sum-mode pooled apply equals the per-id apply of repeated bag grads."""
    cfg = Config(dim=6, optimizer=AdagradSpec(lr=0.1))
    a, b = cfg.table(), cfg.table()
    keys = rng.integers(0, 20, size=50).astype(np.uint64)
    off = random_offsets(rng, 50, 9)
    g = _grads(rng, 9, 6)
    a.apply_gradients(keys, g, offsets=off)
    b.apply_gradients(keys, np.repeat(g, np.diff(off), axis=0))
    universe = np.arange(20, dtype=np.uint64)
    assert_rows_equal(a.lookup(universe, insert=False), b.lookup(universe, insert=False))


def test_missing_ids_inserted_then_updated() -> None:
    """An id absent before apply ends at initial - lr * g (SGD), and is now present."""
    cfg = Config(dim=4, optimizer=SGDSpec(lr=0.25))
    t = cfg.table()
    keys = u64([11, 12])
    g = np.array([[1, 2, 3, 4], [-4, 0.5, 0, 8]], np.float32)
    init = t.initial_values(keys)
    t.apply_gradients(keys, g)
    assert t.contains(keys).all()
    assert_rows_equal(t.lookup(keys, insert=False), init - np.float32(0.25) * g)
    st = t.stats()
    assert st["inserts"] == 2
    assert len(t) == 2


def test_duplicate_grads_summed_before_one_update() -> None:
    """Adagrad with duplicates applies ONE update with the summed gradient: g = [4, 2] gives
    acc = [16, 4] and w = -lr*g/sqrt(acc) = [-1, -1]; two separate updates would not."""
    opt = AdagradSpec(lr=1.0, eps=1e-8, initial_accumulator=0.0)
    t = Config(dim=2, initializer=ZerosSpec(), optimizer=opt).table()
    t.apply_gradients(u64([5, 5]), np.array([[3.0, 1.0], [1.0, 1.0]], np.float32))
    assert_rows_equal(t.lookup(u64([5]), insert=False), np.array([[-1.0, -1.0]], np.float32))
    # A second call is a second update: acc = [32, 8] after g = [4, 2] again.
    t.apply_gradients(u64([5]), np.array([[4.0, 2.0]], np.float32))
    f = np.float32
    want = np.array(
        [[f(-1) - f(4) / (np.sqrt(f(32)) + f(1e-8)), f(-1) - f(2) / (np.sqrt(f(8)) + f(1e-8))]],
        np.float32,
    )
    assert_rows_equal(t.lookup(u64([5]), insert=False), want)


def test_sgd_lr_is_float32() -> None:
    """lr is held as float32: w = w - float32(0.1) * g exactly."""
    t = Config(dim=3, initializer=ZerosSpec(), optimizer=SGDSpec(lr=0.1)).table()
    g = np.array([[1.0, 3.0, 1e-3]], np.float32)
    t.apply_gradients(u64([1]), g)
    want = np.float32(0) - np.float32(0.1) * g
    assert_rows_equal(t.lookup(u64([1]), insert=False), want)


@pytest.mark.parametrize(
    "bad",
    [np.nan, np.inf, -np.inf],
    ids=["nan", "inf", "-inf"],
)
@pytest.mark.parametrize("pooled", [False, True])
def test_non_finite_grads_rejected_table_unchanged(pooled: bool, bad: float) -> None:
    """A non-finite gradient anywhere rejects the call before any row changes or is inserted."""
    cfg = Config(dim=3, optimizer=AdagradSpec(lr=0.1), capacity=8, num_shards=1)
    t = cfg.table()
    t.apply_gradients(u64(range(6)), np.ones((6, 3), np.float32))
    probe = u64(range(12))
    keys = u64([0, 7, 1, 8, 2])  # present and missing ids; 7 and 8 would need evictions later
    if pooled:
        off = np.array([0, 2, 5])
        g = np.ones((2, 3), np.float32)
        g[1, 1] = bad
        before = snapshot(t, probe)
        with pytest.raises(ValueError, match="grads"):
            t.apply_gradients(keys, g, offsets=off)
    else:
        g = np.ones((5, 3), np.float32)
        g[4, 2] = bad
        before = snapshot(t, probe)
        with pytest.raises(ValueError, match="grads"):
            t.apply_gradients(keys, g)
    assert_unchanged(before, snapshot(t, probe))


def test_lookup_after_apply_sees_updates(rng: np.random.Generator) -> None:
    """lookup_sum after apply pools the updated rows (reference, Adagrad, weights)."""
    t, ref = Config(dim=5, optimizer=AdagradSpec(lr=0.2)).pair()
    keys = rng.integers(0, 30, size=80).astype(np.uint64)
    off = random_offsets(rng, 80, 12)
    w = rng.uniform(0, 2, size=80).astype(np.float32)
    for _ in range(4):
        out = t.lookup_sum(keys, off, weights=w)
        assert_rows_equal(out, ref.lookup_sum(keys, off, weights=w))
        g = _grads(rng, 12, 5)
        t.apply_gradients(keys, g, offsets=off, weights=w)
        ref.apply_gradients(keys, g, offsets=off, weights=w)
    assert_same_state(t, ref, np.arange(30, dtype=np.uint64))


@pytest.mark.parametrize("pooled", [False, True])
def test_large_apply_identical_for_any_thread_count(pooled: bool, rng: np.random.Generator) -> None:
    """A batch big enough to be split over worker threads gives bitwise the same table for
    num_threads 1, 2, 4, equal to the reference."""
    dim, n, bags = 16, 30_000, 3000
    keys = rng.integers(0, 8000, size=n).astype(np.uint64)
    off = random_offsets(rng, n, bags) if pooled else None
    w = rng.uniform(0.5, 1.5, size=n).astype(np.float32) if pooled else None
    g = _grads(rng, bags if pooled else n, dim)
    cfg = Config(dim=dim, optimizer=AdagradSpec(lr=0.05), num_shards=8)
    ref = cfg.reference()
    ref.apply_gradients(keys, g, offsets=off, weights=w, mode="mean" if pooled else "sum")
    universe = np.arange(8000, dtype=np.uint64)
    want = ref.lookup(universe, insert=False)
    for threads in (1, 2, 4):
        t = cfg.table(num_threads=threads)
        t.apply_gradients(keys, g, offsets=off, weights=w, mode="mean" if pooled else "sum")
        assert_rows_equal(t.lookup(universe, insert=False), want, universe)
        assert len(t) == len(ref)
