"""embstore.ray routing: the salted multiply-shift route and the one-pass batch split."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_offsets
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import M64, splitmix64, splitmix64_int

from embstore import _core
from embstore import _sharded as _reshard
from embstore.ray import _pool


def _route_int(x: int, n: int) -> int:
    """The documented route on a Python int: high word of splitmix64(id ^ salt) * n."""
    return (splitmix64_int(x ^ _reshard.SALT) * n) >> 64


def _cells(ids: np.ndarray, routes: np.ndarray, n: int, inner: int) -> np.ndarray:
    """Ids per (route, Table shard): a Table shards by the top bits of splitmix64(id)."""
    inner_shard = (splitmix64(ids) >> np.uint64(64 - inner.bit_length() + 1)).astype(np.int64)
    return np.bincount(routes.astype(np.int64) * inner + inner_shard, minlength=n * inner)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind", ["sequential", "random"])
def test_every_inner_shard_of_every_route_gets_its_share(n: int, kind: str) -> None:
    rng = np.random.default_rng(7)
    ids = (
        np.arange(1_000_000, dtype=np.uint64)
        if kind == "sequential"
        else rng.integers(0, 2**63, 1_000_000, dtype=np.int64).astype(np.uint64)
    )
    routes = _reshard.route_ids(ids, n)
    inner = 16
    cells = _cells(ids, routes, n, inner)
    fair = ids.shape[0] / (n * inner)
    assert np.abs(cells / fair - 1).max() < 0.05


def test_a_route_reusing_the_tables_bits_would_starve_inner_shards() -> None:
    # The control: routing by splitmix64's own high bits leaves each route 1/n of the
    # Table's shards, which the balance check above must catch.
    ids = np.arange(1_000_000, dtype=np.uint64)
    bad = (splitmix64(ids) >> np.uint64(63)).astype(np.uint32)
    cells = _cells(ids, bad, 2, 16)
    assert np.abs(cells / (ids.shape[0] / 32) - 1).max() > 0.5


def test_route_ids_match_the_documented_formula() -> None:
    rng = np.random.default_rng(1)
    ids = np.concatenate(
        [
            np.array([0, 1, 2**63, M64 - 1], dtype=np.uint64),
            rng.integers(0, 2**64, 500, dtype=np.uint64),
        ]
    )
    for n in (1, 2, 3, 7, 1000):
        got = _reshard.route_ids(ids, n)
        assert got.dtype == np.uint32
        assert [int(r) for r in got] == [_route_int(int(x), n) for x in ids]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_keys=st.integers(0, 60),
    bags=st.integers(0, 12),
    shards=st.integers(1, 4),
    weighted=st.booleans(),
    mean=st.booleans(),
)
def test_split_reassembles_the_batch(
    seed: int, n_keys: int, bags: int, shards: int, weighted: bool, mean: bool
) -> None:
    rng = np.random.default_rng(seed)
    if bags == 0:
        n_keys = 0
    keys = rng.integers(0, 20, n_keys).astype(np.uint64)  # many duplicates
    off = random_offsets(rng, n_keys, bags)
    w = rng.standard_normal(n_keys).astype(np.float32) if weighted else None
    (plan,) = _pool.route(["t"], [(keys, off, w, None)], shards, mean=mean)
    routes = _reshard.route_ids(keys, shards)
    bag_of = np.repeat(np.arange(bags), np.diff(off))
    # Every shard holds every bag (empty ones too) when each touches >= 7/8 of them.
    dense = bags > 0 and all(
        np.unique(bag_of[routes == s]).shape[0] * 8 >= bags * 7 for s in range(shards)
    )
    seen = []
    for s in range(shards):
        k, o, ws, c = plan.part(s)
        b = plan.bags[plan.bag_start[s] : plan.bag_start[s + 1]]
        pos = plan.order[plan.key_start[s] : plan.key_start[s + 1]]
        want = np.nonzero(routes == s)[0]
        np.testing.assert_array_equal(pos, want)  # this shard's ids, in request order
        np.testing.assert_array_equal(k, keys[want])
        np.testing.assert_array_equal(b, np.arange(bags) if dense else np.unique(bag_of[want]))
        assert o[0] == 0
        assert o[-1] == k.shape[0]
        assert b.shape[0] + 1 == o.shape[0]
        np.testing.assert_array_equal(np.repeat(b, np.diff(o)), bag_of[want])
        if weighted:
            np.testing.assert_array_equal(ws, w[want])
        else:
            assert ws is None
        if mean:
            size = np.diff(off).astype(np.float32)[bag_of[want]]
            base = w[want] if weighted else np.ones(want.shape[0], np.float32)
            np.testing.assert_array_equal(c, base / size)
        else:
            assert c is None
        seen.append(pos)
    assert sorted(np.concatenate(seen).tolist()) == list(range(n_keys))
    # Without positions (order=False, as a lookup that is not exact routes): the same split.
    (lean,) = _pool.route(["t"], [(keys, off, w, None)], shards, mean=mean, order=False)
    assert lean.order is None
    for name in ("keys", "key_start", "bags", "bag_start", "offsets", "weights", "coef"):
        np.testing.assert_array_equal(getattr(lean, name), getattr(plan, name))


def test_route_validates_like_a_group_call() -> None:
    keys = np.array([1, 2, 3], dtype=np.uint64)
    with pytest.raises(ValueError, match="table 'u': offsets\\[-1\\] must equal len"):
        _pool.route(["u"], [(keys, np.array([0, 2], np.int64), None, None)], 2, mean=False)
    g = np.array([[np.nan]], dtype=np.float32)
    with pytest.raises(ValueError, match="table 'v': grads must be finite"):
        _pool.check(["v"], [(keys, np.array([0, 3], np.int64), None, g)], mean=False)
    with pytest.raises(TypeError, match="keys"):
        _core.route_batches(
            [(keys.astype(np.int32), np.array([0, 3]), None, None)], ["t"], 2, 1, False
        )


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_keys=st.integers(0, 60), bags=st.integers(1, 12))
def test_shard_grads_are_each_shards_bag_gradients(seed: int, n_keys: int, bags: int) -> None:
    """Each shard gets the gradient rows of the bags it holds, in its bags' order: the whole
    array when it holds every bag, else a gather (in C++, into pooled memory)."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 1000, n_keys).astype(np.uint64)
    off = random_offsets(rng, n_keys, bags)
    (plan,) = _pool.route(["t"], [(keys, off, None, None)], 2, mean=False)
    g = rng.standard_normal((bags, 3)).astype(np.float32)
    for s in range(2):
        got = _pool.shard_grads({"t": g}, {"t": plan}, s)["t"]
        b = plan.bags[plan.bag_start[s] : plan.bag_start[s + 1]]
        np.testing.assert_array_equal(got, g[b])
        assert got.flags.c_contiguous
        assert got.dtype == np.float32


