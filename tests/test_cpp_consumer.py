"""The C++ consumer (examples/cpp_consumer, built against the installed core with
-O3 -march=native -ffast-math) gets bitwise the results the Python package gets: its pooled
outputs for fixed batches and its final checkpoints equal a replay through embstore.

Runs when EMBSTORE_CPP_CONSUMER_OUT names the directory the consumer wrote
(.ci/cpp_consumer.sh sets it); skipped otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import checkpoint

OUT = os.environ.get("EMBSTORE_CPP_CONSUMER_OUT")
pytestmark = pytest.mark.skipif(
    not OUT, reason="EMBSTORE_CPP_CONSUMER_OUT is not set (run .ci/cpp_consumer.sh)"
)


def tables() -> list[embstore.Table]:
    """The consumer's two tables (user_config / item_config in main.cpp)."""
    user = embstore.Table(
        dim=32,
        capacity=100000,
        optimizer=embstore.Adagrad(lr=0.05),
        initializer=embstore.Normal(std=0.01, seed=1),
        name="user",
    )
    item = embstore.Table(
        dim=16,
        capacity=50000,
        optimizer=embstore.Adam(lr=0.01),
        initializer=embstore.Uniform(low=-0.05, high=0.05, seed=2),
        name="item",
    )
    return [user, item]


def test_consumer_results_are_the_python_package_results() -> None:
    assert OUT is not None
    out = Path(OUT)
    raw = (out / "golden.bin").read_bytes()
    steps, n, bags = np.frombuffer(raw[:12], np.uint32)
    pos = 12
    ts = tables()
    offsets = (np.arange(bags + 1, dtype=np.int64) * n) // bags
    for s in range(int(steps)):
        for t in ts:
            t.set_step(s + 1)
            keys = np.frombuffer(raw, np.uint64, int(n), pos)
            pos += int(n) * 8
            want = np.frombuffer(raw, np.float32, int(bags) * t.dim, pos).reshape(bags, t.dim)
            pos += int(bags) * t.dim * 4
            pooled = t.lookup_sum(keys, offsets)
            assert pooled.tobytes() == want.tobytes(), f"step {s}, table {t.name}"
            grads = ((np.arange(bags * t.dim) % 7 - 3) / 64).astype(np.float32)
            t.apply_gradients(keys, grads.reshape(bags, t.dim), offsets=offsets)
    assert pos == len(raw)
    for t in ts:
        got = checkpoint.read(out / f"{t.name}.ckpt")
        want_rows = t.export()
        order_g, order_w = np.argsort(got["ids"]), np.argsort(want_rows["ids"])
        assert set(got) == set(want_rows)
        for k in got:
            assert got[k][order_g].tobytes() == want_rows[k][order_w].tobytes(), k
        assert checkpoint.read_header(out / f"{t.name}.ckpt")["table"]["name"] == t.name
