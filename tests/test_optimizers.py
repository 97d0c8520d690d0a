"""The fused optimizers against the reference, bit for bit, and against hand-computed steps.

SGD (with and without momentum), Adagrad, RowWiseAdagrad, Adam (with weight decay) and
FTRL-Proximal (with l1/l2): per-id and pooled apply, set_lr mid-training, per-row state
(Adam's step count, fresh state on re-insert), row_stride, hyper-parameter validation and
thread-count independence. The hand-computed tests write docs/semantics.md's formulas out
again with np.float32 scalars (or use exactly representable numbers), so that the reference
and the store cannot share a misreading of the spec unnoticed.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
from helpers import (
    Config,
    assert_rows_equal,
    assert_same_state,
    random_offsets,
    store_optimizer,
    u64,
)
from reference import (
    AdagradSpec,
    AdamSpec,
    FTRLSpec,
    OptSpec,
    ReferenceTable,
    RowWiseAdagradSpec,
    SGDSpec,
    ZerosSpec,
    row_stride,
)

import embstore

f32 = np.float32

OPTIMIZERS: list[OptSpec] = [
    SGDSpec(lr=0.1),
    SGDSpec(lr=0.05, momentum=0.9),
    AdagradSpec(lr=0.3, eps=1e-3, initial_accumulator=0.1),
    RowWiseAdagradSpec(lr=0.1),
    RowWiseAdagradSpec(lr=0.3, eps=1e-3, initial_accumulator=0.25),
    AdamSpec(lr=0.01),
    AdamSpec(lr=0.05, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
    FTRLSpec(alpha=0.1),
    FTRLSpec(alpha=0.5, beta=0.5, l1=0.3, l2=0.2),
]
OPT_IDS = [
    "sgd",
    "sgd_momentum",
    "adagrad",
    "rowwise",
    "rowwise_acc",
    "adam",
    "adam_wd",
    "ftrl",
    "ftrl_l1l2",
]
DIMS = [1, 3, 32, 130]


def _grads(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    g = rng.normal(scale=0.5, size=(rows, dim)).astype(np.float32)
    if g.size:
        g.flat[rng.integers(0, g.size)] = 0.0  # zero gradients are legal for every optimizer
    return g


def _apply_both(t: embstore.Table, ref: ReferenceTable, keys: Any, g: Any, **kw: Any) -> None:
    t.apply_gradients(keys, g, **kw)
    ref.apply_gradients(keys, g, **kw)


# --------------------------------------------------------------------------------------
# Random training against the reference
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_per_id_apply_matches_reference(opt: OptSpec, dim: int, rng: np.random.Generator) -> None:
    """Several rounds of per-id apply (duplicates summed in order, one update per distinct
    row, missing ids inserted with fresh state), interleaved with training lookups that
    insert rows (fresh state too); the stored rows equal the reference bit for bit."""
    t, ref = Config(dim=dim, capacity=1000, optimizer=opt, num_shards=4).pair()
    universe = np.arange(80, dtype=np.uint64)
    for n in (1, 5, 40, 0, 200, 120):
        looked = rng.choice(universe, size=4)
        assert_rows_equal(t.lookup(looked), ref.lookup(looked), looked)
        keys = rng.choice(universe[:60], size=n)
        _apply_both(t, ref, keys, _grads(rng, n, dim))
        assert_same_state(t, ref, universe)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_pooled_apply_matches_reference(opt: OptSpec, dim: int, rng: np.random.Generator) -> None:
    """Pooled apply (the backward of lookup_sum) in sum and mean mode, with and without
    weights, over several rounds; equal to the reference bit for bit."""
    t, ref = Config(dim=dim, capacity=1000, optimizer=opt, num_shards=4).pair()
    universe = np.arange(40, dtype=np.uint64)
    rounds: list[tuple[int, int, bool, str]] = [
        (30, 8, False, "sum"),
        (150, 20, True, "mean"),
        (3, 1, True, "sum"),
        (60, 9, False, "mean"),
        (0, 2, False, "sum"),
        (100, 7, True, "mean"),
    ]
    for n, bags, weighted, mode in rounds:
        keys = rng.choice(universe, size=n)
        off = random_offsets(rng, n, bags)
        w = rng.uniform(-1.5, 1.5, size=n).astype(np.float32) if weighted else None
        g = _grads(rng, bags, dim)
        _apply_both(t, ref, keys, g, offsets=off, weights=w, mode=mode)
        assert_same_state(t, ref, universe)
    out = t.lookup_sum(universe, np.array([0, 17, 40]), mode="mean")
    assert_rows_equal(out, ref.lookup_sum(universe, np.array([0, 17, 40]), mode="mean"))


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_state_is_fresh_after_erase_and_eviction(opt: OptSpec, rng: np.random.Generator) -> None:
    """A row erased or evicted loses its optimizer state: re-inserted, it starts afresh
    (Adam at t = 0). A tiny one-shard CLOCK ring under churn equals the reference."""
    t, ref = Config(dim=5, capacity=6, num_shards=1, optimizer=opt).pair()
    universe = np.arange(14, dtype=np.uint64)
    for step in range(12):
        keys = rng.choice(universe, size=rng.integers(1, 9))
        keys = keys[np.isin(keys, np.unique(keys)[:6])]  # at most 6 distinct ids per call
        _apply_both(t, ref, keys, _grads(rng, keys.shape[0], 5))
        if step % 3 == 1:
            gone = rng.choice(universe, size=3)
            assert t.erase(gone) == ref.erase(gone)
        if step % 4 == 2:
            looked = rng.choice(universe, size=2)
            assert_rows_equal(t.lookup(looked), ref.lookup(looked), looked)
        assert_same_state(t, ref, universe)
    assert ref.evictions > 0
    assert ref.erased > 0


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_identical_for_one_or_two_threads(
    opt: OptSpec, pooled: bool, rng: np.random.Generator
) -> None:
    """A batch big enough to be split over worker threads gives bitwise the same table for
    num_threads 1 and 2, equal to the reference (two calls: state carries over)."""
    dim, n, bags, ids = 8, 12_000, 1500, 3000
    cfg = Config(dim=dim, capacity=8192, optimizer=opt, num_shards=8)
    ref = cfg.reference()
    tables = [cfg.table(num_threads=threads) for threads in (1, 2)]
    for _ in range(2):
        keys = rng.integers(0, ids, size=n).astype(np.uint64)
        kw: dict[str, Any] = {}
        if pooled:
            kw = {
                "offsets": random_offsets(rng, n, bags),
                "weights": rng.uniform(0.5, 1.5, size=n).astype(np.float32),
                "mode": "mean",
            }
        g = _grads(rng, bags if pooled else n, dim)
        ref.apply_gradients(keys, g, **kw)
        for t in tables:
            t.apply_gradients(keys, g, **kw)
    universe = np.arange(ids, dtype=np.uint64)
    want = ref.lookup(universe, insert=False)
    for t in tables:
        assert_rows_equal(t.lookup(universe, insert=False), want, universe)
        assert len(t) == len(ref)


# --------------------------------------------------------------------------------------
# set_lr and the optimizer property
# --------------------------------------------------------------------------------------


def _lr_field(spec: OptSpec) -> str:
    return "alpha" if isinstance(spec, FTRLSpec) else "lr"


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_set_lr_mid_training_matches_reference(opt: OptSpec, rng: np.random.Generator) -> None:
    """set_lr changes the learning rate (alpha for FTRL) of every later call; the state
    carries over; equal to the reference that changes its lr at the same points."""
    dim = 6
    t, ref = Config(dim=dim, capacity=1000, optimizer=opt, num_shards=2).pair()
    universe = np.arange(30, dtype=np.uint64)
    for lr in (None, 0.37, 0.0123, 1.5):
        if lr is not None:
            t.set_lr(lr)
            ref.set_lr(lr)
        for _ in range(2):
            keys = rng.choice(universe, size=25)
            _apply_both(t, ref, keys, _grads(rng, 25, dim))
        assert_same_state(t, ref, universe)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_optimizer_property_reports_current_lr(opt: OptSpec) -> None:
    """t.optimizer is a frozen settings object of the constructed type: equal to the
    constructor's argument, then carrying the new lr after set_lr, other fields unchanged."""
    given = store_optimizer(opt)
    t = Config(dim=3, capacity=16, optimizer=opt).table()
    assert t.optimizer == given
    assert type(t.optimizer) is type(given)
    name = _lr_field(opt)
    t.set_lr(0.0625)
    now = t.optimizer
    assert type(now) is type(given)
    assert getattr(now, name) == 0.0625
    for fld in fields(given):
        if fld.name != name:
            assert getattr(now, fld.name) == getattr(given, fld.name), fld.name
    with pytest.raises((AttributeError, TypeError)):
        now.__setattr__(name, 1.0)  # frozen
    t.set_lr(3)  # an int is a number
    assert getattr(t.optimizer, name) == 3.0


