"""Checkpoints written and read by the C++ core (``_core.checkpoint_*``), against the Python
writer and the pure-numpy reader: every file the core writes reads with
``embstore.checkpoint.read`` and equals ``Table.export()`` at the save; every file the Python
writer writes (full, deltas, groups) loads in the core bit for bit, re-sharded too; bad files
raise ``embstore.CheckpointError``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import splitmix64_int

import embstore
from embstore import _core, checkpoint

OPTIMIZERS: list[Any] = [
    embstore.SGD(lr=0.5),
    embstore.SGD(lr=0.1, momentum=0.9),
    embstore.Adagrad(lr=0.1, eps=1e-6, initial_accumulator=0.1),
    embstore.RowWiseAdagrad(lr=0.1, initial_accumulator=0.05),
    embstore.Adam(lr=0.01, weight_decay=0.01),
    embstore.FTRL(alpha=0.1, beta=0.5, l1=0.01, l2=0.001),
]
INITIALIZERS: list[Any] = [
    embstore.Normal(std=0.1, seed=3),
    embstore.Uniform(low=-0.2, high=0.3, seed=2**64 - 5),
    embstore.TruncatedNormal(std=0.05, mean=0.1, seed=11),
    embstore.Zeros(),
]


def trained(
    rng: np.random.Generator,
    *,
    optimizer: Any = None,
    initializer: Any = None,
    admission: Any = None,
    num_shards: int = 4,
    steps: int = 6,
    universe: int = 3000,
) -> embstore.Table:
    t = embstore.Table(
        dim=8,
        capacity=8192,
        optimizer=optimizer or embstore.Adagrad(lr=0.05),
        initializer=initializer or embstore.Normal(std=0.1, seed=1),
        num_shards=num_shards,
        admission=admission,
    )
    train(t, rng, steps, universe)
    return t


def train(t: embstore.Table, rng: np.random.Generator, steps: int, universe: int) -> None:
    for _ in range(steps):
        t.set_step(t.step + 1)
        keys = rng.integers(0, universe, 256).astype(np.uint64) * np.uint64(2654435761)
        offsets = np.arange(0, 257, 8, dtype=np.int64)
        out = t.lookup_sum(keys, offsets)
        t.apply_gradients(keys, 0.1 * out + 0.01, offsets=offsets)


def core_rows(impl: _core.Table) -> dict[str, np.ndarray]:
    """Every row of a core table (ids, raw rows, last steps), sorted by id."""
    snap = _core.begin_snapshot(impl, 2)
    width = int(snap.row_width)
    ids, rows, steps = [], [], []
    bi = np.empty(1024, np.uint64)
    br = np.empty((1024, width), np.float32)
    bs = np.empty(1024, np.uint32)
    for s in range(int(snap.num_shards)):
        while not snap.done(s):
            n = int(snap.next(s, bi, br, bs))
            ids.append(bi[:n].copy())
            rows.append(br[:n].copy())
            steps.append(bs[:n].copy())
    snap.commit()
    i = np.concatenate(ids)
    order = np.argsort(i, kind="stable")
    return {
        "ids": i[order],
        "rows": np.concatenate(rows)[order],
        "steps": np.concatenate(steps)[order],
    }


def assert_same_core_rows(a: _core.Table, b: _core.Table) -> None:
    ra, rb = core_rows(a), core_rows(b)
    assert np.array_equal(ra["ids"], rb["ids"])
    assert ra["rows"].tobytes() == rb["rows"].tobytes()
    assert np.array_equal(ra["steps"], rb["steps"])


def sorted_arrays(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(d["ids"], kind="stable")
    return {k: v[order] for k, v in d.items() if k != "removed"}


def assert_same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    sa, sb = sorted_arrays(a), sorted_arrays(b)
    assert set(sa) == set(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert sa[k].tobytes() == sb[k].tobytes(), k


def as_float32(x: Any) -> Any:
    """A header with every float rounded to float32 (the core keeps float32 settings)."""
    if isinstance(x, dict):
        return {k: as_float32(v) for k, v in x.items()}
    if isinstance(x, float):
        return float(np.float32(x))
    return x


@pytest.mark.parametrize("k", range(len(OPTIMIZERS)))
def test_core_files_read_with_the_numpy_reader(tmp_path: Path, k: int) -> None:
    rng = np.random.default_rng(k)
    admission = embstore.CountFilter(min_count=2, width=4096, depth=3) if k == 2 else None
    t = trained(rng, optimizer=OPTIMIZERS[k], initializer=INITIALIZERS[k % 4], admission=admission)
    t.set_lr(0.5 * embstore.optimizers.learning_rate(t.optimizer))
    core_file, py_file = tmp_path / "core.ckpt", tmp_path / "py.ckpt"
    cid = _core.checkpoint_save(t._internals().live(), str(core_file), name="user", num_threads=2)
    assert_same_arrays(checkpoint.read(core_file), t.export())
    t2 = embstore.Table.load(core_file)
    assert_same_arrays(t2.export(), t.export())
    assert t2.name == "user"
    assert t2.step == t.step
    assert t2.num_shards == t.num_shards
    # The header says what the Python writer's says (floats as the core's float32).
    state = t._internals()  # as if built with name="user", num_threads=2
    state.spec = dataclasses.replace(state.spec, name="user", num_threads=2)
    t.name = "user"
    t.save(py_file)
    hc, hp = checkpoint.read_header(core_file), checkpoint.read_header(py_file)
    assert hc["checkpoint_id"] == cid
    assert hc["kind"] == "full"
    assert hc["parent_id"] is None
    assert as_float32(hc["table"]) == as_float32(hp["table"])
    for key in ("format", "version", "row_width", "state_layout", "consistency", "rows"):
        assert hc[key] == hp[key], key
    if admission is not None:  # the sketch sections round trip
        t3 = embstore.Table.load(core_file)
        for s in range(t.num_shards):
            assert np.array_equal(
                t3._internals().live().sketch_counters(s), t._internals().live().sketch_counters(s)
            )


def test_python_chain_loads_in_the_core(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    t = trained(rng, optimizer=embstore.Adam(lr=0.01))
    files = [tmp_path / "base.ckpt"]
    t.save(files[0])
    for k in range(3):
        train(t, rng, 2, 5000)
        t.erase(np.arange(k * 10, k * 10 + 5, dtype=np.uint64) * np.uint64(2654435761))
        files.append(tmp_path / f"d{k}.ckpt")
        t.save_delta(files[-1])
    paths = [str(f) for f in files]
    got = _core.checkpoint_load(paths[0], paths[1:])
    assert_same_core_rows(got["table"], t._internals().live())
    assert got["checkpoint_id"] == checkpoint.read_header(files[-1])["checkpoint_id"]
    assert got["table"].step == t.step
    assert got["rows"] == len(t)
    # The core continues the chain it loaded; Python reads the result.
    _core.checkpoint_save(got["table"], str(tmp_path / "d3.ckpt"), delta=True)
    again = embstore.Table.load(files[0], deltas=[*files[1:], tmp_path / "d3.ckpt"])
    assert_same_core_rows(again._internals().live(), t._internals().live())


def test_core_chain_loads_in_python(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    t = trained(rng, optimizer=embstore.FTRL(alpha=0.1, l1=0.01))
    base = tmp_path / "base.ckpt"
    _core.checkpoint_save(t._internals().live(), str(base))
    deltas = []
    for k in range(3):
        train(t, rng, 2, 5000)
        t.erase(np.arange(k, k + 40, dtype=np.uint64) * np.uint64(2654435761))
        deltas.append(tmp_path / f"d{k}.ckpt")
        _core.checkpoint_save(t._internals().live(), str(deltas[-1]), delta=True)
        assert checkpoint.read_header(deltas[-1])["kind"] == "delta"
    got = embstore.Table.load(base, deltas=deltas)
    assert_same_arrays(got.export(), t.export())
    removed = np.concatenate([checkpoint.read(d)["removed"] for d in deltas])
    assert removed.shape[0] > 0


@pytest.mark.parametrize(
    ("capacity", "num_shards", "keep"),
    [(8192, 1, None), (20000, 16, None), (700, 2, "recent"), (700, None, "recent")],
)
def test_reshard_and_keep_recent_match_python(
    tmp_path: Path, capacity: int, num_shards: int | None, keep: str | None
) -> None:
    rng = np.random.default_rng(3)
    t = trained(rng, num_shards=8, steps=12)
    p = tmp_path / "t.ckpt"
    t.save(p)
    train(t, rng, 3, 3000)
    t.save_delta(tmp_path / "d.ckpt")
    for deltas in ([], [tmp_path / "d.ckpt"]):
        kw: dict[str, Any] = {"capacity": capacity}
        if num_shards is not None:
            kw["num_shards"] = num_shards
        want = embstore.Table.load(p, deltas=deltas, keep=keep, **kw)
        got = _core.checkpoint_load(
            str(p), [str(d) for d in deltas], keep_recent=keep == "recent", **kw
        )
        assert got["table"].num_shards == want.num_shards
        assert got["table"].capacity == capacity
        assert_same_core_rows(got["table"], want._internals().live())
        assert (got["checkpoint_id"] is None) == (want._internals().checkpoint_id is None)


def test_capacity_error(tmp_path: Path) -> None:
    t = trained(np.random.default_rng(4))
    t.save(tmp_path / "t.ckpt")
    with pytest.raises(embstore.CapacityError, match="more than capacity"):
        _core.checkpoint_load(str(tmp_path / "t.ckpt"), capacity=len(t) // 2)


def test_route_and_keep_route(tmp_path: Path) -> None:
    t = trained(np.random.default_rng(5))
    t.save(tmp_path / "t.ckpt")
    salt, n = 0x9E3779B97F4A7C15, 3
    ids = t.export()["ids"]
    want_route = np.array([(splitmix64_int(int(i) ^ salt) * n) >> 64 for i in ids], np.uint32)
    assert np.array_equal(_core.route(ids, salt, n), want_route)
    parts = []
    for k in range(n):
        got = _core.checkpoint_load(str(tmp_path / "t.ckpt"), keep_route=(salt, n, k), num_shards=2)
        rows = core_rows(got["table"])
        assert np.all(_core.route(rows["ids"], salt, n) == k)
        assert got["checkpoint_id"] is None
        assert got["dropped"] == len(t) - rows["ids"].shape[0]
        parts.append(rows)
    whole = core_rows(t._internals().live())
    ids_all = np.concatenate([p["ids"] for p in parts])
    order = np.argsort(ids_all)
    assert np.array_equal(ids_all[order], whole["ids"])
    assert np.concatenate([p["rows"] for p in parts])[order].tobytes() == whole["rows"].tobytes()


def test_groups_both_ways(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    g = embstore.TableGroup(
        {"user": trained(rng), "item": trained(rng, optimizer=embstore.SGD(lr=0.1))}
    )
    g.save(tmp_path / "py")
    got = _core.checkpoint_load_group(str(tmp_path / "py"))
    assert [name for name, _ in got] == g.names
    for name, d in got:
        assert_same_core_rows(d["table"], g[name]._internals().live())
        assert d["name"] == name
    _core.checkpoint_save_group(
        [(n, g[n]._internals().live()) for n in g.names], str(tmp_path / "core")
    )
    back = embstore.TableGroup.load(tmp_path / "core")
    assert back.names == g.names
    for name in g.names:
        assert_same_arrays(back[name].export(), g[name].export())


def test_bad_files_raise_checkpoint_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    t = trained(rng, steps=1, universe=20)
    good_path = tmp_path / "good.ckpt"
    t.save(good_path)
    good = good_path.read_bytes()
    bad = tmp_path / "bad.ckpt"
    for i in range(0, len(good), 5):
        b = bytearray(good)
        b[i] ^= 0x01
        bad.write_bytes(bytes(b))
        with pytest.raises(embstore.CheckpointError) as e:
            _core.checkpoint_load(str(bad))
        assert str(e.value).startswith(str(bad))
    for n in range(0, len(good), 11):
        bad.write_bytes(good[:n])
        with pytest.raises(embstore.CheckpointError):
            _core.checkpoint_load(str(bad))
    v2 = bytearray(good)
    v2[16] = 2
    v2[28:32] = (zlib.crc32(bytes(v2[:28])) & 0xFFFFFFFF).to_bytes(4, "little")
    bad.write_bytes(bytes(v2))
    with pytest.raises(embstore.CheckpointError, match="unsupported checkpoint format version 2"):
        _core.checkpoint_load(str(bad))
    with pytest.raises(FileNotFoundError):
        _core.checkpoint_load(str(tmp_path / "missing.ckpt"))
    fresh = trained(rng, steps=1, universe=20)  # never saved: no chain to follow
    with pytest.raises(embstore.CheckpointError, match="needs a previous checkpoint"):
        _core.checkpoint_save(fresh._internals().live(), str(tmp_path / "x.ckpt"), delta=True)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert _core.checkpoint_read_header(str(good_path)).startswith("{")


CRASH_CHILD = """
import sys, numpy as np, embstore
from embstore import _core
t = embstore.Table(dim=4, capacity=4096, num_shards=2, initializer=embstore.Uniform(-1, 1, seed=2))
t.lookup(np.arange(3000))
_core.checkpoint_save(t._internals().live(), sys.argv[1])
"""


@pytest.mark.parametrize("point", ["header", "section:1", "trailer", "fsync", "replace"])
def test_core_save_killed_leaves_the_previous_file(tmp_path: Path, point: str) -> None:
    """The core writer honours the Python writer's crash-test hook: killed at each point,
    the previous checkpoint stays at the path, whole."""
    t = trained(np.random.default_rng(8))
    path, marker = tmp_path / "t.ckpt", tmp_path / "marker"
    _core.checkpoint_save(t._internals().live(), str(path))
    before = path.read_bytes()
    env = dict(
        os.environ,
        EMBSTORE_CHECKPOINT_TEST_PAUSE=point,
        EMBSTORE_CHECKPOINT_TEST_MARKER=str(marker),
    )
    child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, str(path)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.read_text() == point
    finally:
        child.kill()
        child.wait()
    assert path.read_bytes() == before
    assert_same_arrays(checkpoint.read(path), t.export())


def test_core_headers_carry_num_threads_and_padding_id(tmp_path: Path) -> None:
    """Table and group saves (the core's) record what the facade needs back, and the
    pure-numpy reader sees it in the header."""
    a = embstore.Table(dim=2, capacity=64, num_threads=1, padding_id=2**64 - 1)
    b = embstore.Table(dim=3, capacity=64, padding_id=7)
    a.lookup(np.arange(5))
    b.lookup(np.arange(9))
    a.save(tmp_path / "a.ckpt")
    assert checkpoint.read_header(tmp_path / "a.ckpt")["table"]["padding_id"] == -1
    back = embstore.Table.load(tmp_path / "a.ckpt")
    assert back.padding_id == -1
    assert back.spec.padding_key == 2**64 - 1
    assert back.spec.num_threads == 1
    embstore.TableGroup({"a": a, "b": b}).save(tmp_path / "g")
    g = embstore.TableGroup.load(tmp_path / "g")
    assert g["a"].spec.num_threads == 1
    assert g["b"].spec.num_threads is None
    assert g["a"].padding_id == -1
    assert g["b"].padding_id == 7
    for name, t in (("a", a), ("b", b)):
        assert_same_arrays(g[name].export(), t.export())
