"""API surface: properties, defaults, argument validation, dtypes, out= buffers, lifecycle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import (
    UNIFORM,
    Config,
    assert_rows_equal,
    assert_unchanged,
    snapshot,
    u64,
)
from reference import AdagradSpec, SGDSpec

import embstore

DIM = 4
CFG = Config(dim=DIM, capacity=64, optimizer=SGDSpec(lr=0.5), initializer=UNIFORM, num_shards=1)
PROBE = u64([*range(32), 2**64 - 1])
MAX = 2**64 - 1


@pytest.fixture
def table() -> embstore.Table:
    """A small table holding ids 0..9, ids 0..4 moved away from their initial rows."""
    t = CFG.table()
    keys = u64(range(10))
    t.lookup(keys)
    t.apply_gradients(keys[:5], np.full((5, DIM), 0.25, np.float32))
    return t


# ---- properties and defaults ---------------------------------------------------------


def test_properties_reflect_constructor() -> None:
    """dim/capacity/num_shards/num_threads are reported as configured; a new table is empty."""
    t = embstore.Table(
        dim=32,
        capacity=1000,
        optimizer=embstore.Adagrad(lr=0.01, eps=1e-8, initial_accumulator=0.0),
        initializer=embstore.Normal(std=0.01, seed=0),
        num_shards=4,
        eviction="clock",
        num_threads=2,
    )
    assert (t.dim, t.capacity, t.num_shards, t.num_threads) == (32, 1000, 4, 2)
    assert len(t) == 0
    assert t.closed is False


def test_defaults() -> None:
    """num_shards/num_threads default to usable values (power of two, >= 1)."""
    t = embstore.Table(
        dim=8, capacity=4096, optimizer=embstore.SGD(lr=0.1), initializer=embstore.Zeros()
    )
    assert t.num_shards >= 1
    assert t.num_shards & (t.num_shards - 1) == 0
    assert t.num_threads >= 1
    assert t.dim == 8
    assert t.capacity == 4096


@pytest.mark.parametrize(
    ("capacity", "shards"),
    [
        (1, 1),
        (16383, 1),
        (16384, 2),
        (32767, 2),
        (32768, 2),
        (65536, 4),
        (93145, 4),
        (262143, 8),
        (262144, 16),
        (10**6, 16),
        (10**8, 16),
    ],
)
def test_default_shards_one_per_16384_rows_at_most_16(capacity: int, shards: int) -> None:
    """Without num_shards a table gets one shard per 16,384 rows, at most 16, and at least
    two from 16,384 rows (an apply runs one task per shard)."""
    assert embstore.Table(dim=1, capacity=capacity).num_shards == shards


def test_stats_keys_and_values() -> None:
    """stats() reports every documented key, and sizes match the configuration."""
    t = CFG.table()
    t.lookup(u64([1, 2, 2]))
    st = t.stats()
    expected = {
        "size",
        "capacity",
        "dim",
        "num_shards",
        "hits",
        "misses",
        "inserts",
        "evictions",
        "erased",
        "bytes_per_row",
    }
    assert expected <= set(st)
    assert st["size"] == len(t) == 2
    assert (st["capacity"], st["dim"], st["num_shards"]) == (64, DIM, 1)
    assert st["bytes_per_row"] >= 4 * DIM
    assert st["inserts"] == 2
    assert st["hits"] + st["misses"] == 3


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"dim": 0}, "dim"),
        ({"dim": -3}, "dim"),
        ({"capacity": 0}, "capacity"),
        ({"capacity": -1}, "capacity"),
        ({"num_shards": 3}, "num_shards"),
        ({"num_shards": 6}, "num_shards"),
        ({"num_shards": 0}, "num_shards"),
        ({"eviction": "lru"}, "eviction"),
        # An index slot keeps row + 1 in 31 bits; a table's rows are numbered in 32 bits.
        ({"capacity": 2**31, "num_shards": 1}, "capacity per shard"),
        ({"capacity": 2**33, "num_shards": 4096}, "capacity"),
    ],
)
def test_bad_configuration(kwargs: dict[str, Any], name: str) -> None:
    """Invalid constructor arguments raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=name):
        CFG.table(**kwargs)


