"""Chunk buffers shared by export and the sharded store's streamed reader."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: Bytes of rows copied out (or read) per chunk.
CHUNK_BYTES = 4 << 20
MIN_CHUNK_ROWS = 1024
#: The export mode of ``_core.begin_snapshot``.
MODE_EXPORT = 2
#: Test seam: called after each chunk an export copies out (tests slow exports down).
chunk_hook: Callable[[], object] | None = None


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
