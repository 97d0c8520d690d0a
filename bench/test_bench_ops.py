"""pytest-benchmark microbenchmarks of embstore's batch operations.

Groups: ``lookup``, ``lookup_sum``, ``apply`` (every optimizer) and ``insert_evict``,
parametrized over ``dim`` in {16, 64, 256}, batch size, pooling factor and thread count.
Keys are Zipf(1.05)-distributed hashed ids as in WORKLOADS.md (``splitmix64(rank)``), drawn
before the timed region; tables are warm (all ``UNIVERSE`` ids inserted in placement order)
except in ``insert_evict``, where every timed call inserts fresh ids into a full table.

Every case checks its result against a plain numpy computation once, before timing.

Run ``pytest bench`` for timings (``--benchmark-group-by=group`` is the default grouping) or
``pytest bench --benchmark-disable`` for the smoke test CI runs (each body once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import embstore
from embstore.bench import make_tables, reference_pool, splitmix64, zipf_cdf

#: Ids per warm table. Large enough that the tables do not fit in L2, small enough that
#: building one (up to 2 x 20 MiB at dim 256) takes well under a second.
UNIVERSE = 20_000
#: Rows of the table used by ``insert_evict`` (every timed call evicts).
EVICT_CAPACITY = 4096
LR = 0.01
DIMS = [16, 64, 256]
THREADS = [1, 2]

U64Array = npt.NDArray[np.uint64]
F32Array = npt.NDArray[np.float32]

_TABLE = make_tables(1, UNIVERSE)[0]
_CDF = zipf_cdf(UNIVERSE)


def zipf_keys(n: int, seed: int) -> U64Array:
    """``n`` hashed ids of Zipf(1.05) ranks over ``UNIVERSE``, deterministic in ``seed``."""
    rng = np.random.default_rng([seed, n])
    return _TABLE.ids[np.searchsorted(_CDF, rng.random(n))]


def bags(n_bags: int, pooling: int) -> npt.NDArray[np.int64]:
    """CSR offsets of ``n_bags`` bags of exactly ``pooling`` ids."""
    return np.arange(0, n_bags * pooling + 1, pooling, dtype=np.int64)


#: optimizer name -> floats of row state per weight (for the bytes-touched estimate)
OPTIMIZERS = {"sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rowwise_adagrad": 0, "adam": 2, "ftrl": 2}


def make_optimizer(name: str) -> Any:
    """W1's Adagrad, or another fused optimizer, with learning rate ``LR``."""
    if name == "sgd_momentum":
        return embstore.SGD(lr=LR, momentum=0.9)
    if name == "rowwise_adagrad":
        return embstore.RowWiseAdagrad(lr=LR)
    if name == "adam":
        return embstore.Adam(lr=LR)
    if name == "ftrl":
        return embstore.FTRL(alpha=LR)
    if name == "sgd":
        return embstore.SGD(lr=LR)
    return embstore.Adagrad(lr=LR, eps=1e-8, initial_accumulator=0.0)


def new_table(dim: int, capacity: int, optimizer: str = "adagrad", threads: int = 1) -> Any:
    """An empty table with a Normal(0.01) initializer."""
    return embstore.Table(
        dim=dim,
        capacity=capacity,
        optimizer=make_optimizer(optimizer),
        initializer=embstore.Normal(std=0.01, seed=0),
        num_threads=threads,
    )


def warm(table: Any, ids: U64Array, dim: int, chunk: int = 1 << 14) -> None:
    """Insert ``ids`` in order through ``lookup`` (bounded temporary buffer)."""
    buf = np.empty((chunk, dim), dtype=np.float32)
    for lo in range(0, ids.shape[0], chunk):
        part = ids[lo : lo + chunk]
        table.lookup(part, out=buf[: part.shape[0]])


@pytest.fixture(scope="module")
def warm_tables() -> Iterator[Callable[..., Any]]:
    """Factory of warm tables, cached per ``(purpose, dim, optimizer, threads)``.

    ``purpose`` separates the tables that are only read (whose rows must stay equal to
    their initial values for the checks) from those that benchmarks update.
    """
    cache: dict[tuple[str, int, str, int], Any] = {}

    def get(purpose: str, dim: int, optimizer: str = "adagrad", threads: int = 1) -> Any:
        key = (purpose, dim, optimizer, threads)
        if key not in cache:
            t = new_table(dim, UNIVERSE, optimizer, threads)
            warm(t, _TABLE.warm_ids, dim)
            assert len(t) == UNIVERSE
            cache[key] = t
        return cache[key]

    yield get
    cache.clear()