def test_capacity_error_is_runtime_error() -> None:
    """CapacityError is a RuntimeError subclass."""
    assert issubclass(embstore.CapacityError, RuntimeError)


# ---- bad inputs: each raises before anything changes ---------------------------------

N = 4
K = np.arange(20, 20 + N, dtype=np.uint64)  # ids not yet present: a wrong insert shows
OFF = np.array([0, 1, 4], np.int64)
G = np.full((N, DIM), 0.5, np.float32)
GB = np.full((2, DIM), 0.5, np.float32)
W = np.ones(N, np.float32)

Op = Callable[[embstore.Table], object]

BAD_KEYS: list[tuple[str, Any, type[Exception]]] = [
    ("float", np.array([1.0, 2.0, 3.0, 4.0]), TypeError),
    ("float32", np.array([1.0, 2.0, 3.0, 4.0], np.float32), TypeError),
    ("str", np.array(["1", "2", "3", "4"]), TypeError),
    ("object", np.array([1, 2, 3, 4], dtype=object), TypeError),
    ("bool", np.array([True, False, True, True]), TypeError),
    ("complex", np.array([1, 2, 3, 4], dtype=np.complex128), TypeError),
    ("2d", np.arange(20, 24, dtype=np.uint64).reshape(2, 2), ValueError),
    ("0d", np.array(21, dtype=np.uint64), ValueError),
]

KEY_OPS: list[tuple[str, Callable[[embstore.Table, Any], object]]] = [
    ("lookup", lambda t, k: t.lookup(k)),
    ("lookup_sum", lambda t, k: t.lookup_sum(k, OFF)),
    ("apply", lambda t, k: t.apply_gradients(k, G)),
    ("apply_pooled", lambda t, k: t.apply_gradients(k, GB, offsets=OFF)),
    ("contains", lambda t, k: t.contains(k)),
    ("erase", lambda t, k: t.erase(k)),
    ("initial_values", lambda t, k: t.initial_values(k)),
]


