"""The sharded store keeps TableGroup's semantics where the client could easily drift:
padding ids, batches rewritten between a forward and its apply, forwards the shards dropped,
and several clients sharing the shards."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_sharded import assert_same_rows, batch, grads_of, in_process, specs

import embstore
from embstore import _sharded
from embstore.ray import ShardedTableGroup, TableSpec, _pool
from embstore.ray._local import Done, LocalBackend
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
        # An id XORed with CRC-32's polynomial: what a CRC of the batch could not tell apart.
        last = {"item": (np.array([5, 9], np.uint64), np.array([0, 2], np.int64))}
        store.lookup_sum(last)
        group.lookup_sum(last)
        other = (np.array([5 ^ 0x1DB710641, 9], np.uint64), last["item"][1])
        g4 = grads_of(rng, {"item": other}, DIMS)
        store.apply_gradients(g4)
        group.apply_gradients(g4)
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


class PerShard(LocalBackend):
    """Each shard's call on its own, as Ray's actors run them (ShardServer.lookup/apply):
    a shard may fail while the others succeed, and each takes the client's step."""

    def submit_all(self, method: str, calls: Any) -> list[Done]:
        return [
            Done(lambda s=s, a=a: getattr(s, method)(*a))
            for s, a in zip(self.servers, calls, strict=True)
        ]


def test_a_plain_group_checkpoint_keeps_its_step_on_every_shard(
    tmp_path: os.PathLike[str],
) -> None:
    """A TableGroup checkpoint records no store step: its tables keep their own, and the
    client does not push 0 onto the shards (rows used now must not look old)."""
    g = embstore.TableGroup({"a": embstore.Table(2, 100, optimizer=embstore.SGD(lr=0.1))})
    g.set_step(50)
    g.lookup_sum({"a": (np.arange(10, dtype=np.uint64), np.arange(11))})
    g.save(tmp_path)
    source = _sharded.open_source(tmp_path)
    sp = _sharded.specs_of(source)
    with ShardedTableGroup(
        sp, num_shards=2, backend="local", _source=source, _backend=PerShard(sp, 2, source)
    ) as store:
        store.lookup_sum({"a": (np.arange(3, dtype=np.uint64), np.arange(4))})
        assert [s.group["a"].step for s in store._backend.servers] == [50, 50]
        assert store.evict(older_than=40)["a"]["ids"].shape[0] == 0
        store.set_step(60)
        store.lookup_sum({"a": (np.arange(3, dtype=np.uint64), np.arange(4))})
        assert [s.group["a"].step for s in store._backend.servers] == [60, 60]


def test_a_forward_that_fails_on_one_shard_is_dropped_by_all() -> None:
    """A training lookup that one shard refuses leaves no orphan forward on the others: it
    would count towards their MAX_PENDING, and they would drop a forward the client still
    counts as held (its apply then raised StaleStepError on a shard after another applied)."""
    names = [f"t{i}" for i in range(MAX_PENDING + 1)]
    sp = {n: TableSpec(dim=2, capacity=1000, optimizer=embstore.SGD(lr=0.1)) for n in names}
    sp["small"] = TableSpec(dim=2, capacity=16, optimizer=embstore.SGD(lr=0.1), eviction="none")
    group = in_process(sp)
    store = ShardedTableGroup(sp, num_shards=2, backend="local", _backend=PerShard(sp, 2))
    one = (np.array([1], np.uint64), np.array([0, 1], np.int64))
    with store:
        store.lookup_sum({"t0": one})
        group.lookup_sum({"t0": one})
        keys = np.arange(1, 200, dtype=np.uint64)
        (plan,) = _pool.route(["small"], [(keys, np.array([0, 199]), None, None)], 2, mean=False)
        bad = np.concatenate(
            [plan.keys[: plan.key_start[1]][:40], plan.keys[plan.key_start[1] :][:2]]
        )
        with pytest.raises(embstore.CapacityError):  # shard 0 overflows, shard 1 does not
            store.lookup_sum({"small": (bad, np.array([0, bad.shape[0]]))})
        assert all(len(s._pending) == 1 for s in store._backend.servers)
        for name in names[1:MAX_PENDING]:
            store.lookup_sum({name: one})
            group.lookup_sum({name: one})
        g = {"t0": (*one, np.ones((1, 2), np.float32))}
        store.apply_gradients(g)
        group.apply_gradients(g)
        for name in names[:MAX_PENDING]:
            a, b = store.export(name), group[name].export()
            np.testing.assert_array_equal(a["values"], b["values"])


def test_a_failed_restore_reports_the_unwaited_applies_errors(
    tmp_path: os.PathLike[str],
) -> None:
    """restore() waits for applies sent with wait=False; when the checkpoint does not load,
    nothing is rolled back, so their errors are reported with the restore's own."""
    rng = np.random.default_rng(19)
    with ShardedTableGroup(specs("sgd"), num_shards=2, backend="local") as store:
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        store.save(tmp_path)
        victim = next(p for p in sorted(Path(tmp_path).glob("shard-00001*/*")) if p.is_file())
        with open(victim, "r+b") as f:
            f.seek(100)
            f.write(b"\xff" * 16)
        for server in store._backend.servers:
            server._pending.clear()  # as after a restart: the apply will raise StaleStepError
        handle = store.apply_gradients(grads_of(rng, feats, DIMS), wait=False)
        assert handle is not None
        with pytest.raises(embstore.CheckpointError) as info:
            store.restore(tmp_path)
        assert any("StaleStepError" in note for note in getattr(info.value, "__notes__", []))
        store.lookup_sum(feats, insert=False)  # the local backend kept its shards


def test_a_restarted_shard_takes_the_clients_learning_rate(tmp_path: os.PathLike[str]) -> None:
    """Each training call carries the rates set_lr changed, so a shard rebuilt from its spec
    or a checkpoint (as Ray restarts it) takes them; restore() rolls them back."""
    from embstore.ray.shard import ShardServer

    rng = np.random.default_rng(20)
    sp = specs("sgd")
    with ShardedTableGroup(sp, num_shards=2, backend="local", _backend=PerShard(sp, 2)) as store:
        store.save(tmp_path)
        store.set_lr("user", 0.003)
        old = store._backend.servers[0]
        store._backend.servers[0] = ShardServer.create(sp, 0, 2)  # as if Ray restarted it
        old.close()
        assert store._backend.servers[0].group["user"].optimizer.lr == 0.1
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        assert [s.group["user"].optimizer.lr for s in store._backend.servers] == [0.003] * 2
        store.restore(tmp_path)
        store.lookup_sum(feats)
        assert [s.group["user"].optimizer.lr for s in store._backend.servers] == [0.1] * 2
