"""embstore.ray on Ray: actors, ordering, kills (ray.kill and SIGKILL) and restarts.

One local cluster for the whole run (num_cpus=2, no dashboard, no usage stats).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'embstore[ray]')")

from test_sharded import assert_same_rows, batch, grads_of, in_process, specs, train

import embstore
from embstore.ray import ShardedTableGroup, ShardLostError, StaleStepError

pytestmark = pytest.mark.timeout(300)
DIMS = {"user": 5, "item": 3}


@pytest.fixture(scope="session")
def cluster() -> Iterator[None]:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    src = os.path.dirname(os.path.dirname(os.path.abspath(embstore.__file__)))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": src, "RAY_USAGE_STATS_ENABLED": "0"}},
    )
    yield
    ray.shutdown()


def _wait_restarted(store: ShardedTableGroup, shard: int, restarts: int) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        h = store.health()[shard]
        if h["alive"] and h["restarts"] >= restarts:
            return h
        time.sleep(0.2)
    raise AssertionError(f"shard {shard} did not restart")


def test_ray_rows_equal_in_process_and_wait_false_is_ordered(cluster: None) -> None:
    rng = np.random.default_rng(11)
    sp = specs("adam")
    with ShardedTableGroup(sp, num_shards=2, backend="ray") as store:
        group = in_process(sp)
        train(store, group, rng, 3, "sum", weighted=True)
        train(store, group, rng, 2, "mean", weighted=False, exact=False)
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        group.lookup_sum(feats)
        g = grads_of(rng, feats, DIMS)
        handle = store.apply_gradients(g, wait=False)
        group.apply_gradients(g)
        got = store.lookup_sum(feats, insert=False, exact=True)  # sees the update
        assert handle is not None
        handle.wait()
        want = group.lookup_sum(feats, insert=False)
        for n in feats:
            np.testing.assert_array_equal(got[n], want[n])
        assert_same_rows(store, group)
        assert store.stats()["tables"]["user"]["size"] == len(group["user"])


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_fail_stop_until_restore(cluster: None, tmp_path: Any, how: str) -> None:
    rng = np.random.default_rng(12)
    sp = specs("sgd")
    with ShardedTableGroup(sp, num_shards=2, backend="ray") as store:
        group = in_process(sp)
        train(store, group, rng, 2, "sum", weighted=False)
        store.save(tmp_path)
        saved = {n: group[n].export() for n in group}
        train(store, group, rng, 1, "sum", weighted=False)
        if how == "ray.kill":
            ray.kill(store._backend.actors[1], no_restart=True)
        else:
            os.kill(store.health()[1]["pid"], signal.SIGKILL)
        feats = batch(rng, weighted=False)

        def until_lost() -> None:
            for _ in range(50):  # SIGKILL: the death may be noticed a call later
                store.lookup_sum(feats)
                time.sleep(0.1)

        with pytest.raises(ShardLostError) as info:
            until_lost()
        assert info.value.shard == 1
        assert info.value.applied == "no"
        with pytest.raises(ShardLostError):  # refused until restore
            store.apply_gradients(grads_of(rng, feats, DIMS))
        assert not store.health()[1]["alive"]
        store.restore(tmp_path)
        snapshot = in_process(sp)
        for n, e in saved.items():
            snapshot[n].import_(e)
        assert_same_rows(store, snapshot)
        train(store, snapshot, rng, 1, "sum", weighted=False)


def _wait_dead(actor: Any) -> None:
    """``ray.kill`` returns before the actor is gone (a call sent meanwhile may still run):
    wait, at most 30 s, until a call to it fails."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.call.remote("health"), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    pytest.fail("the killed actor still answers after 30 s")


def _kill_and_wait_replaced(actor: Any) -> None:
    """Kills a restartable actor and waits, at most 60 s, until a new incarnation answers
    (``ray.kill`` returns first: a call sent meanwhile may still reach the old one)."""
    before = ray.get(actor.call.remote("health"), timeout=30)[0]
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.call.remote("health"), timeout=10)[0] != before:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.05)
    pytest.fail("the killed actor was not replaced within 60 s")


