"""pytest-benchmark microbenchmarks of checkpoints: save, save_delta and load of one warm
table (``UNIVERSE`` ids, D=32, Adagrad) in a temporary directory. Each case checks the file
it wrote against the table once (``checkpoint.read`` equals ``export``). The W1-size
measurement (8 x 1M rows, GB/s, peak memory) is ``bench/checkpoint.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import embstore
from embstore import checkpoint
from embstore.bench import make_tables

UNIVERSE = 20_000
DIM = 32

_TABLE = make_tables(1, UNIVERSE)[0]


@pytest.fixture(scope="module")
def table() -> embstore.Table:
    t = embstore.Table(
        dim=DIM, capacity=UNIVERSE, optimizer=embstore.Adagrad(lr=0.01), num_threads=1
    )
    t.lookup(_TABLE.warm_ids)
    t.apply_gradients(_TABLE.warm_ids[::3], np.ones((len(_TABLE.warm_ids[::3]), DIM), np.float32))
    return t


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    oa, ob = np.argsort(a["ids"]), np.argsort(b["ids"])
    return all(np.array_equal(a[k][oa], b[k][ob]) for k in b if k != "removed")


@pytest.mark.benchmark(group="checkpoint")
def test_save(benchmark: Any, table: embstore.Table, tmp_path: Path) -> None:
    path = tmp_path / "t.ckpt"
    benchmark(table.save, path)
    assert _same(checkpoint.read(path), table.export())
    benchmark.extra_info["bytes"] = path.stat().st_size


@pytest.mark.benchmark(group="checkpoint")
def test_save_delta(benchmark: Any, table: embstore.Table, tmp_path: Path) -> None:
    table.save(tmp_path / "base")
    keys = _TABLE.warm_ids[:500]
    grads = np.full((500, DIM), 0.5, np.float32)

    def step_and_delta() -> None:
        table.apply_gradients(keys, grads)
        table.save_delta(tmp_path / "d")

    benchmark(step_and_delta)
    assert checkpoint.read_header(tmp_path / "d")["rows"] == 500


@pytest.mark.benchmark(group="checkpoint")
def test_load(benchmark: Any, table: embstore.Table, tmp_path: Path) -> None:
    path = tmp_path / "t.ckpt"
    table.save(path)
    loaded = benchmark(embstore.Table.load, path)
    assert _same(loaded.export(), table.export())
