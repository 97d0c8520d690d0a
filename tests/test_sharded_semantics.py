"""The sharded store keeps TableGroup's semantics where the client could easily drift:
padding ids, batches rewritten between a forward and its apply, forwards the shards dropped,
and several clients sharing the shards."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from test_sharded import assert_same_rows, batch, grads_of, in_process, specs

import embstore
from embstore.ray import ShardedTableGroup, TableSpec
from embstore.ray.shard import MAX_PENDING

DIMS = {"user": 5, "item": 3}


def padded_specs(pad: int) -> dict[str, TableSpec]:
    return {
        "t": TableSpec(
            dim=2,
            capacity=500,
            optimizer=embstore.Adagrad(lr=0.1),
            initializer=embstore.Uniform(-1.0, 1.0, seed=1),
            padding_id=pad,
        ),
        "plain": TableSpec(dim=3, capacity=500, optimizer=embstore.SGD(lr=0.1)),
    }


def padded_group(sp: dict[str, TableSpec]) -> embstore.TableGroup:
    return embstore.TableGroup(
        {
            n: embstore.Table(
                s.dim,
                s.capacity,
                optimizer=s.optimizer,
                initializer=s.initializer,
                padding_id=s.padding_id,
                name=n,
            )
            for n, s in sp.items()
        }
    )


def padded_batch(rng: np.random.Generator, pad: int, dtype: Any) -> dict[str, Any]:
    """Bags where about a third of the ids are the padding id (some bags only padding); a
    NaN weight on each padding id, which nothing may read."""
    n = 40
    keys = rng.integers(1, 60, n).astype(np.int64)
    keys[rng.random(n) < 0.35] = pad
    keys[:3] = pad  # bag 0 holds only padding
    off = np.array([0, 3, 10, 10, 25, n], dtype=np.int64)
    w = rng.uniform(0.5, 2.0, n).astype(np.float32)
    w[keys == pad] = np.nan
    k = keys.astype(dtype) if dtype is np.int64 else keys.view(np.uint64)
    plain = rng.integers(0, 60, 12).astype(np.uint64)
    return {"t": (k, off, w), "plain": (plain, np.array([0, 5, 12], dtype=np.int64))}


@pytest.mark.parametrize("pad", [0, -1])
@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_padding_ids_are_dropped_before_routing(pad: int, dtype: Any) -> None:
    """A padding id counts in no bag's size (mean mode), gets no row and its weight is
    never checked: results and rows equal the in-process group's."""
    rng = np.random.default_rng(abs(pad) + 7)
    sp = padded_specs(pad)
    group = padded_group(sp)
    with ShardedTableGroup(sp, num_shards=3, backend="local") as store:
        for step in range(4):
            feats = padded_batch(rng, pad, dtype)
            exact = step % 2 == 1
            got = store.lookup_sum(feats, mode="mean", exact=exact)
            want = group.lookup_sum(feats, mode="mean")
            for name in want:
                if exact:
                    np.testing.assert_array_equal(got[name], want[name])
                else:
                    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
            g = {
                n: (
                    f[0],
                    f[1],
                    rng.standard_normal((f[1].shape[0] - 1, sp[n].dim)).astype(np.float32),
                    *f[2:],
                )
                for n, f in feats.items()
            }
            store.apply_gradients(g, mode="mean")
            group.apply_gradients(g, mode="mean")
        assert_same_rows(store, group)
        assert len(store.export("t")["ids"]) == len(group["t"])


def test_padding_id_survives_a_resharded_checkpoint(tmp_path: os.PathLike[str]) -> None:
    rng = np.random.default_rng(11)
    sp = padded_specs(0)
    group = padded_group(sp)
    feats = padded_batch(rng, 0, np.uint64)
    with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
        store.lookup_sum(feats)
        group.lookup_sum(feats)
        store.save(tmp_path)
    with ShardedTableGroup.load(tmp_path, num_shards=3, backend="local") as back:
        assert back["t"].padding_id == 0
        np.testing.assert_array_equal(
            back.lookup_sum(feats, exact=True)["t"], group.lookup_sum(feats)["t"]
        )
        assert_same_rows(back, group)  # the padding id got no row
    merged = embstore.TableGroup.load_sharded(tmp_path)
    assert merged["t"].padding_id == 0
    np.testing.assert_array_equal(merged.lookup_sum(feats)["t"], group.lookup_sum(feats)["t"])


def test_keys_rewritten_between_forward_and_apply_are_applied_as_given() -> None:
    """An apply whose arrays were rewritten in place after the forward (a reused loader
    buffer) is not the forward's: it updates the ids it holds now, as TableGroup does."""
    rng = np.random.default_rng(12)
    sp = specs("adagrad")
    group = in_process(sp)
    with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
        feats = batch(rng, weighted=True)
        store.lookup_sum(feats)
        group.lookup_sum(feats)
        keys, _off, w = feats["user"]
        keys[:] = rng.integers(1000, 2000, keys.shape[0]).astype(np.uint64)
        w[:1] = 3.0
        g = grads_of(rng, feats, DIMS)
        store.apply_gradients(g)
        group.apply_gradients(g)
        assert_same_rows(store, group)
        fresh = batch(rng, weighted=False)
        store.lookup_sum(fresh)
        group.lookup_sum(fresh)
        copy = {n: (f[0].copy(), f[1].copy()) for n, f in fresh.items()}
        fresh["item"][0][:2] += np.uint64(1)  # rewritten; an equal copy of the new contents
        g2 = grads_of(rng, {"item": (fresh["item"][0].copy(), fresh["item"][1])}, DIMS)
        store.apply_gradients(g2)
        group.apply_gradients(g2)
        g3 = grads_of(rng, {"user": copy["user"]}, DIMS)  # unchanged: the forward's token
        store.apply_gradients(g3)
        group.apply_gradients(g3)
        assert_same_rows(store, group)