def test_gather_rows_checks_its_input() -> None:
    rows = np.zeros((4, 2), np.float32)
    assert _core.gather_rows(rows, np.zeros(0, np.int64)).shape == (0, 2)
    with pytest.raises(ValueError, match="bags: index out of range"):
        _core.gather_rows(rows, np.array([4], np.int64))
    with pytest.raises(ValueError, match="bags: index out of range"):
        _core.gather_rows(rows, np.array([-1], np.int64))
    with pytest.raises(TypeError, match="rows"):
        _core.gather_rows(rows.astype(np.float64), np.array([0], np.int64))


def test_reduce_scatters_a_part_into_its_bags_and_checks_them() -> None:
    out = np.ones((3, 2), np.float32)  # a writeable first part over every bag: added into
    add = (np.array([2, 0], np.int64), np.array([[1, 2], [3, 4]], np.float32))
    (got,) = _core.reduce_partials([(3, 2, [(None, out), add])])
    assert got is out
    np.testing.assert_array_equal(out, [[4, 5], [1, 1], [2, 3]])
    for bad in ([3], [-1]):
        with pytest.raises(ValueError, match="bags: index out of range"):
            _core.reduce_partials(
                [(3, 2, [(None, out), (np.array(bad, np.int64), np.zeros((1, 2), np.float32))])]
            )
    np.testing.assert_array_equal(out, [[4, 5], [1, 1], [2, 3]])  # a bad call adds nothing


