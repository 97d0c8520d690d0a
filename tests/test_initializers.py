"""Initializers: exact formulas of docs/semantics.md and their determinism."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import Config, assert_rows_equal, kernels_at, u64
from reference import (
    InitSpec,
    NormalSpec,
    SGDSpec,
    TruncatedNormalSpec,
    UniformSpec,
    ZerosSpec,
    initial_rows,
    row_seeds,
    splitmix64,
    splitmix64_int,
    unit,
)

from embstore import _core

MAX = 2**64 - 1
SPECIAL = [0, 1, 2, 3, 42, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 2, MAX]


def _ids(rng: np.random.Generator, n: int) -> np.ndarray:
    rand = rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)
    return np.concatenate([u64(SPECIAL), rand])


def test_reference_splitmix_matches_formula(rng: np.random.Generator) -> None:
    """The reference's vectorised splitmix64/u() agree with the spec's Python-int formulas."""
    xs = _ids(rng, 200)
    got = splitmix64(xs)
    assert [int(v) for v in got] == [splitmix64_int(int(x)) for x in xs]
    seed = 12345
    rs = row_seeds(seed, xs)
    s = splitmix64_int(seed)
    assert [int(v) for v in rs] == [splitmix64_int(int(x) ^ s) for x in xs]
    u = unit(rs[:3], np.arange(5, dtype=np.uint64))
    for i in range(3):
        for j in range(5):
            want = (splitmix64_int((int(rs[i]) + j) % 2**64) >> 11) * 2.0**-53
            assert u[i, j] == want
    # Known vector: splitmix64 of the seed 0 state (first output of the classic generator).
    assert splitmix64_int(0) == 0xE220A8397B1DCDAF


EXACT: list[InitSpec] = [
    ZerosSpec(),
    UniformSpec(low=-0.5, high=0.5, seed=0),
    UniformSpec(low=-0.1, high=0.3, seed=2**63 + 5),
    UniformSpec(low=2.0, high=2.5, seed=MAX),
]


@pytest.mark.parametrize("dim", [1, 3, 8, 130])
@pytest.mark.parametrize("init", EXACT, ids=["zeros", "uniform", "uniform_odd", "uniform_max"])
def test_exact_initializers_match_reference(
    init: InitSpec, dim: int, rng: np.random.Generator
) -> None:
    """Zeros/Uniform rows equal the spec formula bit for bit, via initial_values and lookup."""
    cfg = Config(dim=dim, capacity=10_000, initializer=init)
    t = cfg.table()
    keys = _ids(rng, 300)
    want = initial_rows(init, keys, dim)
    assert_rows_equal(t.initial_values(keys), want, keys)
    assert_rows_equal(t.lookup(keys), want, keys)
    if isinstance(init, UniformSpec):
        assert want.min() >= np.float32(init.low)
        assert want.max() <= np.float32(init.high)


GAUSS: list[InitSpec] = [
    NormalSpec(std=0.01, seed=0),
    NormalSpec(std=2.0, seed=99, mean=1.5),
    TruncatedNormalSpec(std=0.05, seed=3),
    TruncatedNormalSpec(std=1.0, seed=MAX, mean=-0.25),
]


@pytest.mark.parametrize("dim", [1, 3, 8, 33, 131])
@pytest.mark.parametrize("init", GAUSS, ids=["normal", "normal_mean", "trunc", "trunc_mean"])
def test_gaussian_initializers_match_reference(
    init: InitSpec, dim: int, rng: np.random.Generator
) -> None:
    """Normal/TruncatedNormal rows follow the Box-Muller formula (libm tolerance)."""
    t = Config(dim=dim, capacity=10_000, initializer=init).table()
    keys = _ids(rng, 500)
    want = initial_rows(init, keys, dim)
    got = t.initial_values(keys)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert_rows_equal(t.lookup(keys), got, keys)


@pytest.mark.parametrize("level", ["baseline", "avx2"])
@pytest.mark.parametrize("init", GAUSS[::2], ids=["normal", "trunc"])
def test_gaussian_kernels_within_one_float32_ulp_of_libm(
    init: InitSpec, level: str, rng: np.random.Generator
) -> None:
    """The core's own log/sin/cos (fdlibm polynomials, every quadrant, u1 up to 1) against
    numpy's libm over 264k elements: at most one float32 ulp apart, and nearly always equal."""
    if level == "avx2" and _core.simd_level() != "avx2":
        pytest.skip("this CPU (or EMBSTORE_SIMD) runs the baseline only")
    keys = _ids(rng, 8000)
    table = Config(dim=33, capacity=10, initializer=init).table()
    with kernels_at(level):
        got = table.initial_values(keys)
    want = initial_rows(init, keys, 33)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1
    assert np.count_nonzero(ulps) <= 3  # 0 of 12.8M differed when measured


def test_seed_is_taken_modulo_2_64() -> None:
    """Seed -1 and seed 2**64-1 give the same rows (row_seed uses seed % 2**64)."""
    a = Config(dim=8, initializer=UniformSpec(-1.0, 1.0, seed=-1)).table()
    b = Config(dim=8, initializer=UniformSpec(-1.0, 1.0, seed=MAX)).table()
    keys = u64([0, 5, MAX])
    assert_rows_equal(a.initial_values(keys), b.initial_values(keys))