def test_apply_to_a_dead_shard_is_not_known_applied(cluster: None) -> None:
    rng = np.random.default_rng(13)
    with ShardedTableGroup(specs("sgd"), num_shards=2, backend="ray") as store:
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        ray.kill(store._backend.actors[0], no_restart=True)
        _wait_dead(store._backend.actors[0])
        with pytest.raises(ShardLostError) as info:
            store.apply_gradients(grads_of(rng, feats, DIMS))
        assert info.value.shard == 0
        assert info.value.applied == "unknown"


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_restore_checkpoint_restarts_the_shard_from_its_checkpoint(
    cluster: None, tmp_path: Any, how: str
) -> None:
    rng = np.random.default_rng(14)
    sp = specs("adagrad")
    with ShardedTableGroup(
        sp, num_shards=2, backend="ray", restore="checkpoint", checkpoint_dir=str(tmp_path)
    ) as store:
        group = in_process(sp)
        train(store, group, rng, 2, "sum", weighted=False)
        store.set_step(5)
        store.save(tmp_path)
        before = ray.get(store._backend.actors[0].call.remote("export", "user"))[1]
        train(store, group, rng, 1, "sum", weighted=False)
        store.set_step(9)
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        if how == "ray.kill":
            ray.kill(store._backend.actors[0], no_restart=False)
        else:
            os.kill(store.health()[0]["pid"], signal.SIGKILL)
        h = _wait_restarted(store, 0, 1)
        assert h["last_checkpoint"] == 5
        assert h["lost_steps"] == 4
        assert h["restarts"] == 1
        with pytest.raises(StaleStepError):  # the restarted shard lost the forward
            store.apply_gradients(grads_of(rng, feats, DIMS))
        after = ray.get(store._backend.actors[0].call.remote("export", "user"))[1]
        o1, o2 = np.argsort(before["ids"]), np.argsort(after["ids"])
        for k in before:
            np.testing.assert_array_equal(after[k][o2], before[k][o1])
        out = store.lookup_sum(feats)  # the store keeps serving
        assert out["user"].shape == (feats["user"][1].shape[0] - 1, 5)


def test_named_store_is_detached_and_attachable(cluster: None, tmp_path: Any) -> None:
    rng = np.random.default_rng(15)
    store = ShardedTableGroup(specs("sgd"), num_shards=2, backend="ray", name="ray-test-store")
    try:
        feats = batch(rng, weighted=False)
        first = store.lookup_sum(feats, exact=True)
        other = ShardedTableGroup.attach("ray-test-store")
        assert other.names == ["user", "item"]
        assert other.num_shards == 2
        again = other.lookup_sum(feats, insert=False, exact=True)
        for n in feats:
            np.testing.assert_array_equal(first[n], again[n])
        store.save(tmp_path)
        store.restore(tmp_path)  # new actors under the same names
        restored = store.lookup_sum(feats, insert=False, exact=True)
        for n in feats:
            np.testing.assert_array_equal(first[n], restored[n])
    finally:
        store.close()
    with pytest.raises(ValueError, match="look up actor"):
        ray.get_actor("ray-test-store.shard0", namespace="embstore")


def test_restartable_store_survives_a_lost_apply(cluster: None, tmp_path: Any) -> None:
    rng = np.random.default_rng(16)
    sp = specs("sgd")
    with ShardedTableGroup(
        sp, num_shards=2, backend="ray", restore="checkpoint", checkpoint_dir=str(tmp_path)
    ) as store:
        group = in_process(sp)
        train(store, group, rng, 1, "sum", weighted=False)
        store.save(tmp_path)
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        _kill_and_wait_replaced(store._backend.actors[1])
        # At most once: the restarted shard lost the forward, so it refuses the apply.
        with pytest.raises(StaleStepError, match="shard 1"):
            store.apply_gradients(grads_of(rng, feats, DIMS))
        out = store.lookup_sum(feats)  # not stopped: lookups go on (retried if needed)
        assert out["item"].shape == (feats["item"][1].shape[0] - 1, 3)
        assert _wait_restarted(store, 1, 1)["last_checkpoint"] == 1