def test_reduce_scatters_by_the_bags_it_checked() -> None:
    """The bags are checked, then read with the GIL released, where anything could rewrite
    them: the kernel must use what it checked. Here the rewrite is the kernel's own: ``bags``
    is the memory of ``out``, the accumulator (int64 over two float32 columns; small ints
    are denormals, which add like the ints), so each add changes a later bag (to one still
    in range)."""
    out = np.array([1, 2, 3, 0], np.int64).view(np.float32).reshape(4, 2)
    bags = out.view(np.int64).reshape(4)
    rows = np.array([1, 0, 1, 0, 0, 0, 0, 0], np.int32).view(np.float32).reshape(4, 2)
    want = out.copy()
    for j, bag in enumerate(bags.copy()):
        want[bag] += rows[j]
    (got,) = _core.reduce_partials([(4, 2, [(None, out), (bags, rows)])])
    assert got is out
    np.testing.assert_array_equal(out.view(np.int64), want.view(np.int64))  # [1, 3, 4, 0]


def _reference_reduce(num_bags: int, dim: int, parts: list) -> np.ndarray:
    """The shards' partial sums added in shard order with float32 adds (parts of no bag
    skipped): from the first part when it covers every bag, else from zeros."""
    parts = [(b, s) for b, s in parts if b is None or b.shape[0]]
    if parts and parts[0][0] is None:
        out, rest = parts[0][1].copy(), parts[1:]
    else:
        out, rest = np.zeros((num_bags, dim), np.float32), parts
    for bags, sums in rest:
        if bags is None:
            out = out + sums
        else:
            for j, b in enumerate(bags):
                out[b] = out[b] + sums[j]
    return out


@st.composite
def _reduce_tables(draw: st.DrawFn) -> list:
    tables = []
    for _ in range(draw(st.integers(1, 4))):
        num_bags, dim = draw(st.integers(0, 40)), draw(st.integers(1, 9))
        parts = []
        for _ in range(draw(st.integers(0, 3))):
            if draw(st.booleans()):
                bags = None
                rows = num_bags
            else:
                mask = draw(st.lists(st.booleans(), min_size=num_bags, max_size=num_bags))
                bags = np.flatnonzero(mask).astype(np.int64)
                rows = bags.shape[0]
            values = draw(
                st.lists(st.floats(-1e3, 1e3, width=32), min_size=rows * dim, max_size=rows * dim)
            )
            sums = np.array(values, np.float32).reshape(rows, dim)
            sums.flags.writeable = draw(st.booleans())
            parts.append((bags, sums))
        tables.append((num_bags, dim, parts))
    return tables


@settings(max_examples=150, deadline=None)
@given(_reduce_tables())
def test_reduce_partials_adds_every_tables_parts_in_shard_order(tables: list) -> None:
    want = [_reference_reduce(*t) for t in tables]
    before = [[sums.copy() for _, sums in t[2]] for t in tables]
    got = _pool.reduce_partials(tables)
    assert len(got) == len(tables)
    for (num_bags, dim, parts), out, ref, copies in zip(tables, got, want, before, strict=True):
        assert out.shape == (num_bags, dim)
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out.view(np.int32), ref.view(np.int32))  # bits: -0.0 too
        # A writeable first part over every bag (parts of no bag skipped) is the
        # accumulator; no other part changes.
        used = [(b, p) for b, p in parts if b is None or b.shape[0]]
        first = used[0][1] if used and used[0][0] is None and used[0][1].flags.writeable else None
        if first is not None:
            assert out is first
        else:
            assert all(out is not p for _, p in parts)
        for (_, sums), copy in zip(parts, copies, strict=True):
            if sums is not first:
                np.testing.assert_array_equal(sums, copy)