@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_set_lr_rejects_bad_values(opt: OptSpec, bad: float, rng: np.random.Generator) -> None:
    """set_lr(lr <= 0 or non-finite) raises ValueError and changes nothing: the settings
    stay, and later updates still use the old lr."""
    t, ref = Config(dim=4, capacity=64, optimizer=opt).pair()
    keys = u64([1, 2, 3, 2])
    _apply_both(t, ref, keys, _grads(rng, 4, 4))
    before = t.optimizer
    with pytest.raises(ValueError, match="lr"):
        t.set_lr(bad)
    assert t.optimizer == before
    _apply_both(t, ref, keys, _grads(rng, 4, 4))
    assert_same_state(t, ref, u64(range(6)))


def test_set_lr_on_closed_table_raises() -> None:
    """set_lr on a closed table raises ValueError (like every operation)."""
    t = Config(dim=2, capacity=8, optimizer=AdamSpec(lr=0.1)).table()
    t.close()
    with pytest.raises(ValueError, match="closed"):
        t.set_lr(0.5)


def test_sgd_set_lr_by_hand() -> None:
    """SGD: w = w - lr * g with the lr in force at each call (exact numbers)."""
    t = Config(dim=2, initializer=ZerosSpec(), optimizer=SGDSpec(lr=0.5)).table()
    g = np.array([[1.0, -2.0]], np.float32)
    t.apply_gradients(u64([9]), g)
    t.set_lr(0.25)
    t.apply_gradients(u64([9]), g)
    assert_rows_equal(t.lookup(u64([9]), insert=False), np.array([[-0.75, 1.5]], np.float32))