def test_a_shard_error_comes_back_through_the_compiled_graph(cluster: None) -> None:
    sp = {"t": embstore.ray.TableSpec(dim=4, capacity=40, eviction="none")}
    with ShardedTableGroup(sp, num_shards=2, backend="ray") as store:
        ids = np.arange(10, dtype=np.uint64)
        off = np.arange(11, dtype=np.int64)
        store.lookup_sum({"t": (ids, off)})  # compiles the graph
        assert store._backend._compiled is not None
        before = store.lookup_sum({"t": (ids, off)}, insert=False, exact=True)["t"]
        more = np.arange(1000, 1400, dtype=np.uint64)
        with pytest.raises(embstore.CapacityError):
            store.lookup_sum({"t": (more, np.arange(401, dtype=np.int64))})
        # The graph keeps running: the next calls go through it.
        got = store.lookup_sum({"t": (ids, off)}, insert=False, exact=True)["t"]
        assert store._backend._compiled is not None
        np.testing.assert_array_equal(got, before)


def test_the_client_sleeps_only_on_times_from_its_own_clock(cluster: None) -> None:
    """The shards' end times set the client's sleep only when they fall between the call's
    submission and its answer on the client's clock (a shard on another machine has another
    clock). A call counts its slowest shard; the client sleeps on the smaller of the last
    two calls, so one slow call does not make the next one sleep long."""
    from embstore.ray import _ray_backend as rb

    with ShardedTableGroup(specs("sgd"), num_shards=2, backend="ray") as store:
        rng = np.random.default_rng(5)
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)  # the graph's first execution: slow
        store.lookup_sum(feats)
        backend = store._backend
        assert 0 < min(backend._done_ns["lookup"]) < 60e9

        def call(ends: list[int]) -> None:
            c = rb._Call(None, "lookup", ())
            c.submitted -= 1_000_000  # submitted 1 ms ago
            for shard, end in enumerate(ends):
                backend._note_done(shard, c, c.submitted + end)

        call([5_000, 9_000])
        call([300_000, 7_000])  # a slow call: 300 us
        assert backend._done_ns["lookup"] == (9_000, 300_000)
        assert min(backend._done_ns["lookup"]) == 9_000  # what the next call sleeps on
        call([-1, 9_000])  # before submission: another clock
        assert backend._done_ns["lookup"] == (300_000, 0)
        call([5_000, 10**15])  # after the answer: another clock
        assert backend._done_ns["lookup"] == (0, 0)


def test_each_actor_writes_its_own_perf_report(
    cluster: None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "perf.log")
    monkeypatch.setenv("EMBSTORE_PERF_REPORT_PATH", path)
    monkeypatch.setenv("EMBSTORE_PERF_INTERVAL_MS", "100")
    rng = np.random.default_rng(17)
    with ShardedTableGroup(specs("sgd"), num_shards=2, backend="ray") as store:
        store.lookup_sum(batch(rng, weighted=False))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = [os.path.exists(f"{path}.shard-{k}") for k in range(2)]
            if all(done):
                break
            time.sleep(0.2)
        for k in range(2):
            with open(f"{path}.shard-{k}") as f:
                assert "name=group.lookup_sum" in f.read()
    assert not os.path.exists(path)


def test_restore_waits_for_applies_sent_without_waiting(cluster: None, tmp_path: Any) -> None:
    """An apply sent with wait=False before restore() is waited for first: its handle then
    returns, and the restored store keeps working (the old graph is not read after)."""
    rng = np.random.default_rng(17)
    with ShardedTableGroup(specs("sgd"), num_shards=2, backend="ray") as store:
        feats = batch(rng, weighted=False)
        store.lookup_sum(feats)
        store.save(tmp_path)
        store.lookup_sum(feats)
        handle = store.apply_gradients(grads_of(rng, feats, DIMS), wait=False)
        assert handle is not None
        store.restore(tmp_path)
        handle.wait()
        out = store.lookup_sum(feats, insert=False)
        assert out["user"].shape == (feats["user"][1].shape[0] - 1, 5)
        assert all(h["alive"] for h in store.health())