def _ro(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def _strided(shape: tuple[int, int]) -> np.ndarray:
    return np.zeros((shape[0], shape[1] * 2), np.float32)[:, ::2]


OTHER_BAD: list[Any] = [
    # offsets
    ("offsets_not_monotone", lambda t: t.lookup_sum(K, [0, 3, 2, 4]), ValueError, "offsets"),
    ("offsets_negative", lambda t: t.lookup_sum(K, [0, -1, 4]), ValueError, "offsets"),
    ("offsets_first_not_0", lambda t: t.lookup_sum(K, [1, 4]), ValueError, "offsets"),
    ("offsets_last_short", lambda t: t.lookup_sum(K, [0, 2, 3]), ValueError, "offsets"),
    ("offsets_last_long", lambda t: t.lookup_sum(K, [0, 2, 5]), ValueError, "offsets"),
    ("offsets_empty", lambda t: t.lookup_sum(K, np.zeros(0, np.int64)), ValueError, "offsets"),
    ("offsets_float", lambda t: t.lookup_sum(K, np.array([0.0, 4.0])), TypeError, "offsets"),
    ("offsets_2d", lambda t: t.lookup_sum(K, np.array([[0, 4]])), ValueError, "offsets"),
    (
        "apply_offsets_not_monotone",
        lambda t: t.apply_gradients(K, GB, offsets=[0, 3, 2]),
        ValueError,
        "offsets",
    ),
    (
        "apply_offsets_last",
        lambda t: t.apply_gradients(K, GB, offsets=[0, 1, 3]),
        ValueError,
        "offsets",
    ),
    (
        "apply_offsets_float",
        lambda t: t.apply_gradients(K, GB, offsets=np.array([0.0, 1.0, 4.0])),
        TypeError,
        "offsets",
    ),
    # weights
    (
        "weights_short",
        lambda t: t.lookup_sum(K, OFF, weights=np.ones(N - 1, np.float32)),
        ValueError,
        "weights",
    ),
    (
        "weights_2d",
        lambda t: t.lookup_sum(K, OFF, weights=np.ones((N, 1), np.float32)),
        ValueError,
        "weights",
    ),
    (
        "weights_nan",
        lambda t: t.lookup_sum(K, OFF, weights=np.array([1, np.nan, 1, 1], np.float32)),
        ValueError,
        "weights",
    ),
    (
        "apply_weights_long",
        lambda t: t.apply_gradients(K, GB, offsets=OFF, weights=np.ones(N + 1, np.float32)),
        ValueError,
        "weights",
    ),
    (
        "apply_weights_inf",
        lambda t: t.apply_gradients(
            K, GB, offsets=OFF, weights=np.array([1, 1, np.inf, 1], np.float32)
        ),
        ValueError,
        "weights",
    ),
    (
        "apply_weights_without_offsets",
        lambda t: t.apply_gradients(K, G, weights=W),
        ValueError,
        "weights",
    ),
    # grads
    (
        "grads_wide",
        lambda t: t.apply_gradients(K, np.zeros((N, DIM + 1), np.float32)),
        ValueError,
        "grads",
    ),
    (
        "grads_long",
        lambda t: t.apply_gradients(K, np.zeros((N + 1, DIM), np.float32)),
        ValueError,
        "grads",
    ),
    (
        "grads_1d",
        lambda t: t.apply_gradients(K, np.zeros(N * DIM, np.float32)),
        ValueError,
        "grads",
    ),
    (
        "grads_pooled_rows",
        lambda t: t.apply_gradients(K, G, offsets=OFF),
        ValueError,
        "grads",
    ),
    ("grads_int", lambda t: t.apply_gradients(K, np.ones((N, DIM), np.int64)), TypeError, "grads"),
    (
        "grads_int32_pooled",
        lambda t: t.apply_gradients(K, np.ones((2, DIM), np.int32), offsets=OFF),
        TypeError,
        "grads",
    ),
    (
        "grads_nan",
        lambda t: t.apply_gradients(K, np.where(np.eye(N, DIM) > 0, np.nan, G)),
        ValueError,
        "grads",
    ),
    (
        "grads_inf",
        lambda t: t.apply_gradients(K, np.where(np.eye(N, DIM) > 0, np.inf, G)),
        ValueError,
        "grads",
    ),
    (
        "grads_neg_inf_pooled",
        lambda t: t.apply_gradients(K, np.array([[0, 0, 0, 0], [0, -np.inf, 0, 0]]), offsets=OFF),
        ValueError,
        "grads",
    ),
    # out
    (
        "out_shape",
        lambda t: t.lookup(K, out=np.zeros((N, DIM + 1), np.float32)),
        ValueError,
        "out",
    ),
    ("out_dtype", lambda t: t.lookup(K, out=np.zeros((N, DIM), np.float64)), TypeError, "out"),
    (
        "out_readonly",
        lambda t: t.lookup(K, out=_ro(np.zeros((N, DIM), np.float32))),
        ValueError,
        "out",
    ),
    ("out_strided", lambda t: t.lookup(K, out=_strided((N, DIM))), ValueError, "out"),
    (
        "sum_out_shape",
        lambda t: t.lookup_sum(K, OFF, out=np.zeros((N, DIM), np.float32)),
        ValueError,
        "out",
    ),
    (
        "sum_out_dtype",
        lambda t: t.lookup_sum(K, OFF, out=np.zeros((2, DIM), np.float16)),
        TypeError,
        "out",
    ),
    (
        "sum_out_readonly",
        lambda t: t.lookup_sum(K, OFF, out=_ro(np.zeros((2, DIM), np.float32))),
        ValueError,
        "out",
    ),
    ("sum_out_strided", lambda t: t.lookup_sum(K, OFF, out=_strided((2, DIM))), ValueError, "out"),
    # mode
    ("mode_lookup_sum", lambda t: t.lookup_sum(K, OFF, mode="max"), ValueError, "mode"),
    (
        "mode_apply",
        lambda t: t.apply_gradients(K, GB, offsets=OFF, mode="max"),
        ValueError,
        "mode",
    ),
    (
        "mode_without_offsets",
        lambda t: t.apply_gradients(K, G, mode="mean"),
        ValueError,
        "mode",
    ),
]


@pytest.mark.parametrize(("bad_name", "bad_keys", "exc"), BAD_KEYS, ids=[b[0] for b in BAD_KEYS])
@pytest.mark.parametrize("op", [o[1] for o in KEY_OPS], ids=[o[0] for o in KEY_OPS])
def test_bad_keys_rejected_without_change(
    table: embstore.Table,
    op: Callable[[embstore.Table, Any], object],
    bad_name: str,
    bad_keys: Any,
    exc: type[Exception],
) -> None:
    """Bad key dtypes raise TypeError, bad ndim ValueError, naming `keys`; nothing changes."""
    before = snapshot(table, PROBE)
    with pytest.raises(exc, match="keys"):
        op(table, bad_keys)
    assert_unchanged(before, snapshot(table, PROBE))


@pytest.mark.parametrize(
    ("op", "exc", "name"), [b[1:] for b in OTHER_BAD], ids=[b[0] for b in OTHER_BAD]
)
def test_bad_arguments_rejected_without_change(
    table: embstore.Table, op: Op, exc: type[Exception], name: str
) -> None:
    """Bad offsets/weights/grads/out/mode raise the documented error naming the argument,
    before anything changes (no insert, no partial update, counters untouched)."""
    before = snapshot(table, PROBE)
    with pytest.raises(exc, match=name):
        op(table)
    assert_unchanged(before, snapshot(table, PROBE))


def test_nan_grad_with_duplicates_changes_nothing(table: embstore.Table) -> None:
    """A NaN in the last gradient row rejects the whole batch, present and missing ids."""
    keys = u64([0, 1, 25, 0])
    grads = np.ones((4, DIM), np.float32)
    grads[3, 2] = np.nan
    before = snapshot(table, PROBE)
    with pytest.raises(ValueError, match="grads"):
        table.apply_gradients(keys, grads)
    assert_unchanged(before, snapshot(table, PROBE))


# ---- closed tables and context manager ----------------------------------------------

CLOSED_OPS: list[tuple[str, Op]] = [
    ("lookup", lambda t: t.lookup(K)),
    ("lookup_ro", lambda t: t.lookup(K, insert=False)),
    ("lookup_sum", lambda t: t.lookup_sum(K, OFF)),
    ("apply", lambda t: t.apply_gradients(K, G)),
    ("apply_pooled", lambda t: t.apply_gradients(K, GB, offsets=OFF)),
    ("contains", lambda t: t.contains(K)),
    ("erase", lambda t: t.erase(K)),
    ("stats", lambda t: t.stats()),
    ("initial_values", lambda t: t.initial_values(K)),
]


@pytest.mark.parametrize("op", [o[1] for o in CLOSED_OPS], ids=[o[0] for o in CLOSED_OPS])
def test_closed_table_raises(op: Op) -> None:
    """Every operation on a closed table raises ValueError."""
    t = CFG.table()
    t.lookup(K)
    t.close()
    assert t.closed is True
    with pytest.raises(ValueError, match="closed"):
        op(t)


def test_context_manager_closes() -> None:
    """`with Table(...) as t` yields the table and closes it on exit, also on error."""
    with CFG.table() as t:
        assert isinstance(t, embstore.Table)
        assert not t.closed
        t.lookup(K)
    assert t.closed
    with pytest.raises(ValueError, match="closed"):
        t.lookup(K)
    msg = "boom"
    with pytest.raises(KeyError, match=msg), CFG.table() as t2:
        raise KeyError(msg)
    assert t2.closed


# ---- keyword calls, out buffers, empty batches ---------------------------------------


def test_keyword_calls_match_positional() -> None:
    """Every method accepts its documented keyword names and gives positional results."""
    a, b = CFG.table(), CFG.table()
    w = np.array([0.5, 2.0, 1.0, 1.0], np.float32)
    assert_rows_equal(a.lookup(keys=K, insert=True, out=None), b.lookup(K))
    assert_rows_equal(
        a.lookup_sum(keys=K, offsets=OFF, weights=w, mode="mean", insert=False, out=None),
        b.lookup_sum(K, OFF, weights=w, mode="mean", insert=False),
    )
    a.apply_gradients(keys=K, grads=GB, offsets=OFF, weights=w, mode="mean")
    b.apply_gradients(K, GB, offsets=OFF, weights=w, mode="mean")
    a.apply_gradients(keys=K, grads=G)
    b.apply_gradients(K, G)
    assert np.array_equal(a.contains(keys=K), b.contains(K))
    assert_rows_equal(a.initial_values(keys=K), b.initial_values(K))
    assert_rows_equal(a.lookup(K, insert=False), b.lookup(K, insert=False))
    assert a.erase(keys=K[:2]) == b.erase(K[:2]) == 2


def test_out_buffer_is_filled_and_returned(table: embstore.Table) -> None:
    """lookup/lookup_sum with out= fill the given buffer and return that very object."""
    keys = u64([0, 3, 7, 40, 3])
    want = CFG.table()
    want.lookup(u64(range(10)))
    want.apply_gradients(u64(range(5)), np.full((5, DIM), 0.25, np.float32))
    out = np.full((5, DIM), np.nan, np.float32)
    res = table.lookup(keys, out=out)
    assert res is out
    assert_rows_equal(out, want.lookup(keys))
    off = np.array([0, 2, 2, 5], np.int64)
    out2 = np.full((3, DIM), np.nan, np.float32)
    res2 = table.lookup_sum(keys, off, mode="mean", out=out2)
    assert res2 is out2
    assert_rows_equal(out2, want.lookup_sum(keys, off, mode="mean"))


def test_result_is_a_fresh_copy(table: embstore.Table) -> None:
    """Returned rows are writeable float32 C-contiguous copies: writing them changes nothing."""
    keys = u64([1, 2])
    r = table.lookup(keys)
    assert r.dtype == np.float32
    assert r.flags.c_contiguous
    assert r.flags.writeable
    before = r.copy()
    r[:] = 123.0
    assert_rows_equal(table.lookup(keys, insert=False), before)


def test_empty_batches() -> None:
    """n=0 and bags=0 work for every operation and change no counter."""
    t = CFG.table()
    t.lookup(u64([1, 2]))
    st = t.stats()
    st.pop("latency")  # the calls' own timings, not table state
    empty = np.zeros(0, np.uint64)
    r = t.lookup(empty)
    assert r.shape == (0, DIM)
    assert r.dtype == np.float32
    assert t.lookup(empty, insert=False).shape == (0, DIM)
    assert t.lookup_sum(empty, np.zeros(1, np.int64)).shape == (0, DIM)
    zero_bags = t.lookup_sum(empty, np.zeros(3, np.int64), mode="mean")
    assert zero_bags.shape == (2, DIM)
    assert np.array_equal(zero_bags, np.zeros((2, DIM), np.float32))
    t.apply_gradients(empty, np.zeros((0, DIM), np.float32))
    t.apply_gradients(empty, np.zeros((0, DIM), np.float32), offsets=np.zeros(1, np.int64))
    t.apply_gradients(empty, np.ones((2, DIM), np.float32), offsets=np.zeros(3, np.int64))
    c = t.contains(empty)
    assert c.shape == (0,)
    assert c.dtype == np.bool_
    assert t.erase(empty) == 0
    assert t.initial_values(empty).shape == (0, DIM)
    after = t.stats()
    after.pop("latency")
    assert after == st
    assert len(t) == 2


def test_empty_bags_among_full_ones() -> None:
    """Empty bags read zero rows in sum and mean mode; their grads touch nothing."""
    t, ref = CFG.pair()
    keys = u64([5, 6, 7])
    off = np.array([0, 0, 2, 2, 3, 3], np.int64)
    for mode in ("sum", "mean"):
        assert_rows_equal(t.lookup_sum(keys, off, mode=mode), ref.lookup_sum(keys, off, mode=mode))
    grads = np.arange(5 * DIM, dtype=np.float32).reshape(5, DIM)
    t.apply_gradients(keys, grads, offsets=off)
    ref.apply_gradients(keys, grads, offsets=off)
    assert_rows_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False))