# --------------------------------------------------------------------------------------
# Layout, validation
# --------------------------------------------------------------------------------------

STRIDE_CASES: list[tuple[OptSpec, int, int]] = [
    # (optimizer, dim, floats per row = dim + state width rounded up to 4)
    (SGDSpec(lr=0.1), 1, 4),
    (SGDSpec(lr=0.1), 8, 8),
    (SGDSpec(lr=0.1, momentum=0.5), 1, 4),
    (SGDSpec(lr=0.1, momentum=0.5), 3, 8),
    (SGDSpec(lr=0.1, momentum=0.5), 8, 16),
    (AdagradSpec(lr=0.1), 3, 8),
    (AdagradSpec(lr=0.1), 130, 260),
    (RowWiseAdagradSpec(lr=0.1), 1, 4),
    (RowWiseAdagradSpec(lr=0.1), 3, 4),
    (RowWiseAdagradSpec(lr=0.1), 4, 8),
    (RowWiseAdagradSpec(lr=0.1), 130, 132),
    (AdamSpec(lr=0.1), 1, 4),
    (AdamSpec(lr=0.1), 2, 8),
    (AdamSpec(lr=0.1), 8, 28),
    (AdamSpec(lr=0.1), 130, 392),
    (FTRLSpec(alpha=0.1), 1, 4),
    (FTRLSpec(alpha=0.1), 3, 12),
    (FTRLSpec(alpha=0.1), 130, 392),
]


@pytest.mark.parametrize(("opt", "dim", "stride"), STRIDE_CASES)
def test_row_stride(opt: OptSpec, dim: int, stride: int) -> None:
    """stats()['row_stride'] = dim + state width (SGD 0 or dim with momentum, Adagrad dim,
    RowWiseAdagrad 1, Adam 2*dim+1, FTRL 2*dim), rounded up to a multiple of 4."""
    assert row_stride(opt, dim) == stride
    st = Config(dim=dim, capacity=64, optimizer=opt, num_shards=1).table().stats()
    assert st["row_stride"] == stride
    assert st["bytes_per_row"] >= 4 * stride


