"""Checkpoints while other threads keep training.

The guarantee under test (docs/checkpoint.md, "Consistency"): a checkpoint (and export) is
a point-in-time snapshot of the whole table. Every row has values and optimizer state of
the same moment, calls that returned before the save began are in it, calls that began
after it returned are not, and the rows of all shards are as of one instant (a call in
flight at that instant may be in it for some shards only).

The saves here are slowed down (tiny chunks, a sleep per section written) so that writers
make many calls while one is running: a per-shard copy without copy-on-write would then mix
rows of many different moments, which the checks below would catch.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import u64

import embstore
from embstore import checkpoint
from embstore._persist import buffers as _buffers

pytestmark = pytest.mark.slow

G = np.float32(0.5)  # every update's gradient element: acc grows by exactly 0.25 per update
LR = np.float32(0.1)
EPS = np.float32(1e-8)


@pytest.fixture
def slow_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 ms per chunk copied out (the core's save seam; export's chunks of 16 rows): a
    snapshot takes a while."""
    monkeypatch.setenv("EMBSTORE_CHECKPOINT_TEST_CHUNK_US", "1000")
    monkeypatch.setattr(_buffers, "CHUNK_BYTES", 16)
    monkeypatch.setattr(_buffers, "MIN_CHUNK_ROWS", 16)
    monkeypatch.setattr(_buffers, "chunk_hook", lambda: time.sleep(0.001))