# ---- dtype handling -------------------------------------------------------------------


@pytest.mark.parametrize(
    "keys",
    [
        np.array([-1], np.int64),
        np.array([-1], np.int32),
        np.array([-1], np.int16),
        np.array([-1], np.int8),
        [-1],
        [MAX],
        np.array([MAX], np.uint64),
    ],
    ids=["int64", "int32", "int16", "int8", "list_neg", "list_max", "uint64"],
)
def test_negative_keys_are_sign_extended_to_uint64(keys: Any) -> None:
    """-1 in any signed width (and 2**64-1 as uint64) is the single id 2**64-1."""
    t = CFG.table()
    row = t.lookup(keys)
    assert len(t) == 1
    assert t.contains(np.array([MAX], np.uint64)).tolist() == [True]
    assert_rows_equal(row, CFG.reference().initial_values(np.array([MAX], np.uint64)))
    assert_rows_equal(t.initial_values(keys), row)
    assert t.erase(np.array([-1], np.int64)) == 1
    assert len(t) == 0


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.int32, np.int64, np.uint64])
def test_narrow_unsigned_and_signed_keys_widen(dtype: type) -> None:
    """Keys of any integer width name the same ids as their uint64 values."""
    values = [0, 1, 7, 100, 127]
    t = CFG.table()
    t.lookup(np.array(values, dtype=dtype))
    assert t.contains(u64(values)).all()
    assert len(t) == len(values)


