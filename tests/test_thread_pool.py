"""The worker pool's waits: spinning before sleeping changes timing, never results.

Helpers that finish a job poll for the next one for ``EMBSTORE_SPIN_US`` microseconds
(default 200) before they sleep, a caller polls for its helpers, and a batch call wakes
sleeping helpers while it validates (csrc/embstore/thread_pool.hpp). These tests run the
same multi-threaded training sequence with spinning off, with helpers that never get to
sleep (calls back to back), and with helpers asleep between calls (woken ahead of each
batch), and require the same bits; and they pin how the environment variable is read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import Config, pool_spin, random_offsets, u64
from reference import AdagradSpec, NormalSpec

import embstore
from embstore import _core

DEFAULT_SPIN_US = 200
MAX_SPIN_US = 100_000


def _train(spin_us: int, pause_s: float) -> list[np.ndarray]:
    """Pooled training lookups (inserting, evicting) and applies over two 2-thread tables,
    big enough that every call uses a helper; every output, then every row. One shard per
    table: which ids a full multi-shard table keeps may depend on timing (semantics.md)."""
    cfg = Config(
        dim=16,
        capacity=6000,  # smaller than the universe: inserts evict
        optimizer=AdagradSpec(lr=0.05),
        initializer=NormalSpec(std=0.1, seed=5),
        num_shards=1,
        num_threads=2,
    )
    tables = {"a": cfg.table(), "b": cfg.table()}
    group = embstore.TableGroup(tables)
    rng = np.random.default_rng(11)
    universe = u64(rng.choice(1 << 40, size=30000, replace=False))
    outs: list[np.ndarray] = []
    with pool_spin(spin_us):
        for _ in range(6):
            feats = {}
            for name in tables:
                keys = universe[rng.zipf(1.05, 6000) % universe.shape[0]]
                feats[name] = (keys, random_offsets(rng, keys.shape[0], 1500))
            pooled = group.lookup_sum(feats)
            outs.extend(pooled[name] for name in tables)
            time.sleep(pause_s)
            grads = {
                name: (k, off, rng.normal(size=(off.shape[0] - 1, 16)).astype(np.float32))
                for name, (k, off) in feats.items()
            }
            group.apply_gradients(grads)
            time.sleep(pause_s)
    for t in tables.values():
        assert t.stats()["evictions"] > 0
        outs.append(t.lookup(universe, insert=False))
    return outs


def test_spinning_and_sleeping_waits_give_the_same_bits() -> None:
    never = _train(spin_us=0, pause_s=0.0)
    for spin_us, pause_s in ((DEFAULT_SPIN_US, 0.0), (DEFAULT_SPIN_US, 0.002), (50, 0.0)):
        got = _train(spin_us=spin_us, pause_s=pause_s)
        assert len(got) == len(never)
        for a, b in zip(never, got, strict=True):
            assert a.tobytes() == b.tobytes(), (spin_us, pause_s)


def test_set_pool_spin_us_caps_the_spin() -> None:
    with pool_spin(10**9):
        assert _core.pool_spin_us() == MAX_SPIN_US
    with pool_spin(0):
        assert _core.pool_spin_us() == 0


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, DEFAULT_SPIN_US),
        ("0", 0),
        ("35", 35),
        ("999999999", MAX_SPIN_US),
        ("", DEFAULT_SPIN_US),
        ("-5", DEFAULT_SPIN_US),
        ("12us", DEFAULT_SPIN_US),
    ],
)
def test_environment_variable_sets_the_spin(value: str | None, want: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "EMBSTORE_SPIN_US"}
    if value is not None:
        env["EMBSTORE_SPIN_US"] = value
    code = "from embstore import _core; print(_core.pool_spin_us())"
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == want


def test_parallel_validation_reports_the_first_bad_table_and_changes_nothing() -> None:
    """Validation runs on the pool, one table per task; the error is the first bad table's
    (in the call's order) whichever thread found which, and no table changed."""
    tables = {name: embstore.Table(dim=4, capacity=100_000, num_threads=2) for name in "abcd"}
    group = embstore.TableGroup(tables)
    keys = np.arange(6000, dtype=np.uint64)
    offsets = np.arange(6001, dtype=np.int64)
    grads = {n: (keys, offsets, np.zeros((6000, 4), np.float32)) for n in tables}
    grads["b"][2][5, 1] = np.nan
    grads["d"][2][7, 1] = np.inf
    for _ in range(20):
        with pytest.raises(ValueError, match=r"table 'b': grads must be finite: element 21"):
            group.apply_gradients(grads)
    feats = {n: (keys, offsets) for n in tables}
    feats["c"] = (keys, offsets[::-1].copy())
    feats["d"] = (keys, np.r_[offsets[:-1], 7000])
    for _ in range(20):
        with pytest.raises(ValueError, match=r"table 'c': offsets"):
            group.lookup_sum(feats)
    assert all(len(t) == 0 for t in tables.values())