def test_apply_of_a_forward_the_shards_dropped_is_routed_afresh() -> None:
    """Past MAX_PENDING newer forwards the shards drop a forward; its apply then ships its
    keys again instead of raising StaleStepError."""
    rng = np.random.default_rng(13)
    sp = specs("adam")
    group = in_process(sp)
    with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
        old = {"item": batch(rng, weighted=False)["item"]}
        store.lookup_sum(old)
        group.lookup_sum(old)
        for _ in range(MAX_PENDING + 3):
            f = {"user": batch(rng, weighted=False)["user"]}
            store.lookup_sum(f)
            group.lookup_sum(f)
        assert all(len(s._pending) == MAX_PENDING for s in store._backend.servers)
        g = grads_of(rng, old, DIMS)
        store.apply_gradients(g)
        group.apply_gradients(g)
        assert_same_rows(store, group)


def test_clients_sharing_the_shards_keep_their_own_forwards() -> None:
    """Two clients on the same shards (as attached stores): their step tokens differ, and
    each one's forwards survive the other's, however many the other sends."""
    rng = np.random.default_rng(14)
    sp = specs("adagrad")
    group = in_process(sp)
    store = ShardedTableGroup(sp, num_shards=2, backend="local")
    other = ShardedTableGroup(sp, num_shards=2, backend="local", _backend=store._backend)
    try:
        fa, fb = batch(rng, weighted=False), batch(rng, weighted=True)
        for client, f in ((store, fa), (other, fb)):
            client.lookup_sum(f)
            group.lookup_sum(f)
        for _ in range(MAX_PENDING + 2):  # the other client's forwards, never applied
            f = batch(rng, weighted=False)
            other.lookup_sum(f)
            group.lookup_sum(f)
        tokens = [t for s in store._backend.servers for t in s._pending]
        assert len({t >> 40 for t in tokens}) == 2
        for client, f in ((store, fa), (other, fb)):
            g = grads_of(rng, f, DIMS)
            client.apply_gradients(g)
            group.apply_gradients(g)
        assert_same_rows(store, group)
    finally:
        store.close()


def test_set_lr_changes_every_shards_learning_rate() -> None:
    """A learning-rate schedule over the sharded store trains as over the group; bad
    arguments raise what Table.set_lr and the group raise, and change nothing."""
    rng = np.random.default_rng(15)
    sp = specs("adam")
    group = in_process(sp)
    with ShardedTableGroup(sp, num_shards=3, backend="local") as store:
        for step, lr in enumerate([0.01, 0.003, 0.001]):
            store.set_lr("user", lr)
            group["user"].set_lr(lr)
            feats = batch(rng, weighted=step == 1)
            store.lookup_sum(feats)
            group.lookup_sum(feats)
            g = grads_of(rng, feats, DIMS)
            store.apply_gradients(g)
            group.apply_gradients(g)
        assert_same_rows(store, group)
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="lr must be a positive finite number"):
                store.set_lr("user", bad)
        with pytest.raises(KeyError, match="unknown table 'nope'"):
            store.set_lr("nope", 0.1)
        assert all(s.group["user"].optimizer.lr == 0.001 for s in store._backend.servers)


def test_a_shard_sets_its_step_only_when_the_clients_differs() -> None:
    """Each training call carries the client's step; a shard calls set_step only when its
    tables' step differs (set_step turns on per-row step tracking, which makes every later
    lookup take the locked path: a store that never sets steps must not pay for it)."""
    from embstore.ray.shard import ShardServer

    server = ShardServer.create(specs("sgd"), 0, 1)
    calls: list[int] = []
    real = server.group.set_step
    server.group.set_step = lambda step: (calls.append(step), real(step))  # type: ignore[method-assign]
    keys = np.array([1, 2, 3], dtype=np.uint64)
    routed = {"user": (keys, np.array([0, 3], dtype=np.int64), None, None)}
    for token in (1, 2):
        server.lookup(token, routed, True, False, 0)
        server.apply(token, {"user": np.ones((1, 5), np.float32)}, {}, 0)
    assert calls == []  # a fresh shard is at step 0 already
    server.lookup(3, routed, True, False, 7)
    server.apply(3, {"user": np.ones((1, 5), np.float32)}, {}, 7)
    assert calls == [7]
    assert server.group["user"].step == 7
    server.close()


def test_stats_expose_the_merged_raw_histograms() -> None:
    """stats()["raw"] holds the merged histograms its latency summaries come from, so
    several clients' stats merge further into true percentiles."""
    from embstore import metrics

    rng = np.random.default_rng(16)
    sp = specs("sgd")
    stores = [ShardedTableGroup(sp, num_shards=2, backend="local") for _ in range(2)]
    try:
        for store in stores:
            for _ in range(3):
                feats = batch(rng, weighted=False)
                store.lookup_sum(feats)
                store.apply_gradients(grads_of(rng, feats, DIMS))
        stats = [s.stats() for s in stores]
        for st in stats:
            for name, timers in st["raw"]["tables"].items():
                for timer, snap in timers.items():
                    got = metrics.summarize_histogram(snap)
                    if got["count"]:  # timers nothing recorded are left out of the summary
                        assert got == pytest.approx(st["tables"][name]["latency"][timer])
            for layer, snap in st["raw"]["client"].items():
                assert metrics.summarize_histogram(snap) == pytest.approx(st["client"][layer])
        both = metrics.merge_histograms([st["raw"]["client"]["client.route"] for st in stats])
        summary = metrics.summarize_histogram(both)
        assert summary["count"] == sum(st["client"]["client.route"]["count"] for st in stats)
    finally:
        for s in stores:
            s.close()