def test_reduce_partials_checks_its_input_before_adding_anything() -> None:
    out = np.ones((3, 2), np.float32)
    ok = (3, 2, [(None, out), (None, np.ones((3, 2), np.float32))])  # reduced: all twos
    cases = [
        ((3, 2, [(np.array([3], np.int64), np.zeros((1, 2), np.float32))]), ValueError, "bags"),
        ((3, 2, [(np.array([-1], np.int64), np.zeros((1, 2), np.float32))]), ValueError, "bags"),
        ((3, 2, [(None, np.zeros((2, 2), np.float32))]), ValueError, "sums"),
        ((3, 2, [(None, np.zeros((3, 2), np.float64))]), TypeError, "sums"),
        ((3, 2, [(None, np.zeros((3, 4), np.float32)[:, :2])]), ValueError, "sums"),
        ((3, 0, []), ValueError, "dim"),
    ]
    for bad, error, match in cases:  # the binding's own checks (_pool converts dtypes)
        with pytest.raises(error, match=match):
            _core.reduce_partials([ok, bad])
        np.testing.assert_array_equal(out, np.ones((3, 2)))  # the good table was not reduced


def test_reduce_partials_never_adds_into_memory_another_part_shares() -> None:
    """An accumulator must share no byte with any other part, of its table or another:
    adding into it would change a part still to be read, or race another table's task."""
    base = np.arange(12, dtype=np.float32).reshape(6, 2)
    x = np.ones((3, 2), np.float32)
    y = np.full((3, 2), 2.0, np.float32)
    cases = [
        [(3, 2, [(None, x)]), (3, 2, [(None, x), (None, y)])],  # x first in two tables
        [(3, 2, [(None, base[:3]), (None, base[1:4])])],  # overlapping views of one array
        [(3, 2, [(None, base[3:]), (np.array([0, 2], np.int64), base[3:5])])],
    ]
    for tables in cases:
        want = [_reference_reduce(*t) for t in tables]
        before = [[p.copy() for _, p in t[2]] for t in tables]
        got = _pool.reduce_partials(tables)
        for out, ref, t, copies in zip(got, want, tables, before, strict=True):
            np.testing.assert_array_equal(out, ref)
            assert all(out is not p for _, p in t[2])
            for (_, p), c in zip(t[2], copies, strict=True):
                np.testing.assert_array_equal(p, c)


def test_reduce_partials_converts_parts_to_contiguous_float32() -> None:
    part = np.arange(8, dtype=np.float64).reshape(4, 2)[::2]  # float64, strided
    (out,) = _pool.reduce_partials([(2, 2, [(None, part)])])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, part.astype(np.float32))


def test_same_bytes_compares_whole_buffers() -> None:
    a = np.arange(10, dtype=np.uint64)
    assert _core.same_bytes(a, a.copy())
    assert _core.same_bytes(a[:0], np.empty(0, np.float32))
    assert not _core.same_bytes(a, a[:9])
    b = a.copy()
    b[9] += np.uint64(1)
    assert not _core.same_bytes(a, b)
    w = np.array([0.0], np.float32)
    assert not _core.same_bytes(w, -w)  # bits, not values
    with pytest.raises(ValueError, match="not C-contiguous"):
        _core.same_bytes(a[::2], a[:5])


@pytest.mark.parametrize("weighted", [False, True])
def test_route_keeps_copies_of_the_batch_when_asked(weighted: bool) -> None:
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 2**63, 5000).astype(np.uint64)  # over 32k ids with 8 tables below
    off = random_offsets(rng, 5000, 700)
    w = rng.standard_normal(5000).astype(np.float32) if weighted else None
    batches = [(keys, off, w, None)] * 8
    plans = _pool.route([f"t{i}" for i in range(8)], batches, 2, mean=False, keep=True)
    for plan in plans:
        k, o, kw = plan.keep
        np.testing.assert_array_equal(k, keys)
        np.testing.assert_array_equal(o, off)
        if weighted:
            np.testing.assert_array_equal(kw, w)
        else:
            assert kw is None
        assert not np.shares_memory(k, keys)
    (plain,) = _pool.route(["t"], [(keys, off, w, None)], 2, mean=False)
    assert plain.keep is None