def test_bytes_per_row_grows_with_the_state() -> None:
    """Same dim and capacity: bytes_per_row orders the optimizers as their row strides do
    (SGD 8 < RowWiseAdagrad 12 < Adagrad = SGD+momentum 16 < FTRL 24 < Adam 28 floats)."""
    specs: list[OptSpec] = [
        SGDSpec(lr=0.1),
        RowWiseAdagradSpec(lr=0.1),
        AdagradSpec(lr=0.1),
        SGDSpec(lr=0.1, momentum=0.9),
        FTRLSpec(alpha=0.1),
        AdamSpec(lr=0.1),
    ]
    stats = [Config(dim=8, capacity=256, optimizer=s, num_shards=2).table().stats() for s in specs]
    assert [s["row_stride"] for s in stats] == [8, 12, 16, 16, 24, 28]
    b = [s["bytes_per_row"] for s in stats]
    assert b[0] < b[1] < b[2] == b[3] < b[4] < b[5]


NAN, INF = math.nan, math.inf
INVALID: list[tuple[str, dict[str, Any]]] = [
    *[("SGD", {"lr": v}) for v in (0.0, -0.1, NAN, INF, -INF)],
    *[("SGD", {"lr": 0.1, "momentum": v}) for v in (-0.1, 1.0, 1.5, NAN, INF)],
    *[(name, {"lr": v}) for name in ("Adagrad", "RowWiseAdagrad") for v in (0.0, -1.0, NAN)],
    *[
        (name, {"lr": 0.1, "eps": v})
        for name in ("Adagrad", "RowWiseAdagrad")
        for v in (0.0, -1e-8, NAN, INF)
    ],
    *[
        (name, {"lr": 0.1, "initial_accumulator": v})
        for name in ("Adagrad", "RowWiseAdagrad")
        for v in (-0.1, NAN, INF)
    ],
    *[("Adam", {"lr": v}) for v in (0.0, -0.1, NAN, INF)],
    *[("Adam", {"lr": 0.1, "beta1": v}) for v in (-0.1, 1.0, 1.5, NAN, INF)],
    *[("Adam", {"lr": 0.1, "beta2": v}) for v in (-0.1, 1.0, 1.5, NAN, INF)],
    *[("Adam", {"lr": 0.1, "eps": v}) for v in (0.0, -1e-8, NAN, INF)],
    *[("Adam", {"lr": 0.1, "weight_decay": v}) for v in (-0.1, NAN, INF)],
    *[("FTRL", {"alpha": v}) for v in (0.0, -0.1, NAN, INF)],
    *[("FTRL", {"alpha": 0.1, "beta": v}) for v in (-0.1, NAN, INF)],
    *[("FTRL", {"alpha": 0.1, "l1": v}) for v in (-0.1, NAN, INF)],
    *[("FTRL", {"alpha": 0.1, "l2": v}) for v in (-0.1, NAN, INF)],
]


@pytest.mark.parametrize(("name", "kwargs"), INVALID, ids=lambda p: str(p))
def test_invalid_hyper_parameters_rejected(name: str, kwargs: dict[str, Any]) -> None:
    """Each bad hyper-parameter raises ValueError naming it, at construction."""
    bad = next(k for k in kwargs if k not in ("lr", "alpha") or len(kwargs) == 1)
    with pytest.raises(ValueError, match=bad):
        getattr(embstore, name)(**kwargs)


VALID_EDGES: list[OptSpec] = [
    SGDSpec(lr=0.1, momentum=0.0),
    SGDSpec(lr=1e-30, momentum=0.999999),
    AdagradSpec(lr=0.1, initial_accumulator=0.0),
    RowWiseAdagradSpec(lr=0.1, eps=1e-30, initial_accumulator=0.0),
    AdamSpec(lr=0.1, beta1=0.0, beta2=0.0, weight_decay=0.0),
    AdamSpec(lr=0.1, beta1=0.999, beta2=0.9999, weight_decay=2.0),
    FTRLSpec(alpha=0.1, beta=0.0, l1=0.0, l2=0.0),
]


@pytest.mark.parametrize("opt", VALID_EDGES, ids=lambda s: repr(s))
def test_edge_hyper_parameters_accepted_and_exact(opt: OptSpec, rng: np.random.Generator) -> None:
    """Hyper-parameters on the edge of their range construct and train like the reference
    (beta2 = 0: bc2 = 1; FTRL beta = 0 with a zero gradient: z = 0 gives w = 0, not 0/0)."""
    t, ref = Config(dim=3, capacity=64, optimizer=opt).pair()
    universe = u64(range(10))
    for _ in range(3):
        keys = rng.choice(universe, size=8)
        g = _grads(rng, 8, 3)
        g[:, 0] = 0.0
        _apply_both(t, ref, keys, g)
        assert_same_state(t, ref, universe)
    assert np.isfinite(t.lookup(universe, insert=False)).all()


