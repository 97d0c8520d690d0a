"""Reading a checkpoint's row groups on a thread of its own, into pooled buffers."""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from typing import Any

import numpy as np

from embstore._persist.buffers import Buffers, chunk_rows
from embstore.checkpoint import CheckpointReader


class RowGroup:
    """A row group read from a file into pooled buffers; release() recycles them."""

    def __init__(self, buffers: Buffers, n: int, pool: queue.Queue[Buffers]) -> None:
        self.buffers = buffers
        self.n = n
        self._pool = pool

    def release(self) -> None:
        self._pool.put(self.buffers)


def _read_groups(
    r: CheckpointReader, width: int, pool: queue.Queue[Buffers], emit: Any, take: Any
) -> None:
    """Reads every section of ``r`` in order, checking each, and emits each row group (a
    RowGroup) and each sketch ((shard, counters)). Removed-id sections are only checked (the
    pre-pass applied them)."""
    scratch = np.empty(1 << 20, dtype=np.uint8)
    group: list[Any] = []
    buf: Buffers | None = None
    names = ("ids", "rows", "last_step")
    for sec in r.sections():
        if sec.name in names:
            n = sec.shape[0]
            if sec.name != names[len(group)] or (group and group[0].shape[0] != n):
                raise r.error(f"corrupted (section {sec.number} out of place)")
            if sec.name == "rows" and sec.shape[1] != width:
                raise r.error(
                    f"corrupted (section {sec.number} has rows of width {sec.shape[1]}, "
                    f"expected {width})"
                )
            if buf is None:
                buf = take()
                if buf.ids.shape[0] < n:  # a bigger chunk than this embstore writes
                    buf = Buffers(n, width)
            targets: dict[str, np.ndarray] = {
                "ids": buf.ids,
                "rows": buf.rows,
                "last_step": buf.steps,
            }
            target = targets[sec.name]
            r.read_payload(sec, target)
            group.append(sec)
            if len(group) == 3:
                emit(RowGroup(buf, n, pool))
                group, buf = [], None
        elif sec.name == "sketch":
            arr = r.read_payload(sec)
            if sec.shard is not None:
                emit((sec.shard, arr))
        else:
            r.skip_payload(sec, scratch)
    if group:
        raise r.error("corrupted (an incomplete row group)")


def prefetch_groups(r: CheckpointReader, width: int) -> Generator[Any, None, None]:
    """Yields what _read_groups emits, reading (and checksumming) in a thread of its own so
    that file reads overlap the caller's imports. Errors are re-raised in the caller."""
    cap = chunk_rows(width)
    pool: queue.Queue[Buffers] = queue.Queue()
    for _ in range(3):
        pool.put(Buffers(cap, width))
    out: queue.Queue[Any] = queue.Queue(maxsize=2)
    done = object()
    stop = threading.Event()
    failure: list[BaseException] = []

    def emit(item: Any) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise _Stopped

    def take() -> Buffers:
        while not stop.is_set():
            try:
                return pool.get(timeout=0.1)
            except queue.Empty:
                continue
        raise _Stopped

    def run() -> None:
        try:
            _read_groups(r, width, pool, emit, take)
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001  (re-raised by the caller)
            failure.append(e)
        while not stop.is_set():
            try:
                out.put(done, timeout=0.1)
                return
            except queue.Full:
                continue

    thread = threading.Thread(target=run, name="embstore-checkpoint-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = out.get()
            if item is done:
                break
            yield item
        if failure:
            raise failure[0]
    finally:
        stop.set()
        thread.join()


class _Stopped(Exception):
    """The consumer of prefetch_groups went away."""
