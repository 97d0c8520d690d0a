"""Files written by the Python writer embstore used before the core wrote checkpoints
(tests/data/old_format, made by its make_files.py at commit 20d67ab) still load, through
the core, exactly as they were saved; the pure-numpy reader reads them too."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import checkpoint

DATA = Path(__file__).parent / "data" / "old_format"


def assert_same_export(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    order_got, order_want = np.argsort(got["ids"]), np.argsort(want["ids"])
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(got[k][order_got], want[k][order_want]), k


def test_an_old_chain_loads_with_its_settings() -> None:
    t = embstore.Table.load(DATA / "table.ckpt", [DATA / "table.1.ckpt"])
    want = dict(np.load(DATA / "table_export.npz"))
    assert_same_export(t.export(), want)
    meta = json.loads((DATA / "spec.json").read_text())
    assert len(t) == meta["len"]
    assert t.step == meta["step"]
    assert t.name == "old"
    assert t.num_shards == 4
    assert t.capacity == 512
    assert t.spec.num_threads == 2
    assert t.optimizer == embstore.Adam(lr=0.1 + 0.2, weight_decay=0.01)
    assert t.spec.initializer == embstore.Uniform(low=-0.1, high=0.1, seed=2**64 - 3)
    assert t.spec.admission == embstore.CountFilter(min_count=2, width=1024, depth=2)
    assert t.padding_id == 2**64 - 1  # saved as the uint64 2**64 - 1
    # The loaded table continues the old chain: a new delta follows the old delta.
    ids = np.arange(400, 410, dtype=np.uint64)
    t.lookup(ids)
    t.lookup(ids)  # admitted at the second sighting (the counters were restored)
    assert t.contains(ids).all()


def test_a_core_delta_follows_an_old_chain(tmp_path: Path) -> None:
    t = embstore.Table.load(DATA / "table.ckpt", [DATA / "table.1.ckpt"])
    gone = np.sort(t.export()["ids"])[:5]
    t.erase(gone)
    t.save_delta(tmp_path / "d2")
    assert sorted(checkpoint.read(tmp_path / "d2")["removed"].tolist()) == gone.tolist()
    u = embstore.Table.load(DATA / "table.ckpt", [DATA / "table.1.ckpt", tmp_path / "d2"])
    assert_same_export(u.export(), t.export())


@pytest.mark.parametrize("capacity", [512, 4096])
def test_an_old_file_reshards_on_load(capacity: int) -> None:
    t = embstore.Table.load(
        DATA / "table.ckpt", [DATA / "table.1.ckpt"], capacity=capacity, num_shards=1
    )
    assert t.num_shards == 1
    assert t.capacity == capacity
    assert_same_export(t.export(), dict(np.load(DATA / "table_export.npz")))


def test_an_old_group_loads() -> None:
    g = embstore.TableGroup.load(DATA / "group")
    want = np.load(DATA / "group_export.npz")
    assert g.names == ["a", "b"]
    for name in g.names:
        got = g[name].export()
        assert_same_export(got, {k: want[f"{name}.{k}"] for k in got})
    assert g["a"].spec.num_threads == 1
    assert g["a"].optimizer == embstore.SGD(lr=0.5)
    assert g["b"].padding_id == -1
    assert g["b"].optimizer == embstore.FTRL(alpha=0.1)
    assert pickle.loads(pickle.dumps(g["b"])).padding_id == -1


def test_the_numpy_reader_reads_the_old_files() -> None:
    base = checkpoint.read(DATA / "table.ckpt")
    assert base["ids"].shape[0] == base["values"].shape[0]
    assert checkpoint.read_header(DATA / "table.1.ckpt")["kind"] == "delta"