def test_seeds_change_rows() -> None:
    """Different seeds give different rows; equal seeds equal rows (two tables)."""
    keys = u64(range(50))
    a = Config(dim=8, initializer=UniformSpec(-1.0, 1.0, seed=1)).table()
    b = Config(dim=8, initializer=UniformSpec(-1.0, 1.0, seed=2)).table()
    c = Config(dim=8, initializer=UniformSpec(-1.0, 1.0, seed=1)).table()
    ra, rb, rc = (x.initial_values(keys) for x in (a, b, c))
    assert not np.any(np.all(ra == rb, axis=1))
    assert_rows_equal(ra, rc)


@pytest.mark.parametrize(
    "init",
    [UniformSpec(-0.5, 0.5, seed=11), NormalSpec(std=0.1, seed=12), TruncatedNormalSpec(0.1, 13)],
    ids=["uniform", "normal", "trunc"],
)
def test_rows_independent_of_layout_and_order(init: InitSpec, rng: np.random.Generator) -> None:
    """An id's initial row does not depend on shards, threads, capacity or insertion order."""
    dim = 12
    keys = np.unique(_ids(rng, 2000))
    base = Config(dim=dim, capacity=100_000, initializer=init, num_shards=1, num_threads=1)
    want = base.table().lookup(keys)
    layouts = [
        {"num_shards": 4, "num_threads": 2},
        {"num_shards": 64, "num_threads": 4},
        {"num_shards": 1, "num_threads": 3, "capacity": 37},  # heavy eviction
        {"num_shards": 64, "num_threads": 1, "capacity": 4096},
    ]
    for layout in layouts:
        t = base.table(**layout)
        perm = rng.permutation(keys.shape[0])
        got = np.empty_like(want)
        for chunk in np.array_split(perm, 7):
            got[chunk] = t.lookup(keys[chunk])
        assert_rows_equal(got, want, keys)
        assert_rows_equal(t.initial_values(keys), want, keys)


def test_truncated_normal_bounded() -> None:
    """TruncatedNormal values lie within mean +- 2 std, and reach beyond 1.9 std."""
    std, mean = 0.02, 0.1
    t = Config(dim=16, initializer=TruncatedNormalSpec(std=std, seed=4, mean=mean)).table()
    v = t.initial_values(np.arange(20_000, dtype=np.uint64)).astype(np.float64)
    dev = np.abs(v - mean)
    assert dev.max() <= 2 * std * (1 + 1e-6)
    assert dev.max() > 1.9 * std
    # Variance of a standard normal truncated at +-2 is about 0.7737.
    assert abs(v.std() / std - np.sqrt(0.7737)) < 0.01
    assert abs(v.mean() - mean) < 0.01 * std


def test_normal_moments() -> None:
    """Normal rows have the configured mean/std, even and odd columns alike, no correlation."""
    std, mean = 0.5, -1.0
    t = Config(dim=32, initializer=NormalSpec(std=std, seed=21, mean=mean)).table()
    v = t.initial_values(np.arange(10_000, dtype=np.uint64)).astype(np.float64)
    z = (v - mean) / std
    assert abs(z.mean()) < 0.01
    assert abs(z.std() - 1) < 0.01
    for cols in (z[:, 0::2], z[:, 1::2]):
        assert abs(cols.mean()) < 0.02
        assert abs(cols.std() - 1) < 0.02
    corr = np.corrcoef(z[:, 0], z[:, 1])[0, 1]
    assert abs(corr) < 0.05
    assert abs(np.mean(np.abs(z) > 3) - 0.0027) < 0.001


def test_uniform_moments() -> None:
    """Uniform rows cover [low, high) evenly."""
    t = Config(dim=16, initializer=UniformSpec(low=-2.0, high=6.0, seed=5)).table()
    v = t.initial_values(np.arange(10_000, dtype=np.uint64)).astype(np.float64)
    assert v.min() >= -2.0
    assert v.max() < 6.0
    assert abs(v.mean() - 2.0) < 0.02
    hist, _ = np.histogram(v, bins=8, range=(-2.0, 6.0))
    assert hist.min() > 0.95 * v.size / 8


def test_inserted_rows_restart_from_initial_after_eviction_and_erase() -> None:
    """A re-inserted id (after erase or eviction) starts again from its initial row."""
    cfg = Config(dim=4, capacity=2, num_shards=1, optimizer=SGDSpec(lr=1.0))
    t = cfg.table()
    k = u64([7])
    t.apply_gradients(k, np.ones((1, 4), np.float32))
    assert not np.array_equal(t.lookup(k, insert=False), t.initial_values(k))
    t.erase(k)
    assert_rows_equal(t.lookup(k), t.initial_values(k))
    t.apply_gradients(k, np.ones((1, 4), np.float32))
    t.lookup(u64([1, 2, 3, 4]))  # more distinct ids than capacity: 7 is evicted
    assert not t.contains(k)[0]
    assert_rows_equal(t.lookup(k), t.initial_values(k))
