"""A forked child (a DataLoader worker, a multiprocessing 'fork' pool) can use tables it
inherited: the core's worker pool starts fresh helpers there instead of deadlocking on the
parent's (embstore/thread_pool.hpp)."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading

import numpy as np
import pytest

import embstore

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork start method")


def _pooled(t: embstore.Table) -> np.ndarray:
    keys = np.arange(50_000, dtype=np.uint64)  # large enough to use the helper threads
    return t.lookup_sum(keys, np.arange(0, 50_001, 5))


def _child(t: embstore.Table, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    queue.put(_pooled(t))


def test_forked_child_runs_batches_with_helpers() -> None:
    t = embstore.Table(dim=8, capacity=100_000, num_threads=2, initializer=embstore.Uniform())
    expected = _pooled(t)
    # Keep the pool busy from another thread while forking, so the fork can land anywhere.
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            _pooled(t)

    th = threading.Thread(target=busy)
    th.start()
    try:
        ctx = mp.get_context("fork")
        for _ in range(20):  # the hazard is timing-dependent: give it many chances
            queue = ctx.Queue()
            proc = ctx.Process(target=_child, args=(t, queue))
            proc.start()
            got = queue.get(timeout=60)
            proc.join(timeout=60)
            assert proc.exitcode == 0
            assert np.array_equal(got, expected)
    finally:
        stop.set()
        th.join()
    assert np.array_equal(_pooled(t), expected)  # the parent's pool still works