def test_wide_unsigned_values_survive() -> None:
    """uint32 values above 2**31 and uint64 above 2**63 are not sign-extended."""
    t = CFG.table()
    t.lookup(np.array([4_000_000_000], np.uint32))
    t.lookup(np.array([2**63 + 5], np.uint64))
    assert t.contains(u64([4_000_000_000, 2**63 + 5])).all()
    assert not t.contains(np.array([4_000_000_000 - 2**32, 5], np.int64)).any()


def test_non_native_byte_order_keys() -> None:
    """Big-endian key arrays are read by value, not by reinterpreting their bytes."""
    t = CFG.table()
    keys = np.array([1, 2, 3], dtype=">u8")
    t.lookup(keys)
    assert t.contains(u64([1, 2, 3])).all()
    assert len(t) == 3


def test_extreme_ids_are_ordinary() -> None:
    """0 and 2**64-1 insert, update, pool, erase like any id."""
    t, ref = CFG.pair()
    keys = u64([0, MAX, 0])
    assert_rows_equal(t.lookup(keys), ref.lookup(keys))
    g = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM) / 8
    t.apply_gradients(keys, g)
    ref.apply_gradients(keys, g)
    off = np.array([0, 1, 3])
    assert_rows_equal(t.lookup_sum(keys, off), ref.lookup_sum(keys, off))
    assert t.erase(u64([MAX])) == 1
    assert t.contains(u64([0, MAX])).tolist() == [True, False]