def reference_step(
    optimizer: str, keys: U64Array, before: F32Array, per_id_grads: F32Array
) -> tuple[U64Array, F32Array]:
    """Distinct keys and their rows after one optimizer step from fresh state (zero
    accumulators and moments; the first step's closed forms)."""
    uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    g = np.zeros((uniq.shape[0], before.shape[1]), dtype=np.float32)
    np.add.at(g, inv.reshape(-1), per_id_grads)
    w = before[first]
    lr, eps = np.float32(LR), np.float32(1e-8)
    if optimizer in ("sgd", "sgd_momentum"):  # the momentum buffer starts at g
        return uniq, w - lr * g
    if optimizer == "rowwise_adagrad":
        acc = np.mean(g * g, axis=1, keepdims=True)
        return uniq, w - (lr * g) / (np.sqrt(acc) + eps)
    if optimizer == "adam":  # bias-corrected first step: m_hat = g, v_hat = g*g
        return uniq, w - (lr * g) / (np.abs(g) + eps)
    if optimizer == "ftrl":  # z = g - sigma*w with sigma = |g|/alpha; n = g*g; beta 1, no l1/l2
        z = g - (np.abs(g) / lr) * w
        return uniq, -z / ((np.float32(1.0) + np.abs(g)) / lr)
    acc = g * g
    return uniq, w - (np.float32(LR) * g) / (np.sqrt(acc) + np.float32(1e-8))


def _gbps(benchmark: Any, nbytes: int) -> None:
    benchmark.extra_info["bytes_per_call"] = nbytes


# --------------------------------------------------------------------------------------
# lookup
# --------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="lookup")
@pytest.mark.parametrize("insert", [True, False], ids=["train", "readonly"])
@pytest.mark.parametrize("n", [256, 4096])
@pytest.mark.parametrize("dim", DIMS)
def test_lookup(
    benchmark: Any, warm_tables: Callable[..., Any], dim: int, n: int, insert: bool
) -> None:
    """``lookup`` of ``n`` Zipf ids, all present, into a preallocated ``out``."""
    t = warm_tables("read", dim)
    keys = zipf_keys(n, seed=1)
    out = np.empty((n, dim), dtype=np.float32)
    got = t.lookup(keys, insert=insert, out=out)
    np.testing.assert_array_equal(got, t.initial_values(keys))
    benchmark.extra_info["ids_per_call"] = n
    _gbps(benchmark, n * dim * 4)
    benchmark(t.lookup, keys, insert=insert, out=out)


# --------------------------------------------------------------------------------------
# lookup_sum
# --------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="lookup_sum")
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("pooling", [1, 8])
@pytest.mark.parametrize("n_bags", [256, 2048])
@pytest.mark.parametrize("dim", DIMS)
def test_lookup_sum(
    benchmark: Any,
    warm_tables: Callable[..., Any],
    dim: int,
    n_bags: int,
    pooling: int,
    threads: int,
) -> None:
    """Pooled ``lookup_sum`` of ``n_bags`` bags of ``pooling`` Zipf ids."""
    t = warm_tables("read", dim, threads=threads)
    keys = zipf_keys(n_bags * pooling, seed=2)
    offsets = bags(n_bags, pooling)
    out = np.empty((n_bags, dim), dtype=np.float32)
    got = t.lookup_sum(keys, offsets, out=out)
    ref = reference_pool(t.lookup(keys, insert=False), pooling)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    benchmark.extra_info["ids_per_call"] = keys.shape[0]
    _gbps(benchmark, keys.shape[0] * dim * 4)
    benchmark(t.lookup_sum, keys, offsets, out=out)