def test_rowwise_adagrad_is_its_own_type() -> None:
    """A RowWiseAdagrad table is not run as element-wise Adagrad."""
    t = Config(dim=4, capacity=8, optimizer=RowWiseAdagradSpec(lr=0.1)).table()
    assert type(t.optimizer) is embstore.RowWiseAdagrad
    assert t.stats()["row_stride"] == 8


# --------------------------------------------------------------------------------------
# Hand-computed steps (independent of the reference)
# --------------------------------------------------------------------------------------


def _row(t: embstore.Table, key: int) -> np.ndarray:
    row: np.ndarray = t.lookup(u64([key]), insert=False)[0]
    return row


def test_sgd_momentum_by_hand() -> None:
    """lr 0.5, momentum 0.5, zeros: buf = mu*buf + g; w = w - lr*buf (exact numbers).
    Call 1 (g summed from [0.5,-1] twice = [1,-2]): buf [1,-2], w [-0.5, 1].
    Call 2 (g [2,2]): buf [2.5, 1], w [-1.75, 0.5]. Call 3 (g 0): buf [1.25, 0.5],
    w [-2.375, 0.25] (the buffer keeps moving the row)."""
    t = Config(dim=2, initializer=ZerosSpec(), optimizer=SGDSpec(lr=0.5, momentum=0.5)).table()
    t.apply_gradients(u64([7, 7]), np.array([[0.5, -1.0], [0.5, -1.0]], np.float32))
    assert_rows_equal(_row(t, 7), np.array([-0.5, 1.0], np.float32))
    t.apply_gradients(u64([7]), np.array([[2.0, 2.0]], np.float32))
    assert_rows_equal(_row(t, 7), np.array([-1.75, 0.5], np.float32))
    t.apply_gradients(u64([7]), np.zeros((1, 2), np.float32))
    assert_rows_equal(_row(t, 7), np.array([-2.375, 0.25], np.float32))


def test_sgd_momentum_float32_by_hand() -> None:
    """momentum 0.9 and lr 0.1 are float32: two steps written out with np.float32."""
    t0 = Config(dim=2, optimizer=SGDSpec(lr=0.1, momentum=0.9)).table()
    w = t0.initial_values(u64([3]))[0]
    g1 = np.array([0.3, -1.7], np.float32)
    g2 = np.array([-0.2, 0.45], np.float32)
    mu, lr = f32(0.9), f32(0.1)
    want = []
    for j in range(2):
        buf = f32(0.0)
        wj = w[j]
        for g in (g1, g2):
            buf = f32(f32(mu * buf) + g[j])
            wj = f32(wj - f32(lr * buf))
        want.append(wj)
    t0.apply_gradients(u64([3]), g1[None])
    t0.apply_gradients(u64([3]), g2[None])
    assert_rows_equal(_row(t0, 3), np.array(want, np.float32))


def test_adagrad_by_hand() -> None:
    """lr 1, initial_accumulator 7, g [3, -3]: acc 16, w = 0 - 3/(4 + 1e-8) = -0.75."""
    opt = AdagradSpec(lr=1.0, initial_accumulator=7.0)
    t = Config(dim=2, initializer=ZerosSpec(), optimizer=opt).table()
    t.apply_gradients(u64([1]), np.array([[3.0, -3.0]], np.float32))
    assert_rows_equal(_row(t, 1), np.array([-0.75, 0.75], np.float32))


def test_rowwise_adagrad_by_hand() -> None:
    """lr 0.5, initial_accumulator 11, dim 2. g [1, 7]: s = 50, acc = 11 + 50/2 = 36,
    d = 6 (+1e-8 lost), w = -(0.5*g)/6 (element-wise Adagrad would give -0.5*sign(g)/...).
    Then g [-2, 2]: s = 8, acc = 40, d = sqrt(40) + 1e-8 in float32."""
    opt = RowWiseAdagradSpec(lr=0.5, initial_accumulator=11.0)
    t = Config(dim=2, initializer=ZerosSpec(), optimizer=opt).table()
    t.apply_gradients(u64([4]), np.array([[1.0, 7.0]], np.float32))
    lr = f32(0.5)
    w = np.array([-(f32(lr * f32(1)) / f32(6)), -(f32(lr * f32(7)) / f32(6))], np.float32)
    assert_rows_equal(_row(t, 4), w)
    t.apply_gradients(u64([4]), np.array([[-2.0, 2.0]], np.float32))
    d = f32(np.sqrt(f32(40)) + f32(1e-8))
    w = np.array([w[0] - f32(lr * f32(-2)) / d, w[1] - f32(lr * f32(2)) / d], np.float32)
    assert_rows_equal(_row(t, 4), w)


