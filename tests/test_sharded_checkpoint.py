"""Sharded checkpoints: one directory, one TableGroup checkpoint per shard, a manifest
committed last; loading with any shard count re-routes rows bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_sharded import assert_same_rows, batch, grads_of, in_process, specs, train

import embstore
from embstore import _sharded as _reshard
from embstore.ray import ShardedTableGroup


def _trained(
    shards: int, opt: str, steps: int, seed: int
) -> tuple[ShardedTableGroup, embstore.TableGroup, np.random.Generator]:
    rng = np.random.default_rng(seed)
    sp = specs(opt)
    store = ShardedTableGroup(sp, num_shards=shards, backend="local")
    group = in_process(sp)
    train(store, group, rng, steps, "sum", weighted=False)
    return store, group, rng


@pytest.mark.parametrize("saved", [1, 2, 3])
@pytest.mark.parametrize("loaded", [1, 2, 3])
def test_round_trip_n_to_m_is_bit_exact(
    tmp_path: os.PathLike[str], saved: int, loaded: int
) -> None:
    store, group, rng = _trained(saved, "adam", 4, saved * 10 + loaded)
    store.save(tmp_path)
    store.close()
    with ShardedTableGroup.load(tmp_path, num_shards=loaded, backend="local") as back:
        assert back.num_shards == loaded
        assert back.names == ["user", "item"]
        assert_same_rows(back, group)
        train(back, group, rng, 2, "mean", weighted=True)  # optimizer state and steps too
        assert_same_rows(back, group)


def test_many_chunks_are_streamed_and_rerouted(tmp_path: os.PathLike[str]) -> None:
    sp = {"big": embstore.ray.TableSpec(dim=4, capacity=40_000, optimizer=embstore.Adagrad(lr=0.1))}
    group = in_process(sp)
    keys = np.arange(0, 3 * 25_000, 3, dtype=np.uint64)  # several 4 MiB... chunks of rows
    off = np.arange(keys.shape[0] + 1, dtype=np.int64)
    g = np.ones((keys.shape[0], 4), np.float32)
    with ShardedTableGroup(sp, num_shards=2, backend="local") as store:
        for s in (store, group):
            s.lookup_sum({"big": (keys, off)})
            s.apply_gradients({"big": (keys, off, g)})
        store.save(tmp_path)
    with ShardedTableGroup.load(tmp_path, num_shards=3, backend="local") as back:
        assert_same_rows(back, group)
        rows = [h["rows"]["big"] for h in back.health()]
        assert sum(rows) == keys.shape[0]
        assert min(rows) > keys.shape[0] / 3 * 0.95


def test_table_group_load_sharded_merges_every_shard(tmp_path: os.PathLike[str]) -> None:
    store, group, _ = _trained(3, "ftrl", 3, 1)
    store.save(tmp_path)
    store.close()
    merged = embstore.TableGroup.load_sharded(tmp_path)
    assert merged.names == ["user", "item"]
    for name in group:
        assert merged[name].capacity == group[name].capacity
        got, want = merged[name].export(), group[name].export()
        o1, o2 = np.argsort(got["ids"]), np.argsort(want["ids"])
        for k in want:
            np.testing.assert_array_equal(got[k][o1], want[k][o2])


def test_plain_table_group_checkpoint_loads_sharded(tmp_path: os.PathLike[str]) -> None:
    rng = np.random.default_rng(8)
    sp = specs("rowwise")
    group = in_process(sp)
    with ShardedTableGroup(sp, num_shards=1, backend="local") as other:
        train(other, group, rng, 3, "sum", weighted=True)
    group.save(tmp_path)
    with ShardedTableGroup.load(tmp_path, num_shards=2, backend="local") as back:
        assert_same_rows(back, group)
        train(back, group, rng, 2, "sum", weighted=False)
        assert_same_rows(back, group)


def test_crash_before_the_manifest_keeps_the_previous_checkpoint(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, group, rng = _trained(2, "sgd", 2, 3)
    store.save(tmp_path)
    before = {n: group[n].export() for n in group}
    train(store, group, rng, 2, "sum", weighted=False)

    def crash(path: str, data: bytes) -> None:
        raise OSError("injected: the process died before the manifest was renamed")

    monkeypatch.setattr(_reshard, "write_atomic", crash)
    with pytest.raises(OSError, match="injected"):
        store.save(tmp_path)
    monkeypatch.undo()
    shard_dirs = [d for d in os.listdir(tmp_path) if d.startswith("shard-")]
    assert len(shard_dirs) == 4  # the failed save's shards were written
    snapshot = in_process(specs("sgd"))
    for n, e in before.items():
        snapshot[n].import_(e)
    with ShardedTableGroup.load(tmp_path, num_shards=2, backend="local") as back:
        assert_same_rows(back, snapshot)
    store.save(tmp_path)  # the next commit removes the uncommitted directories
    assert len([d for d in os.listdir(tmp_path) if d.startswith("shard-")]) == 2
    with ShardedTableGroup.load(tmp_path, backend="local") as back:
        assert_same_rows(back, group)
    store.close()


def test_restore_rolls_every_shard_back(tmp_path: os.PathLike[str]) -> None:
    store, group, rng = _trained(2, "adagrad", 2, 4)
    store.set_step(7)
    store.save(tmp_path)
    saved = {n: group[n].export() for n in group}
    train(store, group, rng, 2, "sum", weighted=False)
    store.restore(tmp_path)
    snapshot = in_process(specs("adagrad"))
    for n, e in saved.items():
        snapshot[n].import_(e)
    assert_same_rows(store, snapshot)
    assert all(h["last_checkpoint"] == 7 for h in store.health())
    store.close()


def test_manifest_records_the_route(tmp_path: os.PathLike[str]) -> None:
    store, _, _ = _trained(3, "sgd", 1, 5)
    store.save(tmp_path)
    store.close()
    source = _reshard.open_source(tmp_path)
    assert source.num_shards == 3
    assert source.salt == _reshard.SALT
    with open(os.path.join(tmp_path, "MANIFEST.json")) as f:
        text = f.read()
    assert _reshard.ROUTE in text
    assert f"{_reshard.SALT:#018x}" in text


@pytest.mark.parametrize("loaded", [2, 3])
def test_save_delta_chains_load_bit_exact(tmp_path: os.PathLike[str], loaded: int) -> None:
    store, group, rng = _trained(2, "adam", 2, 20 + loaded)
    with pytest.raises(embstore.CheckpointError, match="save_delta needs"):
        store.save_delta(tmp_path)
    store.save(tmp_path)
    train(store, group, rng, 2, "sum", weighted=True)
    store.save_delta(tmp_path)
    store.set_step(10)
    group.set_step(10)
    train(store, group, rng, 1, "mean", weighted=False)
    store.evict(older_than=3)  # removed ids go into the next delta
    for n in group:
        group[n].evict(older_than=3)
    store.save_delta(tmp_path)
    store.close()
    with ShardedTableGroup.load(tmp_path, num_shards=loaded, backend="local") as back:
        assert_same_rows(back, group)
        if loaded == 2:  # the chain continues in the same directory
            train(back, group, rng, 1, "sum", weighted=False)
            back.save_delta(tmp_path)
    if loaded == 2:
        with ShardedTableGroup.load(tmp_path, backend="local") as again:
            assert_same_rows(again, group)
    merged = embstore.TableGroup.load_sharded(tmp_path)
    for name in group:
        got, want = merged[name].export(), group[name].export()
        np.testing.assert_array_equal(np.sort(got["ids"]), np.sort(want["ids"]))


def test_save_delta_refuses_a_checkpoint_another_store_replaced(
    tmp_path: os.PathLike[str],
) -> None:
    """A delta continues only the checkpoint this store committed: once another store has
    saved into the directory, save_delta raises and that store's checkpoint stays whole."""
    a, _, rng = _trained(2, "sgd", 2, 31)
    b, b_group, _ = _trained(3, "sgd", 2, 32)
    a.save(tmp_path)
    b.save(tmp_path)
    feats = batch(rng, weighted=False)
    a.lookup_sum(feats)
    a.apply_gradients(grads_of(rng, feats, {"user": 5, "item": 3}))
    with pytest.raises(embstore.CheckpointError, match="no longer this store's last"):
        a.save_delta(tmp_path)
    with ShardedTableGroup.load(tmp_path, num_shards=2, backend="local") as back:
        assert_same_rows(back, b_group)
    b.save_delta(tmp_path)  # its own chain goes on
    a.close()
    b.close()


def test_save_delta_continues_a_checkpoint_loaded_by_a_relative_path(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store, group, rng = _trained(2, "adagrad", 2, 33)
    store.save("ck")
    store.close()
    with ShardedTableGroup.load("ck", backend="local") as back:
        train(back, group, rng, 1, "sum", weighted=False)
        back.save_delta("ck")
        back.restore("ck")
        assert_same_rows(back, group)
        back.save_delta("ck")