def adagrad_trajectory(steps: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Weights and accumulators of a zero-initialised row after k = 0..steps updates with
    the constant gradient G (docs/semantics.md's float32 formula)."""
    w = np.zeros(dim, np.float32)
    acc = np.zeros(dim, np.float32)
    ws, accs = [w.copy()], [acc.copy()]
    g = np.full(dim, G, np.float32)
    for _ in range(steps):
        acc = acc + g * g
        w = w - (LR * g) / (np.sqrt(acc) + EPS)
        ws.append(w.copy())
        accs.append(acc.copy())
    return np.array(ws), np.array(accs)


class Writer(threading.Thread):
    """Applies the constant gradient to all of ``ids`` in one call, again and again."""

    def __init__(self, table: embstore.Table, ids: np.ndarray) -> None:
        super().__init__(daemon=True)
        self.table, self.ids = table, ids
        self.grads = np.full((ids.shape[0], table.dim), G, np.float32)
        self.started_calls = 0
        self.completed_calls = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.started_calls += 1
                self.table.apply_gradients(self.ids, self.grads)
                self.completed_calls += 1
        except BaseException as e:  # noqa: BLE001  (checked by the test)
            self.error = e

    def wait_calls(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while self.completed_calls < n and time.monotonic() < deadline:
            time.sleep(0.001)

    def finish(self) -> None:
        self.stop.set()
        self.join(60)
        assert self.error is None, self.error


def updates_per_row(
    rows: dict[str, np.ndarray], traj_w: np.ndarray, traj_acc: np.ndarray
) -> np.ndarray:
    """k for every row, after checking that its weights and accumulator are exactly those
    after k updates (values and optimizer state from the same moment)."""
    acc = rows["accumulator"]
    k = np.rint(acc[:, 0] / (G * G)).astype(np.int64)
    assert k.max() < traj_w.shape[0], "trajectory too short"
    assert np.array_equal(acc, traj_acc[k]), "accumulator is not k * g^2"
    bad = np.flatnonzero(np.any(rows["values"] != traj_w[k], axis=1))
    assert bad.size == 0, f"{bad.size} rows have weights of another update count than their state"
    return k


def table(num_shards: int, capacity: int = 50_000) -> embstore.Table:
    return embstore.Table(
        dim=4,
        capacity=capacity,
        num_shards=num_shards,
        optimizer=embstore.Adagrad(lr=float(LR), eps=float(EPS)),
        initializer=embstore.Zeros(),
        num_threads=2,
    )


@pytest.mark.parametrize("mode", ["save", "export"])
def test_snapshot_is_one_instant_across_shards(tmp_path: Path, slow_saves: None, mode: str) -> None:
    t = table(num_shards=16)
    ids = np.arange(4000, dtype=np.uint64)
    w = Writer(t, ids)
    w.start()
    try:
        w.wait_calls(3)
        before = w.completed_calls
        if mode == "save":
            t.save(tmp_path / "live.ckpt")
        else:
            exported = t.export()
        after = w.started_calls
        w.wait_calls(after + 1)
    finally:
        w.finish()
    rows = checkpoint.read(tmp_path / "live.ckpt") if mode == "save" else exported
    assert sorted(rows["ids"].tolist()) == ids.tolist()
    traj_w, traj_acc = adagrad_trajectory(w.completed_calls + 2, 4)
    k = updates_per_row(rows, traj_w, traj_acc)
    # One writer, one call at a time: at the snapshot's instant at most one call is in
    # flight, so every row has k or k + 1 updates; calls done before are in, calls begun
    # after are not.
    assert k.max() - k.min() <= 1, f"rows of {k.max() - k.min() + 1} different moments"
    assert k.min() >= before
    assert k.max() <= after
    # The writer really ran during the snapshot (the test would prove nothing otherwise).
    assert w.completed_calls - k.max() >= 3, "the writer made no progress during the save"


def test_several_writers_each_see_one_instant(tmp_path: Path, slow_saves: None) -> None:
    t = table(num_shards=8)
    groups = [np.arange(j, 6000, 3, dtype=np.uint64) for j in range(3)]
    writers = [Writer(t, g) for g in groups]
    for w in writers:
        w.start()
    try:
        for w in writers:
            w.wait_calls(2)
        t.save(tmp_path / "multi.ckpt")
        for w in writers:
            w.wait_calls(w.completed_calls + 2)
    finally:
        for w in writers:
            w.finish()
    rows = checkpoint.read(tmp_path / "multi.ckpt")
    traj_w, traj_acc = adagrad_trajectory(max(w.completed_calls for w in writers) + 2, 4)
    k = updates_per_row(rows, traj_w, traj_acc)
    by_id = dict(zip(rows["ids"].tolist(), k.tolist(), strict=True))
    for g in groups:
        ks = np.array([by_id[i] for i in g.tolist()])
        assert ks.max() - ks.min() <= 1


def test_delta_while_training_restores_one_instant(tmp_path: Path, slow_saves: None) -> None:
    t = table(num_shards=8)
    ids = np.arange(3000, dtype=np.uint64)
    t.apply_gradients(ids, np.full((3000, 4), G, np.float32))
    t.save(tmp_path / "base")
    w = Writer(t, ids[::2])  # half the rows change, the others stay at k = 1
    w.start()
    try:
        w.wait_calls(2)
        t.save_delta(tmp_path / "delta")
        w.wait_calls(w.completed_calls + 2)
    finally:
        w.finish()
    loaded = embstore.Table.load(tmp_path / "base", [tmp_path / "delta"])
    rows = loaded.export()
    traj_w, traj_acc = adagrad_trajectory(w.completed_calls + 3, 4)
    k = updates_per_row(rows, traj_w, traj_acc)
    by_id = dict(zip(rows["ids"].tolist(), k.tolist(), strict=True))
    changed = np.array([by_id[i] for i in ids[::2].tolist()])
    assert changed.max() - changed.min() <= 1
    assert changed.min() >= 3
    assert {by_id[i] for i in ids[1::2].tolist()} == {1}
    delta_ids = set(checkpoint.read(tmp_path / "delta")["ids"].tolist())
    assert delta_ids == set(ids[::2].tolist())
    # The rows written after the delta's instant are still dirty: the next delta has them.
    t.save_delta(tmp_path / "delta2")
    again = embstore.Table.load(tmp_path / "base", [tmp_path / "delta", tmp_path / "delta2"])
    e1, e2 = t.export(), again.export()
    o1, o2 = np.argsort(e1["ids"]), np.argsort(e2["ids"])
    for key in e1:
        assert np.array_equal(e1[key][o1], e2[key][o2]), key


def scripted_ops(rng: np.random.Generator, n: int, universe: int) -> list[tuple[Any, ...]]:
    """A deterministic list of single-shard operations with inserts, CLOCK evictions,
    erases, step changes, evict(older_than) and imports."""
    ops: list[tuple[Any, ...]] = []
    for k in range(n):
        r = rng.random()
        keys = rng.integers(0, universe, size=int(rng.integers(1, 40)))
        if r < 0.3:
            ops.append(("lookup", keys))
        elif r < 0.65:
            grads = rng.standard_normal((keys.shape[0], 4)).astype(np.float32)
            ops.append(("apply", keys, grads))
        elif r < 0.75:
            ops.append(("erase", keys))
        elif r < 0.85:
            ops.append(("step", k // 10))
        elif r < 0.9:
            ops.append(("evict", max(0, k // 10 - 30)))
        else:
            ids = np.unique(keys)
            vals = rng.standard_normal((ids.shape[0], 4)).astype(np.float32)
            ops.append(("import", ids, vals))
    return ops


def run_op(t: embstore.Table, op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "lookup":
        t.lookup(u64(op[1]))
    elif kind == "apply":
        t.apply_gradients(u64(op[1]), op[2])
    elif kind == "erase":
        t.erase(u64(op[1]))
    elif kind == "step":
        t.set_step(op[1])
    elif kind == "evict":
        t.evict(older_than=op[1])
    else:
        t.import_({"ids": op[1], "values": op[2]})


def one_shard_table() -> embstore.Table:
    return embstore.Table(
        dim=4,
        capacity=800,
        num_shards=1,
        optimizer=embstore.Adam(lr=0.01),
        initializer=embstore.Uniform(-0.1, 0.1, seed=3),
        num_threads=1,
    )


def content(rows: dict[str, np.ndarray]) -> bytes:
    """Order-independent digest of a table's rows."""
    order = np.argsort(rows["ids"], kind="stable")
    return b"".join(np.ascontiguousarray(rows[k][order]).tobytes() for k in sorted(rows))


def prefix_states(ops: list[tuple[Any, ...]], upto: int) -> list[bytes]:
    """The table's content after each prefix ops[:p], p = 0..upto (replayed; with one shard
    every operation is deterministic)."""
    t = one_shard_table()
    states = [content(t.export())]
    for op in ops[:upto]:
        run_op(t, op)
        states.append(content(t.export()))
    return states


@pytest.mark.parametrize("kind", ["save", "delta"])
def test_snapshot_equals_a_prefix_of_the_writers_operations(
    tmp_path: Path, slow_saves: None, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """One shard, so every operation is one critical section: the checkpoint must be
    exactly the table after some prefix of the operations, removals and inserts
    included (in this shard, the save is many chunks interleaved with the writer)."""
    rng = np.random.default_rng(5)
    ops = scripted_ops(rng, 3000, universe=1500)
    t = one_shard_table()
    pre = 200
    for op in ops[:pre]:
        run_op(t, op)
    t.save(tmp_path / "base")
    done = [pre]
    stop = threading.Event()

    def writer() -> None:
        for op in ops[pre:]:
            if stop.is_set():
                return
            run_op(t, op)
            done[0] += 1

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    while done[0] < pre + 20:
        time.sleep(0.001)
    start = done[0]
    if kind == "save":
        t.save(tmp_path / "snap")
        got = embstore.Table.load(tmp_path / "snap").export()
    else:
        t.save_delta(tmp_path / "snap")
        got = embstore.Table.load(tmp_path / "base", [tmp_path / "snap"]).export()
    end = done[0] + 1
    stop.set()
    th.join(60)
    assert done[0] - start > 10, "the writer made no progress during the save"
    monkeypatch.undo()  # the replay's exports at full speed
    states = prefix_states(ops, min(end, len(ops)))
    digest = content(got)
    matches = [p for p in range(start, len(states)) if states[p] == digest]
    assert matches, f"the checkpoint matches no state between op {start} and op {end}"


def test_concurrent_saves_of_one_table_form_a_chain(tmp_path: Path) -> None:
    t = table(num_shards=4, capacity=5000)
    ids = np.arange(2000, dtype=np.uint64)
    t.apply_gradients(ids, np.full((2000, 4), G, np.float32))
    t.save(tmp_path / "base")
    errors: list[BaseException] = []

    def saver(k: int) -> None:
        try:
            for j in range(5):
                t.apply_gradients(ids[k::4], np.full((500, 4), G, np.float32))
                t.save_delta(tmp_path / f"d{k}-{j}")
        except BaseException as e:  # noqa: BLE001  (checked by the test)
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    headers = {p: checkpoint.read_header(p) for p in tmp_path.iterdir() if p.name[0] == "d"}
    by_parent = {h["parent_id"]: p for p, h in headers.items()}
    chain = []
    cur = checkpoint.read_header(tmp_path / "base")["checkpoint_id"]
    while cur in by_parent:
        chain.append(by_parent[cur])
        cur = headers[by_parent[cur]]["checkpoint_id"]
    assert len(chain) == 20
    loaded = embstore.Table.load(tmp_path / "base", chain)
    e1, e2 = t.export(), loaded.export()
    o1, o2 = np.argsort(e1["ids"]), np.argsort(e2["ids"])
    for key in e1:
        assert np.array_equal(e1[key][o1], e2[key][o2]), key