def test_non_contiguous_and_readonly_inputs() -> None:
    """Strided/Fortran/read-only keys, grads, weights and offsets read the logical values."""
    a, b = CFG.table(), CFG.table()
    base = np.arange(100, 120, dtype=np.uint64)
    keys = base[::2]  # non-contiguous view
    ro = keys.copy()
    ro.flags.writeable = False
    assert_rows_equal(a.lookup(keys), b.lookup(keys.copy()))
    assert_rows_equal(a.lookup(ro, insert=False), b.lookup(keys.copy(), insert=False))
    n = keys.shape[0]
    wide = np.arange(n * DIM * 2, dtype=np.float32).reshape(n, 2 * DIM) / 64
    grads = wide[:, ::2]
    a.apply_gradients(keys, grads)
    b.apply_gradients(keys.copy(), np.ascontiguousarray(grads))
    fortran = np.asfortranarray(np.arange(n * DIM, dtype=np.float32).reshape(n, DIM) / 32)
    a.apply_gradients(ro, fortran)
    b.apply_gradients(keys.copy(), np.ascontiguousarray(fortran))
    off = np.array([0, 0, 3, 3, 7, 10, 10, 10])[::1]
    off_strided = np.repeat(off, 2)[::2]
    w = np.linspace(0.5, 2, 2 * n).astype(np.float32)[::2]
    pa = a.lookup_sum(keys, off_strided, weights=w)
    pb = b.lookup_sum(keys.copy(), off.copy(), weights=w.copy())
    assert_rows_equal(pa, pb)
    assert_rows_equal(a.lookup(keys.copy(), insert=False), b.lookup(keys.copy(), insert=False))