def test_rowwise_adagrad_sums_in_order() -> None:
    """The row sum of g*g is sequential float32 from 0: g = [4096, 1 x 15] gives
    s = 2**24 (each + 1 is rounded away), acc = 2**24 / 16 = 2**20, d = 1024 exactly, so
    w = [-4, -1/1024 x 15]. A pairwise or multi-accumulator sum (numpy's, SIMD lanes) keeps
    some of the ones and gives another d."""
    opt = RowWiseAdagradSpec(lr=1.0)
    t = Config(dim=16, initializer=ZerosSpec(), optimizer=opt).table()
    g = np.ones(16, np.float32)
    g[0] = 4096.0
    t.apply_gradients(u64([2]), g[None])
    want = np.full(16, -1.0 / 1024.0, np.float32)
    want[0] = -4.0
    assert_rows_equal(_row(t, 2), want)
    lanes = np.sum((g * g).reshape(2, 8), axis=0, dtype=np.float32).sum(dtype=np.float32)
    assert lanes != f32(2**24)  # the test discriminates: other sum orders differ


def _adam_by_hand(
    w0: np.ndarray,
    grads: list[np.ndarray],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> np.ndarray:
    """Adam written out per element with float32 scalars, steps t = 1, 2, ..."""
    lr32, b1, b2, e, wd = f32(lr), f32(beta1), f32(beta2), f32(eps), f32(weight_decay)
    out = []
    for j in range(w0.shape[0]):
        w, m, v = f32(w0[j]), f32(0), f32(0)
        for t, g in enumerate(grads, start=1):
            gj = f32(g[j])
            if wd != 0:
                w = f32(w - f32(f32(lr32 * wd) * w))
            m = f32(f32(b1 * m) + f32(f32(f32(1) - b1) * gj))
            v = f32(f32(b2 * v) + f32(f32(f32(f32(1) - b2) * gj) * gj))
            bc1 = f32(1.0 - float(b1) ** t)
            bc2 = f32(1.0 - float(b2) ** t)
            step = f32(lr32 * f32(m / bc1))
            w = f32(w - f32(step / f32(f32(np.sqrt(f32(v / bc2))) + e)))
        out.append(w)
    return np.array(out, np.float32)


@pytest.mark.parametrize("weight_decay", [0.0, 0.25])
def test_adam_by_hand(weight_decay: float) -> None:
    """Two Adam steps from the initializer's row, written out with np.float32; the first
    step is about -lr*sign(g) (bias correction at work); duplicates of one call are one
    step (t = 1 after a call that names the id three times)."""
    kw: dict[str, float] = {
        "lr": 0.1,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": weight_decay,
    }
    t = Config(dim=3, optimizer=AdamSpec(**kw)).table()
    w0 = t.initial_values(u64([5]))[0]
    g1 = np.array([0.5, -0.03, 2.0], np.float32)
    g2 = np.array([-0.25, 0.07, 1.5], np.float32)
    parts = np.array([[0.25, -0.01, 1.0], [0.125, -0.01, 0.5], [0.125, -0.01, 0.5]], np.float32)
    assert np.array_equal(parts[0] + parts[1] + parts[2], g1)
    t.apply_gradients(u64([5, 5, 5]), parts)
    one = _adam_by_hand(w0, [g1], **kw)
    assert_rows_equal(_row(t, 5), one)
    decayed = w0 - f32(f32(0.1) * f32(weight_decay)) * w0
    assert np.allclose(one, decayed - f32(0.1) * np.sign(g1), rtol=0, atol=1e-5)
    t.apply_gradients(u64([5]), g2[None])
    assert_rows_equal(_row(t, 5), _adam_by_hand(w0, [g1, g2], **kw))


def test_adam_bias_correction_uses_the_float32_beta() -> None:
    """bc1 = float32(1 - float64(beta1)**t) with beta1 held as float32: for beta1 = 0.9,
    float64(float32(0.9)) != 0.9 and the two readings give different bc1 and rows."""
    b1 = f32(0.9)
    assert f32(1.0 - float(b1)) != f32(1.0 - 0.9)  # the two readings differ
    kw: dict[str, float] = {
        "lr": 1.0,
        "beta1": 0.9,
        "beta2": 0.5,
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    t = Config(dim=4, initializer=ZerosSpec(), optimizer=AdamSpec(**kw)).table()
    g = np.array([0.7, -1.3, 3.1, 0.011], np.float32)
    t.apply_gradients(u64([8]), g[None])
    want = _adam_by_hand(np.zeros(4, np.float32), [g], **kw)
    assert_rows_equal(_row(t, 8), want)
    # With the double 0.9 in the bias correction the step m/bc1 would be another number.
    m = f32(f32(1) - b1) * g
    assert not np.array_equal(m / f32(1.0 - float(b1)), m / f32(1.0 - 0.9))


def test_adam_step_count_is_per_row(rng: np.random.Generator) -> None:
    """Row A updated in calls 1, 2, 3 and row B only in call 3 (same gradient): A is at
    t = 3, B at t = 1, so their bias corrections differ. Equal to the reference; B equals a
    single hand-computed step from its initial row, A three steps; erasing A and updating
    it again starts over at t = 1."""
    spec = AdamSpec(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-7)
    kw: dict[str, float] = {
        "lr": spec.lr,
        "beta1": spec.beta1,
        "beta2": spec.beta2,
        "eps": spec.eps,
        "weight_decay": 0.0,
    }
    t, ref = Config(dim=4, optimizer=spec).pair()
    a, b = 100, 200
    w0 = t.initial_values(u64([a, b]))
    g = np.array([[0.3, -0.6, 1.1, 0.02]], np.float32)
    _apply_both(t, ref, u64([a]), g)
    _apply_both(t, ref, u64([a]), g)
    assert_rows_equal(t.lookup(u64([b])), ref.lookup(u64([b])))  # B inserted by a lookup
    _apply_both(t, ref, u64([a, b]), np.concatenate([g, g]))
    state_a, state_b = ref.row_state(a), ref.row_state(b)
    assert state_a is not None
    assert state_a.t == 3
    assert state_b is not None
    assert state_b.t == 1
    assert_same_state(t, ref, u64([a, b]))
    assert_rows_equal(_row(t, a), _adam_by_hand(w0[0], [g[0]] * 3, **kw))
    assert_rows_equal(_row(t, b), _adam_by_hand(w0[1], [g[0]], **kw))
    assert not np.array_equal(_row(t, b), _adam_by_hand(w0[1], [g[0]] * 3, **kw)[None])
    assert t.erase(u64([a])) == ref.erase(u64([a])) == 1
    _apply_both(t, ref, u64([a]), g)
    assert_rows_equal(_row(t, a), _adam_by_hand(w0[0], [g[0]], **kw))
    assert_same_state(t, ref, u64([a, b]), counters=False)  # _row read the store only


def _ftrl_by_hand(
    w0: np.ndarray, steps: list[tuple[np.ndarray, float]], *, beta: float, l1: float, l2: float
) -> np.ndarray:
    """FTRL-Proximal written out per element with float32 scalars; ``steps`` holds
    (gradient, alpha in force) pairs."""
    bt, r1, r2 = f32(beta), f32(l1), f32(l2)
    out = []
    for j in range(w0.shape[0]):
        w, z, n = f32(w0[j]), f32(0), f32(0)
        for g, alpha in steps:
            a = f32(alpha)
            gj = f32(g[j])
            n2 = f32(n + f32(gj * gj))
            sigma = f32(f32(f32(np.sqrt(n2)) - f32(np.sqrt(n))) / a)
            z = f32(f32(z + gj) - f32(sigma * w))
            n = n2
            if abs(z) <= r1:
                w = f32(0)
            else:
                sign = f32(-1) if z < 0 else f32(1)
                num = f32(z - f32(sign * r1))
                den = f32(f32(f32(bt + f32(np.sqrt(n))) / a) + r2)
                w = f32(-num / den)
        out.append(w)
    return np.array(out, np.float32)


def test_ftrl_by_hand_exact() -> None:
    """alpha 0.5, beta 1, l1 3.5, l2 2, zeros. g [3, -4]: n [9, 16], z [3, -4];
    |3| <= 3.5 gives w 0; w[1] = -(-4 + 3.5) / ((1 + 4)/0.5 + 2) = 0.5/12.
    Then g [1, 0]: z[0] = 4 - sigma*0 = 4 > l1, w[0] = -(4 - 3.5)/((1 + sqrt(10))/0.5 + 2);
    element 1 has sigma 0, so z and w stay."""
    opt = FTRLSpec(alpha=0.5, beta=1.0, l1=3.5, l2=2.0)
    t = Config(dim=2, initializer=ZerosSpec(), optimizer=opt).table()
    t.apply_gradients(u64([6]), np.array([[3.0, -4.0]], np.float32))
    w1 = f32(0.5) / f32(12.0)
    assert_rows_equal(_row(t, 6), np.array([0.0, w1], np.float32))
    t.apply_gradients(u64([6]), np.array([[1.0, 0.0]], np.float32))
    den = f32(f32(f32(1) + f32(np.sqrt(f32(10)))) / f32(0.5)) + f32(2)
    assert_rows_equal(_row(t, 6), np.array([-(f32(0.5) / den), w1], np.float32))


@pytest.mark.parametrize(("l1", "l2"), [(0.0, 0.0), (0.05, 0.3)])
def test_ftrl_by_hand(l1: float, l2: float) -> None:
    """Three FTRL steps from the initializer's (non-zero) row, so sigma * w matters; the
    formulas written out with np.float32; alpha changed by set_lr before the third."""
    t = Config(dim=3, optimizer=FTRLSpec(alpha=0.2, beta=0.7, l1=l1, l2=l2)).table()
    w0 = t.initial_values(u64([4]))[0]
    assert np.all(w0 != 0)
    steps = [
        (np.array([0.4, -0.02, 1.3], np.float32), 0.2),
        (np.array([-0.1, 0.03, 0.8], np.float32), 0.2),
        (np.array([0.2, -0.2, 0.2], np.float32), 0.05),
    ]
    for k, (g, alpha) in enumerate(steps, start=1):
        if alpha != 0.2:
            t.set_lr(alpha)
        t.apply_gradients(u64([4]), g[None])
        want = _ftrl_by_hand(w0, steps[:k], beta=0.7, l1=l1, l2=l2)
        assert_rows_equal(_row(t, 4), want)


def test_ftrl_l1_gives_exact_zeros(rng: np.random.Generator) -> None:
    """Under l1 many weights become exactly 0 (|z| <= l1), others stay non-zero; equal to
    the reference bit for bit; without l1 (z != 0) no weight is 0."""
    dim = 16
    universe = np.arange(50, dtype=np.uint64)
    zeros = {}
    for l1 in (0.0, 0.4):
        t, ref = Config(dim=dim, optimizer=FTRLSpec(alpha=0.1, l1=l1, l2=0.1)).pair()
        for _ in range(4):
            keys = rng.choice(universe, size=100)
            _apply_both(t, ref, keys, _grads(rng, 100, dim))
        assert_same_state(t, ref, universe)
        rows = t.lookup(universe, insert=False)[t.contains(universe)]
        zeros[l1] = int(np.count_nonzero(rows == 0.0))
        assert np.count_nonzero(rows) > rows.size // 10
    assert zeros[0.4] > 0.1 * 50 * dim  # about 16% with this seed
    assert zeros[0.0] <= 2  # only an element whose z is exactly 0 (a zero gradient)


def test_new_optimizers_exported() -> None:
    """The optimizers are public names of the package, built with keyword arguments."""
    for name in ("SGD", "Adagrad", "RowWiseAdagrad", "Adam", "FTRL"):
        assert name in embstore.__all__
    assert embstore.SGD(0.1).momentum == 0.0
    assert embstore.Adam(0.1) == embstore.Adam(
        lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0
    )
    assert embstore.FTRL(0.1) == embstore.FTRL(alpha=0.1, beta=1.0, l1=0.0, l2=0.0)
    assert embstore.RowWiseAdagrad(0.1) == embstore.RowWiseAdagrad(
        lr=0.1, eps=1e-8, initial_accumulator=0.0
    )