def test_health_counts_from_the_checkpoint_a_restart_reloads(cluster: None, tmp_path: Any) -> None:
    """restore="checkpoint": last_checkpoint is the step committed in checkpoint_dir (what a
    restarted shard reloads), for every shard alike; a save elsewhere does not move it; a
    restarted shard runs at the client's step from its next call."""
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    with ShardedTableGroup(
        specs("sgd"), num_shards=2, backend="ray", restore="checkpoint", checkpoint_dir=str(ckpt)
    ) as store:
        store.set_step(3)
        store.save(ckpt)
        store.set_step(6)
        _kill_and_wait_replaced(store._backend.actors[0])
        assert [(h["last_checkpoint"], h["lost_steps"]) for h in store.health()] == [(3, 3)] * 2
        ids = np.arange(1, 201, dtype=np.uint64)
        store.lookup_sum({"user": (ids, np.arange(201))})  # every row used at step 6
        removed = store.evict(older_than=6)
        assert removed["user"]["ids"].shape[0] == 0
        store.set_step(10)
        store.save(ckpt)
        store.set_step(12)
        store.save(other)
        assert [(h["last_checkpoint"], h["lost_steps"]) for h in store.health()] == [(10, 2)] * 2


def test_a_checkpoint_that_does_not_load_raises_at_load_and_restore(
    cluster: None, tmp_path: Any
) -> None:
    """A corrupt shard file raises CheckpointError from load() and restore(), as on the
    local backend, not ShardLostError at some later call; a good restore then recovers."""
    rng = np.random.default_rng(18)
    good, bad = tmp_path / "good", tmp_path / "bad"
    feats = batch(rng, weighted=False)
    with ShardedTableGroup(specs("sgd"), num_shards=2, backend="local") as local:
        local.lookup_sum(feats)
        local.save(good)
        local.save(bad)
    victim = next(p for p in sorted(bad.glob("shard-00001*/*")) if p.is_file())
    with open(victim, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)
    with pytest.raises(embstore.CheckpointError):
        ShardedTableGroup.load(bad, backend="ray")
    with ShardedTableGroup.load(good, backend="ray") as store:
        with pytest.raises(embstore.CheckpointError):
            store.restore(bad)
        with pytest.raises(ShardLostError):  # no shard left until a restore succeeds
            store.lookup_sum(feats)
        store.restore(good)
        out = store.lookup_sum(feats, insert=False, exact=True)
        with ShardedTableGroup.load(good, backend="local") as ref:
            want = ref.lookup_sum(feats, insert=False, exact=True)
        for n in want:
            np.testing.assert_array_equal(out[n], want[n])


def test_transport_bench_answers_as_the_shards_do(cluster: None) -> None:
    """bench/sharded.py's (t) bounds (c) by Ray's transport alone only if it moves (c)'s
    messages: for the same routed requests, its echo actors answer partial sums of the
    shapes the shards themselves return (every bag at L=4, a shard's own bags at L=1)."""
    import importlib.util
    import sys
    from pathlib import Path

    from embstore.bench import make_tables, make_workload
    from embstore.ray import TableSpec

    path = Path(__file__).resolve().parents[1] / "bench" / "ray_transport.py"
    spec = importlib.util.spec_from_file_location("ray_transport", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_transport"] = module  # the actors get its classes by value
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    for pooling in (1, 4):
        w = make_workload(
            num_tables=2,
            universe=5000,
            batch_size=64,
            pooling=pooling,
            dim=8,
            num_batches=2,
            tables=make_tables(2, 5000),
        )
        sp = {f"t{t.index}": TableSpec(dim=8, capacity=5000) for t in w.tables}
        transport = module.Transport(w)
        try:
            echoed = transport.step(1)
            lookups, _ = transport.requests(1)
        finally:
            transport.close()
        with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
            for shard, (_, args) in enumerate(lookups):
                outs, _ = store._backend.servers[shard].lookup(args[0], args[1], True, False)
                assert echoed[shard] == {n: a.shape for n, a in outs.items()}
                bags = {a.shape[0] for a in outs.values()}
                if pooling == 4:
                    assert bags == {64}
                else:
                    assert max(bags) < 64
