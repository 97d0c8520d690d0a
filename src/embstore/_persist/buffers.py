"""Chunk buffers shared by the snapshot writer, the loader and export."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

#: Bytes of rows copied out per chunk (one section group); the writer double-buffers.
CHUNK_BYTES = 4 << 20
MIN_CHUNK_ROWS = 1024
#: Snapshot modes of ``_core.begin_snapshot``.
MODE_FULL, MODE_DELTA, MODE_EXPORT = 0, 1, 2
#: Test seam: called after each chunk a snapshot copies out (tests slow snapshots down).
chunk_hook: Callable[[], object] | None = None


def crc32(a: np.ndarray) -> int:
    """The CRC-32 of an array's bytes."""
    return zlib.crc32(a.data.cast("B")) & 0xFFFFFFFF


def chunk_rows(width: int) -> int:
    """Rows per chunk for rows of ``width`` floats."""
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * width))


def after_chunk() -> None:
    """Runs the test seam, if set."""
    if chunk_hook is not None:
        chunk_hook()


class Buffers:
    """One chunk's worth of ids, rows and last steps (reused)."""

    def __init__(self, rows: int, width: int) -> None:
        self.ids = np.empty(rows, dtype=np.uint64)
        self.rows = np.empty((rows, width), dtype=np.float32)
        self.steps = np.empty(rows, dtype=np.uint32)