def test_float64_inputs_are_converted() -> None:
    """float64 grads/weights act as their float32 casts; int32 offsets as int64."""
    a, b = CFG.table(), CFG.table()
    keys = u64([3, 4, 3, 9])
    g64 = np.random.default_rng(0).normal(size=(4, DIM))
    a.apply_gradients(keys, g64)
    b.apply_gradients(keys, g64.astype(np.float32))
    w64 = np.array([0.3, 1.7, -0.2, 2.5])
    off32 = np.array([0, 3, 4], np.int32)
    off64 = off32.astype(np.int64)
    gb = np.random.default_rng(1).normal(size=(2, DIM))
    a.apply_gradients(keys, gb, offsets=off32, weights=w64, mode="mean")
    b.apply_gradients(
        keys, gb.astype(np.float32), offsets=off64, weights=w64.astype(np.float32), mode="mean"
    )
    assert_rows_equal(
        a.lookup_sum(keys, off32, weights=w64),
        b.lookup_sum(keys, off64, weights=w64.astype(np.float32)),
    )


def test_initial_values_does_not_touch_table() -> None:
    """initial_values neither inserts nor counts; it equals what a first lookup returns."""
    t = CFG.table()
    keys = u64([10, 11, 12])
    st = t.stats()
    iv = t.initial_values(keys)
    assert len(t) == 0
    assert t.stats() == st
    assert not t.contains(keys).any()
    assert_rows_equal(t.lookup(keys), iv)


def test_adagrad_config_accepted() -> None:
    """An Adagrad table with a non-zero initial accumulator constructs and updates."""
    cfg = Config(
        dim=DIM, capacity=32, optimizer=AdagradSpec(lr=0.1, eps=1e-6, initial_accumulator=0.5)
    )
    t, ref = cfg.pair()
    t.apply_gradients(K, G)
    ref.apply_gradients(K, G)
    assert_rows_equal(t.lookup(K, insert=False), ref.lookup(K, insert=False))