# --------------------------------------------------------------------------------------
# apply_gradients
# --------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="apply")
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("form", ["per-id", "bags-L8"])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_apply(
    benchmark: Any,
    warm_tables: Callable[..., Any],
    optimizer: str,
    dim: int,
    form: str,
    threads: int,
) -> None:
    """``apply_gradients`` of 4096 Zipf ids: per-id gradients, or 512 bags of 8 ids."""
    n = 4096
    keys = zipf_keys(n, seed=3)
    rng = np.random.default_rng(4)
    if form == "per-id":
        grads = rng.standard_normal((n, dim), dtype=np.float32)
        offsets = None
        per_id = grads
    else:
        grads = rng.standard_normal((n // 8, dim), dtype=np.float32)
        offsets = bags(n // 8, 8)
        per_id = np.repeat(grads, 8, axis=0)

    # Check once on a fresh table (accumulators at their initial 0) against numpy.
    fresh = new_table(dim, n, optimizer, threads)
    fresh.lookup(keys)
    before = fresh.lookup(keys, insert=False)
    fresh.apply_gradients(keys, grads, offsets=offsets)
    uniq, expected = reference_step(optimizer, keys, before, per_id)
    np.testing.assert_allclose(fresh.lookup(uniq, insert=False), expected, rtol=1e-5, atol=1e-7)
    del fresh

    t = warm_tables("update", dim, optimizer, threads)
    benchmark.extra_info["ids_per_call"] = n
    _gbps(benchmark, np.unique(keys).shape[0] * dim * 4 * 2 * (1 + OPTIMIZERS[optimizer]))
    benchmark(t.apply_gradients, keys, grads, offsets=offsets)


# --------------------------------------------------------------------------------------
# insert with eviction
# --------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="insert_evict")
@pytest.mark.parametrize("n", [256, 2048])
@pytest.mark.parametrize("dim", DIMS)
def test_insert_evict(benchmark: Any, dim: int, n: int) -> None:
    """``lookup`` of ``n`` never-seen ids into a full CLOCK table: ``n`` inserts + evictions."""
    t = new_table(dim, EVICT_CAPACITY, "adagrad")
    counter = iter(range(1 << 40, 1 << 41, n))

    def fresh_keys() -> U64Array:
        start = next(counter)
        return splitmix64(np.arange(start, start + n, dtype=np.uint64))

    warm(t, splitmix64(np.arange(EVICT_CAPACITY, dtype=np.uint64) + np.uint64(1 << 50)), dim)
    out = np.empty((n, dim), dtype=np.float32)

    # Check once: misses return their initializer rows, the table stays within capacity,
    # and every insert that found no free row evicted one.
    before = t.stats()
    keys = fresh_keys()
    got = t.lookup(keys, out=out)
    np.testing.assert_array_equal(got, t.initial_values(keys))
    after = t.stats()
    assert len(t) <= EVICT_CAPACITY
    assert after["inserts"] - before["inserts"] == n
    assert after["evictions"] - before["evictions"] >= n - (EVICT_CAPACITY - before["size"])

    def setup() -> tuple[tuple[U64Array], dict[str, Any]]:
        return (fresh_keys(),), {"out": out}

    benchmark.extra_info["ids_per_call"] = n
    _gbps(benchmark, n * dim * 4 * 2)
    benchmark.pedantic(t.lookup, setup=setup, rounds=30, warmup_rounds=2)


# --------------------------------------------------------------------------------------
# training completeness: admission filter, step eviction, on_evict
# --------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="admission")
@pytest.mark.parametrize("admission", [False, True], ids=["no_filter", "count_filter"])
def test_lookup_sum_admission(benchmark: Any, admission: bool) -> None:
    """Pooled lookup (L=8, B=2048, dim 64) of warm tables with and without a CountFilter: the
    filter costs nothing on hits (only misses consult the sketch)."""
    dim, pooling, n_bags = 64, 8, 2048
    kwargs = {"admission": embstore.CountFilter(min_count=2, width=1 << 16)} if admission else {}
    t = embstore.Table(dim=dim, capacity=UNIVERSE, initializer=embstore.Normal(0.01), **kwargs)
    for _ in range(2):  # two sightings admit every id
        warm(t, _TABLE.warm_ids, dim)
    assert len(t) == UNIVERSE
    keys, off = zipf_keys(n_bags * pooling, 11), bags(n_bags, pooling)
    np.testing.assert_allclose(
        t.lookup_sum(keys, off), reference_pool(t.lookup(keys, insert=False), pooling), rtol=1e-6
    )
    benchmark(t.lookup_sum, keys, off)


@pytest.mark.benchmark(group="evict")
def test_evict_older_than(benchmark: Any) -> None:
    """evict(older_than=) of half of a 20k-row table (dim 64, with state): scan + export."""
    dim = 64
    half = UNIVERSE // 2

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        t = new_table(dim, UNIVERSE)
        warm(t, _TABLE.warm_ids[:half], dim)
        t.set_step(1)
        warm(t, _TABLE.warm_ids[half:], dim)
        return (), {"older_than": 1, "with_state": True, "_t": t}

    def run(older_than: int, with_state: bool, _t: Any) -> None:
        got = _t.evict(older_than=older_than, with_state=with_state)
        assert got["ids"].shape[0] == half
        assert got["accumulator"].shape == (half, dim)

    benchmark.pedantic(run, setup=setup, rounds=10)


@pytest.mark.benchmark(group="insert_evict")
@pytest.mark.parametrize("n", [2048])
def test_insert_evict_on_evict(benchmark: Any, n: int) -> None:
    """test_insert_evict's churn (dim 64) with an on_evict callback receiving every row."""
    dim = 64
    received = [0]

    def spill(ids: U64Array, values: F32Array) -> None:
        received[0] += ids.shape[0]

    t = embstore.Table(dim=dim, capacity=EVICT_CAPACITY, on_evict=spill)
    warm(t, splitmix64(np.arange(EVICT_CAPACITY, dtype=np.uint64) + np.uint64(1 << 50)), dim)
    counter = iter(range(1 << 40, 1 << 41, n))

    def setup() -> tuple[tuple[U64Array], dict[str, Any]]:
        start = next(counter)
        return (splitmix64(np.arange(start, start + n, dtype=np.uint64)),), {}

    benchmark.pedantic(t.lookup, setup=setup, rounds=30, warmup_rounds=2)
    assert received[0] == t.stats()["evictions"] > 0


# --------------------------------------------------------------------------------------
# The W1 workload generator (embstore.bench) follows WORKLOADS.md
# --------------------------------------------------------------------------------------


def _splitmix64_int(x: int) -> int:
    m = 2**64
    x = (x + 0x9E3779B97F4A7C15) % m
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
    return z ^ (z >> 31)


def test_workload_ids_and_placement() -> None:
    """Ids are splitmix64(rank + (t << 32)); warm-up position r * 618033 mod U holds rank r."""
    from embstore.bench import make_workload

    universe = 1000
    wl = make_workload(
        num_tables=3, universe=universe, batch_size=16, pooling=4, dim=8, num_batches=2, seed=5
    )
    for t, tab in enumerate(wl.tables):
        for r in (0, 1, 2, 617, 999):
            assert int(tab.ids[r]) == _splitmix64_int(r + (t << 32))
            assert int(tab.row[r]) == r * 618033 % universe
            assert tab.warm_ids[r * 618033 % universe] == tab.ids[r]
        assert np.unique(tab.warm_ids).shape[0] == universe
    for batch in wl.batches:
        assert batch.offsets.tolist() == list(range(0, 16 * 4 + 1, 4))
        for t, (keys, rows) in enumerate(zip(batch.keys, batch.rows, strict=True)):
            assert keys.dtype == np.uint64
            assert keys.shape == (64,)
            # keys and dense rows name the same ranks
            np.testing.assert_array_equal(wl.tables[t].warm_ids[rows], keys)
    assert [g.shape for g in wl.grads] == [(16, 8)] * 3


def test_zipf_sampling() -> None:
    """Inverse-CDF sampling reproduces Zipf(1.05) frequencies of the head ranks."""
    universe, n = 10_000, 400_000
    cdf = zipf_cdf(universe)
    ranks = np.searchsorted(cdf, np.random.default_rng(0).random(n))
    assert ranks.min() >= 0
    assert ranks.max() < universe
    p = np.arange(1, universe + 1, dtype=np.float64) ** -1.05
    p /= p.sum()
    counts = np.bincount(ranks, minlength=universe)
    for r in range(5):
        expected = n * p[r]
        assert abs(counts[r] - expected) < 5 * np.sqrt(expected)
