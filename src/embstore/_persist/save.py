"""Saving: a begun core snapshot streamed into a checkpoint file; save, save_delta and
group saves (one file per table, then the manifest)."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

from embstore import _core
from embstore._internals import TableInternals
from embstore._persist import buffers
from embstore._persist.buffers import MODE_DELTA, MODE_FULL, Buffers
from embstore._persist.header import header
from embstore._persist.manifest import FILE_RE, GROUP_FORMAT, MANIFEST, TMP_RE, seal
from embstore.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointWriter,
    new_checkpoint_id,
    write_atomic,
)

_Work = tuple[Any, ...] | None


def _write_sections(
    w: CheckpointWriter,
    work: queue.Queue[_Work],
    free: queue.Queue[Buffers],
    failure: list[BaseException],
) -> None:
    """The writer thread: writes each queued chunk, recycles its buffers, keeps the first
    error for the calling thread."""
    while True:
        item = work.get()
        if item is None:
            return
        try:
            if not failure:
                if item[0] == "rows":
                    _, shard, buf, n, crcs = item
                    w.section("ids", buf.ids[:n], shard, crcs[0])
                    w.section("rows", buf.rows[:n], shard, crcs[1])
                    w.section("last_step", buf.steps[:n], shard, crcs[2])
                else:
                    _, name, shard, arr = item
                    w.section(name, arr, shard)
        except BaseException as e:  # noqa: BLE001  (re-raised by the calling thread)
            failure.append(e)
        finally:
            if item[0] == "rows":
                free.put(item[2])


def write_snapshot(
    t: TableInternals,
    snap: _core.Snapshot,
    path: str | os.PathLike[str],
    kind: str,
    ckpt_id: str,
    parent: str | None,
) -> dict[str, Any]:
    """Streams a begun snapshot into a checkpoint file at ``path`` (atomically). Returns
    the header. The snapshot is neither committed nor aborted here.

    Two chunk buffers alternate: the calling thread copies chunk k+1 out of the table (C++,
    GIL released) while a writer thread checksums and writes chunk k (zlib and os.write
    release the GIL too), so copy and I/O overlap on two cores.
    """
    head = header(t, kind, ckpt_id, parent, snap)
    width = int(snap.row_width)
    cap = buffers.chunk_rows(width)
    admission = t.spec.admission is not None and t.spec.admission.min_count > 1
    with CheckpointWriter(path, head) as w:
        free: queue.Queue[Buffers] = queue.Queue()
        for _ in range(2):
            free.put(Buffers(cap, width))
        work: queue.Queue[_Work] = queue.Queue()
        failure: list[BaseException] = []
        thread = threading.Thread(
            target=_write_sections,
            args=(w, work, free, failure),
            name="embstore-checkpoint-writer",
            daemon=True,
        )
        thread.start()
        try:
            for s in range(int(snap.num_shards)):
                while not snap.done(s) and not failure:
                    buf = free.get()
                    n = int(snap.next(s, buf.ids, buf.rows, buf.steps))
                    buffers.after_chunk()
                    if n:  # checksums here, writes there: the two threads share the work
                        crcs = [buffers.crc32(a[:n]) for a in (buf.ids, buf.rows, buf.steps)]
                        work.put(("rows", s, buf, n, crcs))
                    else:
                        free.put(buf)
                if failure:
                    break
                if kind == "delta":
                    removed = snap.removed(s)
                    if removed.shape[0]:
                        work.put(("other", "removed", s, removed))
                if admission:
                    work.put(("other", "sketch", s, snap.sketch(s)))
        finally:
            work.put(None)
            thread.join()
        if failure:
            raise failure[0]
        w.finish()
    return head


def _make_parent_directory(path: str) -> None:
    """Creates the directory a checkpoint file goes into, as a group save does."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)


def save(t: TableInternals, path: str | os.PathLike[str], *, delta: bool) -> str:
    """``Table.save`` / ``Table.save_delta``: returns the new checkpoint id."""
    impl = t.live()
    path = os.fspath(path)
    if delta and t.checkpoint_id is None:
        msg = (
            f"{path}: save_delta needs a previous checkpoint of this table: call save() first "
            "(a table starts a chain with save() or by being loaded from a checkpoint)"
        )
        raise CheckpointError(msg)
    _make_parent_directory(path)
    snap = _core.begin_snapshot(impl, MODE_DELTA if delta else MODE_FULL)
    try:
        with t.checkpoint_lock:  # the parent as of this snapshot (saves are serial)
            parent = t.checkpoint_id if delta else None
        if delta and parent is None:
            msg = f"{path}: save_delta needs a previous checkpoint of this table"
            raise CheckpointError(msg)
        ckpt_id = new_checkpoint_id()
        write_snapshot(t, snap, path, "delta" if delta else "full", ckpt_id, parent)
        with t.checkpoint_lock:
            snap.commit()
            t.checkpoint_id = ckpt_id
    except BaseException:
        snap.abort()
        raise
    return ckpt_id


def _write_manifest(directory: str, entries: dict[str, Any], names: list[str]) -> None:
    body = {
        "format": GROUP_FORMAT,
        "version": FORMAT_VERSION,
        "created_unix": time.time(),
        "tables": entries,
        "order": names,
    }
    write_atomic(os.path.join(directory, MANIFEST), seal(body))


def _remove_stale_files(directory: str, keep_files: set[str]) -> None:
    for fname in os.listdir(directory):
        if (FILE_RE.match(fname) and fname not in keep_files) or TMP_RE.match(fname):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, fname))


def save_group(tables: Mapping[str, TableInternals], directory: str | os.PathLike[str]) -> None:
    """``TableGroup.save``: one checkpoint file per table and a manifest, written last
    (atomically): the manifest names the files, so a crash before it is renamed leaves the
    previous group checkpoint whole. Unreferenced files of older saves are removed after."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    names = list(tables)
    internals = [tables[n] for n in names]
    impls = [t.live() for t in internals]
    snaps: list[_core.Snapshot] = []
    try:
        for impl in impls:  # begun back to back: the tables' instants are microseconds apart
            snaps.append(_core.begin_snapshot(impl, MODE_FULL))
        entries: dict[str, Any] = {}
        ids: list[str] = []
        for k, (name, t, snap) in enumerate(zip(names, internals, snaps, strict=True)):
            ckpt_id = new_checkpoint_id()
            fname = f"t{k:03d}-{ckpt_id[:12]}.ckpt"
            write_snapshot(t, snap, os.path.join(directory, fname), "full", ckpt_id, None)
            entries[name] = {"file": fname, "checkpoint_id": ckpt_id}
            ids.append(ckpt_id)
        _write_manifest(directory, entries, names)
        for t, snap, ckpt_id in zip(internals, snaps, ids, strict=True):
            with t.checkpoint_lock:
                snap.commit()
                t.checkpoint_id = ckpt_id
    except BaseException:
        for snap in snaps:
            snap.abort()
        raise
    _remove_stale_files(directory, {e["file"] for e in entries.values()})
