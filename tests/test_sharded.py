"""embstore.ray.ShardedTableGroup on the local backend: exactly the in-process TableGroup."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import random_offsets

import embstore
from embstore.ray import ShardedTableGroup, StaleStepError, TableSpec

OPTIMIZERS = {
    "sgd": lambda: embstore.SGD(lr=0.1),
    "momentum": lambda: embstore.SGD(lr=0.05, momentum=0.9),
    "adagrad": lambda: embstore.Adagrad(lr=0.1),
    "rowwise": lambda: embstore.RowWiseAdagrad(lr=0.1),
    "adam": lambda: embstore.Adam(lr=0.01, weight_decay=0.01),
    "ftrl": lambda: embstore.FTRL(alpha=0.1, l1=0.01, l2=0.01),
}


def specs(opt: str = "adagrad") -> dict[str, TableSpec]:
    return {
        "user": TableSpec(dim=5, capacity=4000, optimizer=OPTIMIZERS[opt](), num_shards=4),
        "item": TableSpec(
            dim=3,
            capacity=4000,
            optimizer=OPTIMIZERS[opt](),
            initializer=embstore.Uniform(-1.0, 1.0, seed=3),
        ),
    }


def in_process(sp: dict[str, TableSpec]) -> embstore.TableGroup:
    return embstore.TableGroup(
        {
            n: embstore.Table(
                s.dim, s.capacity, optimizer=s.optimizer, initializer=s.initializer, name=n
            )
            for n, s in sp.items()
        }
    )


def batch(rng: np.random.Generator, weighted: bool, universe: int = 300) -> dict[str, Any]:
    out = {}
    for name in ("user", "item"):
        n = int(rng.integers(0, 120))
        keys = rng.integers(0, universe, n).astype(np.uint64)  # duplicates, across bags too
        bags = int(rng.integers(1, 20))
        off = random_offsets(rng, n, bags)
        feat: tuple[Any, ...] = (keys, off)
        if weighted:
            feat = (keys, off, rng.uniform(-2, 2, n).astype(np.float32))
        out[name] = feat
    return out


def grads_of(
    rng: np.random.Generator, feats: dict[str, Any], dims: dict[str, int]
) -> dict[str, Any]:
    out = {}
    for name, f in feats.items():
        g = rng.standard_normal((f[1].shape[0] - 1, dims[name])).astype(np.float32)
        out[name] = (f[0], f[1], g, *f[2:])
    return out


def sorted_export(e: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(e["ids"], kind="stable")
    return {k: v[order] for k, v in e.items()}


def assert_same_rows(store: ShardedTableGroup, group: embstore.TableGroup) -> None:
    for name in group:
        got, want = sorted_export(store.export(name)), sorted_export(group[name].export())
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype
            np.testing.assert_array_equal(got[k].view(np.uint8), want[k].view(np.uint8), err_msg=k)


def train(
    store: Any,
    group: embstore.TableGroup,
    rng: np.random.Generator,
    steps: int,
    mode: str,
    weighted: bool,
    exact: bool = True,
) -> None:
    dims = {n: group[n].dim for n in group}
    for step in range(steps):
        store.set_step(step + 1)
        group.set_step(step + 1)
        feats = batch(rng, weighted)
        got = store.lookup_sum(feats, mode=mode, exact=exact)
        want = group.lookup_sum(feats, mode=mode)
        for n in feats:
            if exact:
                np.testing.assert_array_equal(got[n].view(np.uint32), want[n].view(np.uint32))
            else:
                np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-6)
        g = grads_of(rng, feats, dims)
        store.apply_gradients(g, mode=mode)
        group.apply_gradients(g, mode=mode)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_rows_bitwise_equal_after_k_steps(opt: str, shards: int) -> None:
    rng = np.random.default_rng(shards * 100 + len(opt))
    sp = specs(opt)
    with ShardedTableGroup(sp, num_shards=shards, backend="local") as store:
        group = in_process(sp)
        for mode, weighted in (("sum", False), ("mean", True), ("sum", True), ("mean", False)):
            train(store, group, rng, 3, mode, weighted, exact=mode == "sum")
        assert_same_rows(store, group)
        st = store.stats()["tables"]
        for n in group:
            want = group[n].stats()
            for key in ("size", "hits", "misses", "inserts", "evictions"):
                assert st[n][key] == want[key], key


def test_pooled_sums_within_tolerance_and_exact_bitwise() -> None:
    rng = np.random.default_rng(5)
    sp = specs("sgd")
    with ShardedTableGroup(sp, num_shards=3, backend="local") as store:
        group = in_process(sp)
        for mode in ("sum", "mean"):
            train(store, group, rng, 3, mode, weighted=True, exact=False)
            train(store, group, rng, 3, mode, weighted=False, exact=True)
        assert_same_rows(store, group)


def test_apply_of_other_keys_is_routed_afresh() -> None:
    rng = np.random.default_rng(9)
    sp = specs("adam")
    with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
        group = in_process(sp)
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        group.lookup_sum(feats)
        other = batch(rng, weighted=True)  # not the forward's keys: no step token
        g = grads_of(rng, other, {"user": 5, "item": 3})
        store.apply_gradients(g, mode="mean")
        group.apply_gradients(g, mode="mean")
        g2 = grads_of(rng, feats, {"user": 5, "item": 3})
        store.apply_gradients({"user": g2["user"]})  # a subset of the forward's tables
        group.apply_gradients({"user": g2["user"]})
        store.apply_gradients(g2)  # the forward is consumed: routed afresh
        group.apply_gradients(g2)
        assert_same_rows(store, group)


def test_tables_of_one_forward_applied_in_separate_calls() -> None:
    rng = np.random.default_rng(10)
    sp = specs("adagrad")
    with ShardedTableGroup(sp, num_shards=3, backend="local") as store:
        group = in_process(sp)
        feats = batch(rng, weighted=True)
        store.lookup_sum(feats, mode="mean")
        group.lookup_sum(feats, mode="mean")
        g = grads_of(rng, feats, {"user": 5, "item": 3})
        for name in ("user", "item", "user"):  # item by its token; user again: routed
            store.apply_gradients({name: g[name]}, mode="mean")
            group.apply_gradients({name: g[name]}, mode="mean")
        assert not any(s._pending for s in store._backend.servers)
        assert_same_rows(store, group)


def test_apply_whose_forward_the_shard_dropped_raises_stale_step() -> None:
    rng = np.random.default_rng(3)
    with ShardedTableGroup(specs(), num_shards=2, backend="local") as store:
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        for server in store._backend.servers:
            server._pending.clear()  # as after a restart
        with pytest.raises(StaleStepError, match="step token"):
            store.apply_gradients(grads_of(rng, feats, {"user": 5, "item": 3}))


def test_shard_refuses_gradients_of_another_split() -> None:
    rng = np.random.default_rng(3)
    with ShardedTableGroup(specs(), num_shards=2, backend="local") as store:
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        token = next(iter(store._backend.servers[0]._pending))
        grads = {"user": np.zeros((feats["user"][1].shape[0] + 4, 5), np.float32)}
        with pytest.raises(ValueError, match=r"shard 0: \d+ gradient rows for \d+ bags"):
            store._backend.servers[0].apply(token, grads, {})


def test_wait_false_returns_a_handle_and_later_lookups_see_the_update() -> None:
    rng = np.random.default_rng(4)
    sp = specs("sgd")
    with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
        group = in_process(sp)
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        group.lookup_sum(feats)
        g = grads_of(rng, feats, {"user": 5, "item": 3})
        handle = store.apply_gradients(g, wait=False)
        group.apply_gradients(g)
        got = store.lookup_sum(feats, insert=False, exact=True)
        assert handle is not None
        handle.wait()
        want = group.lookup_sum(feats, insert=False)
        for n in feats:
            np.testing.assert_array_equal(got[n], want[n])


def test_error_of_an_unwaited_apply_surfaces_at_the_next_call() -> None:
    rng = np.random.default_rng(7)
    with ShardedTableGroup(specs(), num_shards=2, backend="local") as store:
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        for server in store._backend.servers:
            server._pending.clear()
        handle = store.apply_gradients(grads_of(rng, feats, {"user": 5, "item": 3}), wait=False)
        assert handle is not None
        with pytest.raises(StaleStepError):
            store.lookup_sum(feats)
        store.lookup_sum(feats)  # raised once; the store goes on


BAD_LOOKUPS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"nope": (np.zeros(1, np.uint64), np.array([0, 1]))}, {}),
    ({"user": (np.zeros(2, np.uint64),)}, {}),
    ({"user": (np.zeros(2, np.float32), np.array([0, 2]))}, {}),
    ({"user": (np.zeros((2, 1), np.uint64), np.array([0, 2]))}, {}),
    ({"user": (np.zeros(2, np.uint64), np.array([0, 3]))}, {}),
    ({"user": (np.zeros(2, np.uint64), np.array([1, 2]))}, {}),
    ({"user": (np.zeros(2, np.uint64), np.array([0, 2, 1, 2]))}, {}),
    ({"user": (np.zeros(2, np.uint64), np.array([0, 2]), np.array([1.0, np.inf]))}, {}),
    ({"user": (np.zeros(2, np.uint64), np.array([0, 2]), np.ones(3))}, {}),
    ({"user": (np.zeros(2, np.uint64), np.array([0, 2]))}, {"mode": "max"}),
    (
        {
            "user": (np.zeros(2, np.uint64), np.array([0, 2])),
            "item": (np.zeros(2, np.uint64), np.array([0, 1])),
        },
        {},
    ),
]


def _error(fn: Any) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as info:  # noqa: PT011  (compared with the group)
        fn()
    return info.type, str(info.value)


@pytest.mark.parametrize("case", range(len(BAD_LOOKUPS)))
def test_bad_lookup_raises_what_table_group_raises_and_calls_no_shard(case: int) -> None:
    feats, kw = BAD_LOOKUPS[case]
    sp = specs()
    with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
        want = _error(lambda: in_process(sp).lookup_sum(feats, **kw))
        assert _error(lambda: store.lookup_sum(feats, **kw)) == want
        assert all(st["hits"] + st["misses"] == 0 for st in store.stats()["tables"].values())
        assert not any(s._pending for s in store._backend.servers)


def test_bad_apply_raises_what_table_group_raises_and_applies_nothing() -> None:
    keys, off = np.array([1, 2, 3], np.uint64), np.array([0, 1, 3])
    good = np.ones((2, 5), np.float32)
    nan = good.copy()
    nan[1, 2] = np.nan
    cases: list[dict[str, Any]] = [
        {"user": (keys, off, np.ones((2, 4), np.float32))},
        {"user": (keys, off, nan)},
        {"user": (keys, off)},
        {"user": (keys, off, good, np.array([1.0, 2.0, np.nan], np.float32))},
        {"user": (keys, off, good), "item": (keys, off, np.full((2, 3), np.inf, np.float32))},
        {"zzz": (keys, off, good)},
    ]
    sp = specs()
    for grads in cases:
        with ShardedTableGroup(sp, num_shards=3, backend="local") as store:
            want = _error(lambda g=grads: in_process(sp).apply_gradients(g))
            assert _error(lambda g=grads: store.apply_gradients(g)) == want
            assert all(st["size"] == 0 for st in store.stats()["tables"].values())


def test_set_step_evict_and_health() -> None:
    rng = np.random.default_rng(2)
    sp = specs("sgd")
    with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
        group = in_process(sp)
        train(store, group, rng, 4, "sum", weighted=False)
        got = store.evict(older_than=3)
        for n in group:
            want = group[n].evict(older_than=3)
            assert sorted(got[n]["ids"].tolist()) == sorted(want["ids"].tolist())
        assert_same_rows(store, group)
        health = store.health()
        assert len(health) == 2
        assert all(h["alive"] for h in health)
        assert sum(h["rows"]["user"] for h in health) == len(group["user"])


def test_constructor_errors_name_the_argument() -> None:
    with pytest.raises(TypeError, match=r"tables\['a'\] must be an embstore.TableSpec"):
        ShardedTableGroup({"a": 3}, num_shards=2, backend="local")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="num_shards must be positive"):
        ShardedTableGroup(specs(), num_shards=0, backend="local")
    with pytest.raises(ValueError, match="backend must be"):
        ShardedTableGroup(specs(), num_shards=1, backend="mpi")
    with pytest.raises(ValueError, match="dim must be positive"):
        ShardedTableGroup({"a": TableSpec(dim=0, capacity=10)}, num_shards=1, backend="local")
    with pytest.raises(ValueError, match="restore='checkpoint' needs"):
        ShardedTableGroup(specs(), num_shards=1, restore="checkpoint", backend="local")


def _raw(values: list[int]) -> Any:
    from embstore import _core

    h = _core.LatencyHistogram()  # standalone: records whatever the metrics switch says
    for v in values:
        h.record(v)
    return h.snapshot()


def test_stats_merge_histograms_bucket_by_bucket() -> None:
    from embstore import _core
    from embstore.ray import _stats

    fast = [1_000 + 7 * i for i in range(990)]  # shard 0: ~1 us
    slow = [5_000_000 + 1_000 * i for i in range(10)]  # shard 1: ~5 ms
    per_shard = [
        {"tables": {"t": {"hits": 3}}, "raw": {"t": {"lookup": _raw(fast)}}},
        {"tables": {"t": {"hits": 4}}, "raw": {"t": {"lookup": _raw(slow)}}},
    ]
    merged = _stats.merge(per_shard, _stats.Layers())["tables"]["t"]
    assert merged["hits"] == 7
    want = _core.histogram_summary(fast + slow)  # one histogram of every value
    assert merged["latency"]["lookup"] == pytest.approx(want)
    assert merged["latency"]["lookup"]["p99_us"] < 100  # not an average of the shards' P99s


def test_stats_sum_counters_and_time_the_client_layers() -> None:
    rng = np.random.default_rng(6)
    sp = specs("sgd")
    with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
        group = in_process(sp)
        train(store, group, rng, 3, "sum", weighted=False, exact=False)
        st = store.stats()
        lat = st["tables"]["user"]["latency"]
        shard_counts = [s["user"]["latency"]["group.lookup_sum"]["count"] for s in st["shards"]]
        assert lat["group.lookup_sum"]["count"] == sum(shard_counts) == 6
        for layer in (
            "client.route",
            "client.rpc.lookup_sum",
            "client.reduce",
            "client.rpc.apply",
            "shard.lookup_sum",
            "shard.apply",
        ):
            assert st["client"][layer]["count"] > 0, layer


def test_prometheus_text_labels_every_shard() -> None:
    parser = pytest.importorskip("prometheus_client.parser", reason="prometheus_client absent")
    rng = np.random.default_rng(8)
    sp = specs("sgd")
    with ShardedTableGroup(sp, num_shards=3, backend="local") as store:
        train(store, in_process(sp), rng, 2, "sum", weighted=False)
        text = store.prometheus_text()
        sizes = {}
        for family in parser.text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "embstore_size":
                    sizes[(sample.labels["shard"], sample.labels["table"])] = sample.value
        per_shard = store.stats()["shards"]
        assert sizes == {
            (str(k), n): float(s[n]["size"]) for k, s in enumerate(per_shard) for n in s
        }


def test_embedding_bag_collection_over_a_sharded_store_trains_as_over_a_group() -> None:
    """EmbeddingBagCollection takes a ShardedTableGroup wherever it takes a TableGroup."""
    torch = pytest.importorskip("torch", reason="embstore.torch needs torch")
    from embstore.torch import EmbeddingBagCollection

    rng = np.random.default_rng(21)
    sp = specs("adagrad")
    with ShardedTableGroup(sp, num_shards=3, backend="local") as store:
        group = in_process(sp)
        modules = [EmbeddingBagCollection(store), EmbeddingBagCollection(group)]
        assert "user: dim=5" in repr(modules[0])
        for _ in range(4):
            features = {n: b[:2] for n, b in batch(rng, weighted=False).items()}
            losses = []
            for ebc in modules:
                out = ebc(features)
                # gradients independent of the pooled values (the shards' partial sums round
                # differently without exact=True), so the applied rows compare bit for bit
                loss = sum((t * torch.linspace(-1.0, 1.0, t.shape[1])).sum() for t in out.values())
                loss.backward()
                losses.append(float(loss.detach()))
            assert losses[0] == pytest.approx(losses[1], rel=1e-5)
        assert_same_rows(store, group)
