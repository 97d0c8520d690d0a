"""Persistence of tables: save / save_delta / load, export / import_, and group checkpoints.

The file format and its reader live in :mod:`embstore.checkpoint` (no C++ needed there);
this module drives the C++ core's snapshots (``_core.begin_snapshot``: a point-in-time copy,
streamed shard by shard in bounded chunks while other threads keep training) and imports
(``import_rows``). Specification: ``docs/checkpoint.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import threading
import time
import zlib
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from embstore import _arrays, _core
from embstore.admission import CountFilter
from embstore.checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    new_checkpoint_id,
    write_atomic,
)
from embstore.initializers import Initializer, Normal, TruncatedNormal, Uniform, Zeros
from embstore.optimizers import FTRL, SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad

if TYPE_CHECKING:
    from embstore.group import TableGroup
    from embstore.table import Table

_OPTIMIZERS: dict[str, type[Any]] = {
    c.__name__: c for c in (SGD, Adagrad, RowWiseAdagrad, Adam, FTRL)
}
_INITIALIZERS: dict[str, type[Any]] = {
    c.__name__: c for c in (Zeros, Uniform, Normal, TruncatedNormal)
}
#: Keyword arguments of Table.load that may differ from the saved table.
LOAD_OVERRIDES = ("capacity", "num_shards", "num_threads", "name", "on_evict", "eviction")
#: Bytes of rows copied out per chunk (one section group); the writer double-buffers.
CHUNK_BYTES = 4 << 20
MIN_CHUNK_ROWS = 1024
_MODE_FULL, _MODE_DELTA, _MODE_EXPORT = 0, 1, 2
#: Test seam: called after each chunk a snapshot copies out (tests slow snapshots down).
_chunk_hook: Callable[[], object] | None = None

U64Array = npt.NDArray[np.uint64]


# --------------------------------------------------------------------------------------
# Configuration <-> header
# --------------------------------------------------------------------------------------


def _settings(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(obj).__name__}
    out.update(dataclasses.asdict(obj))
    return out


def table_config(table: Table, step: int, step_tracking: bool) -> dict[str, Any]:
    """The ``table`` entry of a checkpoint header."""
    adm = table.admission
    return {
        "name": table.name if table._name_given else None,  # None: an automatic name
        "dim": table.dim,
        "capacity": table.capacity,
        "num_shards": table.num_shards,
        "num_threads": table._num_threads_arg,
        "eviction": table.eviction,
        "optimizer": _settings(table.optimizer),
        "initializer": _settings(table.initializer),
        "admission": None if adm is None else _settings(adm),
        "step": step,
        "step_tracking": step_tracking,
    }


def _header(
    table: Table, kind: str, ckpt_id: str, parent: str | None, snap: _core.Snapshot
) -> dict[str, Any]:
    from embstore import __version__

    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "kind": kind,
        "checkpoint_id": ckpt_id,
        "parent_id": parent,
        "created_unix": time.time(),
        "embstore_version": __version__,
        "consistency": "point-in-time",
        "table": table_config(table, int(snap.step), bool(snap.step_tracking)),
        "row_width": int(snap.row_width),
        "state_layout": [list(e) for e in _layout(table)],
    }


def _layout(table: Table) -> list[tuple[str, int, str]]:
    from embstore.optimizers import state_layout

    return state_layout(table.optimizer, table.dim)


def _build(kind: str, spec: Any, registry: dict[str, type[Any]], r: CheckpointReader) -> Any:
    if not isinstance(spec, dict) or spec.get("type") not in registry:
        raise r._error(f"unknown {kind} in the header: {spec!r}")
    params = {k: v for k, v in spec.items() if k != "type"}
    try:
        return registry[spec["type"]](**params)
    except (TypeError, ValueError) as e:
        raise r._error(f"bad {kind} settings in the header: {e}") from None


class _Config:
    """A checked view of a checkpoint header's table configuration."""

    def __init__(self, r: CheckpointReader) -> None:
        h = r.header
        try:
            t = h["table"]
            self.name: str | None = t["name"]
            if self.name is not None and not isinstance(self.name, str):
                raise TypeError("name")
            self.dim = int(t["dim"])
            self.capacity = int(t["capacity"])
            self.num_shards = int(t["num_shards"])
            self.num_threads = None if t["num_threads"] is None else int(t["num_threads"])
            self.eviction = str(t["eviction"])
            self.step = int(t["step"])
            self.step_tracking = bool(t["step_tracking"])
            self.row_width = int(h["row_width"])
            self.layout = [(str(a), int(b), str(c)) for a, b, c in h["state_layout"]]
            self.optimizer: Optimizer = _build("optimizer", t["optimizer"], _OPTIMIZERS, r)
            self.initializer: Initializer = _build(
                "initializer", t["initializer"], _INITIALIZERS, r
            )
            adm = t["admission"]
            self.admission: CountFilter | None = (
                None if adm is None else _build("admission", adm, {"CountFilter": CountFilter}, r)
            )
        except (KeyError, TypeError, ValueError) as e:
            raise r._error(f"corrupted header (bad table configuration: {e!r})") from None
        from embstore.optimizers import state_layout

        if self.layout != state_layout(
            self.optimizer, self.dim
        ) or self.row_width != self.dim + sum(w for _, w, _ in self.layout):
            raise r._error("corrupted header (state layout does not match the optimizer)")
        if h.get("kind") not in ("full", "delta"):
            raise r._error(f"corrupted header (unknown kind {h.get('kind')!r})")

    def same_table_shape(self, other: _Config) -> bool:
        return (
            self.dim == other.dim
            and self.row_width == other.row_width
            and self.layout == other.layout
            and type(self.optimizer) is type(other.optimizer)
        )


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def _crc32(a: np.ndarray) -> int:
    return zlib.crc32(a.data.cast("B")) & 0xFFFFFFFF


def _chunk_rows(width: int) -> int:
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * width))


class _Buffers:
    """One chunk's worth of ids, rows and last steps (reused)."""

    def __init__(self, rows: int, width: int) -> None:
        self.ids = np.empty(rows, dtype=np.uint64)
        self.rows = np.empty((rows, width), dtype=np.float32)
        self.steps = np.empty(rows, dtype=np.uint32)


def write_snapshot(
    table: Table,
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
    header = _header(table, kind, ckpt_id, parent, snap)
    width = int(snap.row_width)
    cap = _chunk_rows(width)
    admission = table.admission is not None and table.admission.min_count > 1
    with CheckpointWriter(path, header) as w:
        free: queue.Queue[_Buffers] = queue.Queue()
        for _ in range(2):
            free.put(_Buffers(cap, width))
        work: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        failure: list[BaseException] = []

        def writer() -> None:
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

        thread = threading.Thread(target=writer, name="embstore-checkpoint-writer", daemon=True)
        thread.start()
        try:
            for s in range(int(snap.num_shards)):
                while not snap.done(s) and not failure:
                    buf = free.get()
                    n = int(snap.next(s, buf.ids, buf.rows, buf.steps))
                    if _chunk_hook is not None:
                        _chunk_hook()
                    if n:  # checksums here, writes there: the two threads share the work
                        crcs = [_crc32(a[:n]) for a in (buf.ids, buf.rows, buf.steps)]
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
    return header


def save(table: Table, path: str | os.PathLike[str], *, delta: bool) -> str:
    """``Table.save`` / ``Table.save_delta``: returns the new checkpoint id."""
    impl = table._live()
    path = os.fspath(path)
    if delta and table._checkpoint_id is None:
        msg = (
            f"{path}: save_delta needs a previous checkpoint of this table: call save() first "
            "(a table starts a chain with save() or by being loaded from a checkpoint)"
        )
        raise CheckpointError(msg)
    snap = _core.begin_snapshot(impl, _MODE_DELTA if delta else _MODE_FULL)
    try:
        with table._checkpoint_lock:  # the parent as of this snapshot (saves are serial)
            parent = table._checkpoint_id if delta else None
        if delta and parent is None:
            msg = f"{path}: save_delta needs a previous checkpoint of this table"
            raise CheckpointError(msg)
        ckpt_id = new_checkpoint_id()
        write_snapshot(table, snap, path, "delta" if delta else "full", ckpt_id, parent)
        with table._checkpoint_lock:
            snap.commit()
            table._checkpoint_id = ckpt_id
    except BaseException:
        snap.abort()
        raise
    return ckpt_id


# --------------------------------------------------------------------------------------
# Export / import
# --------------------------------------------------------------------------------------


def export(table: Table) -> dict[str, np.ndarray]:
    """``Table.export``: a point-in-time copy of every row as numpy arrays."""
    impl = table._live()
    snap = _core.begin_snapshot(impl, _MODE_EXPORT)
    try:
        width = int(snap.row_width)
        cap = _chunk_rows(width)
        buf = _Buffers(cap, width)
        ids: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        steps: list[np.ndarray] = []
        for s in range(int(snap.num_shards)):
            while not snap.done(s):
                n = int(snap.next(s, buf.ids, buf.rows, buf.steps))
                if _chunk_hook is not None:
                    _chunk_hook()
                if n:
                    ids.append(buf.ids[:n].copy())
                    rows.append(buf.rows[:n].copy())
                    steps.append(buf.steps[:n].copy())
        snap.commit()
    except BaseException:
        snap.abort()
        raise
    all_ids = np.concatenate(ids) if ids else np.zeros(0, np.uint64)
    all_rows = np.concatenate(rows) if rows else np.zeros((0, width), np.float32)
    out = table._split_rows(all_ids, all_rows, with_state=True)
    out["last_step"] = np.concatenate(steps) if steps else np.zeros(0, np.uint32)
    return out


def fresh_state_rows(table: Table, n: int) -> npt.NDArray[np.float32]:
    """Optimizer state of ``n`` fresh rows ``[n, state_width]`` (as a new row starts)."""
    width = sum(w for _, w, _ in _layout(table))
    value = getattr(table.optimizer, "initial_accumulator", 0.0)
    if not isinstance(table.optimizer, Adagrad):
        value = 0.0
    return np.full((n, width), np.float32(value), dtype=np.float32)


def import_(table: Table, data: Mapping[str, Any]) -> int:
    """``Table.import_``: validates everything, then inserts or overwrites rows."""
    impl = table._live()
    if not isinstance(data, Mapping):
        msg = f"import_ expects a mapping of name -> array, got {type(data).__name__}"
        raise TypeError(msg)
    layout = _layout(table)
    state_names = [name for name, _, _ in layout]
    known = {"ids", "values", "last_step", *state_names}
    unknown = sorted(set(data) - known)
    if unknown:
        msg = f"import_: unknown entries {unknown}; expected ids, values, last_step, {state_names}"
        raise ValueError(msg)
    for req in ("ids", "values"):
        if req not in data:
            msg = f"import_: missing entry {req!r}"
            raise ValueError(msg)
    ids = _arrays.as_keys(data["ids"], "ids")
    n = ids.shape[0]
    dim = table.dim
    values = _float_array(data["values"], "values", (n, dim))
    given = [name for name in state_names if name in data]
    if given and len(given) != len(state_names):
        missing = [name for name in state_names if name not in data]
        msg = f"import_: give every optimizer state entry or none; missing {missing}"
        raise ValueError(msg)
    width = dim + sum(w for _, w, _ in layout)
    rows = np.empty((n, width), dtype=np.float32)
    rows[:, :dim] = values
    if given:
        col = dim
        for name, w, dtype in layout:
            shape = (n,) if w == 1 else (n, w)
            if dtype == "uint32":
                part = _uint_array(data[name], name, shape, 2**32 - 1).astype(np.uint32)
                rows[:, col : col + w] = part.reshape(n, w).view(np.float32)
            else:
                part_f = _float_array(data[name], name, shape)
                rows[:, col : col + w] = part_f.reshape(n, w)
            col += w
    else:
        rows[:, dim:] = fresh_state_rows(table, n)
    steps: npt.NDArray[np.uint32] | None = None
    if "last_step" in data:
        steps = _uint_array(data["last_step"], "last_step", (n,), 2**32 - 1).astype(np.uint32)
    if n and np.unique(ids).shape[0] != n:
        msg = "import_: ids must be distinct"
        raise ValueError(msg)
    try:
        stored = int(impl.import_rows(ids=ids, rows=rows, steps=steps, restore=False, placed=None))
    finally:
        table._deliver_evicted()
    return stored


def _float_array(x: Any, name: str, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        msg = f"import_: {name} must be a float array, got dtype {arr.dtype}"
        raise TypeError(msg)
    if arr.shape != shape:
        msg = f"import_: {name} must have shape {shape}, got {arr.shape}"
        raise ValueError(msg)
    out = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.all(np.isfinite(out)):
        msg = f"import_: {name} must be finite"
        raise ValueError(msg)
    return out


def _uint_array(x: Any, name: str, shape: tuple[int, ...], high: int) -> npt.NDArray[np.int64]:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        msg = f"import_: {name} must be an integer array, got dtype {arr.dtype}"
        raise TypeError(msg)
    if arr.shape != shape:
        msg = f"import_: {name} must have shape {shape}, got {arr.shape}"
        raise ValueError(msg)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > high):
        msg = f"import_: {name} must be in [0, {high}]"
        raise ValueError(msg)
    return arr.astype(np.int64)


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


class _Group:
    """A row group read from a file into pooled buffers; release() recycles them."""

    def __init__(self, buffers: _Buffers, n: int, pool: queue.Queue[_Buffers]) -> None:
        self.buffers = buffers
        self.n = n
        self._pool = pool

    def release(self) -> None:
        self._pool.put(self.buffers)


def _read_groups(
    r: CheckpointReader, width: int, pool: queue.Queue[_Buffers], emit: Any, take: Any
) -> None:
    """Reads every section of ``r`` in order, checking each, and emits each row group (a
    _Group) and each sketch ((shard, counters)). Removed-id sections are only checked (the
    pre-pass applied them)."""
    scratch = np.empty(1 << 20, dtype=np.uint8)
    group: list[Any] = []
    buf: _Buffers | None = None
    names = ("ids", "rows", "last_step")
    for sec in r.sections():
        if sec.name in names:
            n = sec.shape[0]
            if sec.name != names[len(group)] or (group and group[0].shape[0] != n):
                raise r._error(f"corrupted (section {sec.number} out of place)")
            if sec.name == "rows" and sec.shape[1] != width:
                raise r._error(
                    f"corrupted (section {sec.number} has rows of width {sec.shape[1]}, "
                    f"expected {width})"
                )
            if buf is None:
                buf = take()
                if buf.ids.shape[0] < n:  # a bigger chunk than this embstore writes
                    buf = _Buffers(n, width)
            targets: dict[str, np.ndarray] = {
                "ids": buf.ids,
                "rows": buf.rows,
                "last_step": buf.steps,
            }
            target = targets[sec.name]
            r.read_payload(sec, target)
            group.append(sec)
            if len(group) == 3:
                emit(_Group(buf, n, pool))
                group, buf = [], None
        elif sec.name == "sketch":
            arr = r.read_payload(sec)
            if sec.shard is not None:
                emit((sec.shard, arr))
        else:
            r.skip_payload(sec, scratch)
    if group:
        raise r._error("corrupted (an incomplete row group)")


def _prefetch_groups(r: CheckpointReader, width: int) -> Generator[Any, None, None]:
    """Yields what _read_groups emits, reading (and checksumming) in a thread of its own so
    that file reads overlap the caller's imports. Errors are re-raised in the caller."""
    cap = _chunk_rows(width)
    pool: queue.Queue[_Buffers] = queue.Queue()
    for _ in range(3):
        pool.put(_Buffers(cap, width))
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

    def take() -> _Buffers:
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
    """The consumer of _prefetch_groups went away."""


def _open_chain(
    base: str | os.PathLike[str], deltas: Sequence[str | os.PathLike[str]]
) -> tuple[list[CheckpointReader], list[_Config]]:
    readers: list[CheckpointReader] = []
    try:
        for p in [base, *deltas]:
            readers.append(CheckpointReader(p))
        configs = [_Config(r) for r in readers]
        if readers[0].kind != "full":
            msg = f"{readers[0].path}: a delta checkpoint, not a full one (pass it in deltas=)"
            raise CheckpointError(msg)
        for k in range(1, len(readers)):
            r, prev = readers[k], readers[k - 1]
            if r.kind != "delta":
                msg = f"{r.path}: a full checkpoint, not a delta (deltas must be deltas)"
                raise CheckpointError(msg)
            if r.parent_id != prev.checkpoint_id:
                msg = (
                    f"{r.path}: this delta follows checkpoint {r.parent_id}, not {prev.path} "
                    f"({prev.checkpoint_id}): the chain does not fit (wrong order, a missing "
                    "delta, or a delta of another table)"
                )
                raise CheckpointError(msg)
            if not configs[k].same_table_shape(configs[0]):
                msg = f"{r.path}: a delta of a table of another shape than {readers[0].path}"
                raise CheckpointError(msg)
    except BaseException:
        for r in readers:
            r.close()
        raise
    return readers, configs


def _scan_ids(
    r: CheckpointReader, scratch: np.ndarray
) -> tuple[U64Array, npt.NDArray[np.uint32], U64Array]:
    """Pre-pass over one file: its row ids, last steps and removed ids (every section is
    checked; rows are only checksummed)."""
    ids: list[np.ndarray] = []
    steps: list[np.ndarray] = []
    removed: list[np.ndarray] = []
    for sec in r.sections():
        if sec.name == "ids":
            ids.append(r.read_payload(sec))
        elif sec.name == "last_step":
            steps.append(r.read_payload(sec))
        elif sec.name == "removed":
            removed.append(r.read_payload(sec))
        else:
            r.skip_payload(sec, scratch)
    cat = np.concatenate
    return (
        cat(ids) if ids else np.zeros(0, np.uint64),
        cat(steps) if steps else np.zeros(0, np.uint32),
        cat(removed) if removed else np.zeros(0, np.uint64),
    )


def _select(
    readers: list[CheckpointReader], capacity: int, keep: str | None
) -> tuple[list[npt.NDArray[np.bool_]], bool]:
    """Which rows of each file make the final table: the last version of every id that no
    later delta removes, and with keep="recent" at most ``capacity`` of them (largest last
    step first; ties in file order). Returns per-file masks and whether rows were dropped.
    """
    scratch = np.empty(1 << 20, dtype=np.uint8)
    ev_ids: list[np.ndarray] = []
    ev_seq: list[np.ndarray] = []
    ev_file: list[np.ndarray] = []
    ev_pos: list[np.ndarray] = []
    ev_step: list[np.ndarray] = []
    seq = 0
    sizes = []
    for f, r in enumerate(readers):
        ids, steps, removed = _scan_ids(r, scratch)
        if steps.shape[0] != ids.shape[0] or ids.shape[0] != r.num_rows:
            raise r._error("corrupted (ids and last steps differ in length)")
        sizes.append(ids.shape[0])
        r.close()
        # Within a file, removals come before rows (an id removed then re-inserted).
        for arr, pos, st in (
            (
                removed,
                np.full(removed.shape[0], -1, np.int64),
                np.zeros(removed.shape[0], np.uint32),
            ),
            (ids, np.arange(ids.shape[0], dtype=np.int64), steps),
        ):
            ev_ids.append(arr)
            ev_seq.append(np.arange(seq, seq + arr.shape[0], dtype=np.int64))
            ev_file.append(np.full(arr.shape[0], f, np.int32))
            ev_pos.append(pos)
            ev_step.append(st)
            seq += arr.shape[0]
    all_ids = np.concatenate(ev_ids)
    all_seq = np.concatenate(ev_seq)
    order = np.lexsort((all_seq, all_ids))
    sorted_ids = all_ids[order]
    last = np.ones(order.shape[0], dtype=bool)
    if order.shape[0] > 1:
        last[:-1] = sorted_ids[1:] != sorted_ids[:-1]
    final = order[last]  # the last event of each id
    pos = np.concatenate(ev_pos)[final]
    live = pos >= 0
    final = final[live]
    pos = pos[live]
    files = np.concatenate(ev_file)[final]
    dropped = False
    if keep == "recent" and final.shape[0] > capacity:
        steps_all = np.concatenate(ev_step)[final]
        seqs = all_seq[final]
        # Largest last step first; ties by file order (the event sequence).
        pick = np.lexsort((seqs, -steps_all.astype(np.int64)))[:capacity]
        files, pos = files[pick], pos[pick]
        dropped = True
    masks = [np.zeros(n, dtype=bool) for n in sizes]
    for f in range(len(readers)):
        masks[f][pos[files == f]] = True
    return masks, dropped


def load(
    path: str | os.PathLike[str],
    deltas: Sequence[str | os.PathLike[str]],
    overrides: dict[str, Any],
    keep: str | None,
) -> Table:
    """``Table.load``."""
    from embstore.table import Table

    start = time.perf_counter_ns()
    bad = sorted(set(overrides) - set(LOAD_OVERRIDES))
    if bad:
        msg = (
            f"Table.load() got unexpected keyword argument(s) {bad}: only "
            f"{', '.join(LOAD_OVERRIDES)} (and keep=) may differ from the checkpoint"
        )
        raise TypeError(msg)
    if keep not in (None, "recent"):
        msg = f"keep must be None or 'recent', got {keep!r}"
        raise ValueError(msg)
    if isinstance(deltas, (str, os.PathLike)):
        msg = "deltas must be a sequence of paths (use deltas=[path])"
        raise TypeError(msg)
    deltas = list(deltas)
    readers, configs = _open_chain(path, deltas)
    cfg = configs[-1]
    capacity = overrides.get("capacity", cfg.capacity)
    num_shards = overrides.get("num_shards", cfg.num_shards)
    masks: list[npt.NDArray[np.bool_]] | None = None
    dropped = False
    table: Table | None = None
    impl: _core.Table | None = None
    try:
        total = readers[0].num_rows
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer):
            msg = f"capacity must be an int, got {type(capacity).__name__}"
            raise TypeError(msg)
        if len(readers) > 1 or (keep == "recent" and total > capacity):
            masks, dropped = _select(readers, int(capacity), keep)
            total = int(sum(int(m.sum()) for m in masks))
            readers = [CheckpointReader(r.path) for r in readers]  # re-open for the main pass
        if total > capacity:
            msg = (
                f"{readers[-1].path}: the checkpoint holds {total} rows, more than capacity "
                f"{capacity}; load with a larger capacity or keep='recent'"
            )
            raise _core.CapacityError(msg)
        if num_shards is None:
            num_shards = cfg.num_shards
        if "num_shards" not in overrides and int(num_shards) > int(capacity):
            num_shards = None  # a small capacity override: let the table choose
        table = Table(
            dim=cfg.dim,
            capacity=int(capacity),
            optimizer=cfg.optimizer,
            initializer=cfg.initializer,
            num_shards=num_shards,
            eviction=overrides.get("eviction", cfg.eviction),
            num_threads=overrides.get("num_threads", cfg.num_threads),
            name=overrides.get("name", cfg.name),
            admission=cfg.admission,
            on_evict=overrides.get("on_evict"),
        )
        impl = table._live()
        not_placed = 0
        sketches: dict[int, np.ndarray] = {}
        for f, r in enumerate(readers):
            mask = None if masks is None else masks[f]
            seen = 0
            file_sketch: dict[int, np.ndarray] = {}
            with contextlib.closing(_prefetch_groups(r, cfg.row_width)) as items:
                for item in items:  # closing: the reader thread stops even on an error
                    if isinstance(item, tuple):  # a sketch section
                        file_sketch[item[0]] = item[1]
                        continue
                    buf, n = item.buffers, item.n
                    ids, rows, steps = buf.ids[:n], buf.rows[:n], buf.steps[:n]
                    if mask is not None:
                        m = mask[seen : seen + n]
                        if not m.all():
                            ids, rows, steps = ids[m], rows[m], steps[m]
                    seen += n
                    k = ids.shape[0]
                    if k:
                        stored = int(
                            impl.import_rows(
                                ids=ids, rows=rows, steps=steps, restore=True, placed=None
                            )
                        )
                        not_placed += k - stored
                    item.release()
            if seen != r.num_rows:
                raise r._error("corrupted (row count differs from the trailer)")
            if file_sketch:
                sketches = file_sketch  # the latest file's counters
        if not_placed and keep != "recent":
            msg = (
                f"{readers[-1].path}: {not_placed} rows did not fit: a shard of the new table "
                f"(capacity {capacity}, {impl.num_shards} shards) has no room for its share; "
                "load with a larger capacity or keep='recent'"
            )
            raise _core.CapacityError(msg)
        dropped = dropped or not_placed > 0
        adm = cfg.admission
        if sketches and adm is not None and impl.num_shards == cfg.num_shards:
            for s, counters in sketches.items():
                if s < impl.num_shards:
                    impl.restore_sketch(shard=s, counters=np.ascontiguousarray(counters))
        if cfg.step_tracking:
            table.set_step(cfg.step)
        table._checkpoint_id = None if dropped else readers[-1].checkpoint_id
    except BaseException:
        if table is not None:
            table.close()
        raise
    finally:
        for r in readers:
            r.close()
    assert table is not None and impl is not None
    impl.record_latency(name="load", ns=time.perf_counter_ns() - start)
    return table


# --------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------

MANIFEST = "MANIFEST.json"
_GROUP_FORMAT = "embstore.group"
_FILE_RE = re.compile(r"^t\d{3}-[0-9a-f]{12}\.ckpt$")
_TMP_RE = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")


def save_group(group: TableGroup, directory: str | os.PathLike[str]) -> None:
    """``TableGroup.save``: one checkpoint file per table and a manifest, written last
    (atomically): the manifest names the files, so a crash before it is renamed leaves the
    previous group checkpoint whole. Unreferenced files of older saves are removed after."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    names = group.names
    tables = [group[n] for n in names]
    impls = [t._live() for t in tables]
    snaps: list[_core.Snapshot] = []
    try:
        for impl in impls:  # begun back to back: the tables' instants are microseconds apart
            snaps.append(_core.begin_snapshot(impl, _MODE_FULL))
        entries: dict[str, Any] = {}
        ids: list[str] = []
        for k, (name, table, snap) in enumerate(zip(names, tables, snaps)):
            ckpt_id = new_checkpoint_id()
            fname = f"t{k:03d}-{ckpt_id[:12]}.ckpt"
            write_snapshot(table, snap, os.path.join(directory, fname), "full", ckpt_id, None)
            entries[name] = {"file": fname, "checkpoint_id": ckpt_id}
            ids.append(ckpt_id)
        body = {
            "format": _GROUP_FORMAT,
            "version": FORMAT_VERSION,
            "created_unix": time.time(),
            "tables": entries,
            "order": names,
        }
        text = json.dumps(body, sort_keys=True)
        manifest = {"body": body, "crc32": zlib.crc32(text.encode()) & 0xFFFFFFFF}
        write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest).encode())
        for table, snap, ckpt_id in zip(tables, snaps, ids):
            with table._checkpoint_lock:
                snap.commit()
                table._checkpoint_id = ckpt_id
    except BaseException:
        for snap in snaps:
            snap.abort()
        raise
    keep_files = {e["file"] for e in entries.values()}
    for fname in os.listdir(directory):
        if (_FILE_RE.match(fname) and fname not in keep_files) or _TMP_RE.match(fname):
            try:
                os.unlink(os.path.join(directory, fname))
            except OSError:
                pass


def load_group(directory: str | os.PathLike[str], num_threads: int | None) -> TableGroup:
    """``TableGroup.load``."""
    from embstore.group import TableGroup

    directory = os.fspath(directory)
    mpath = os.path.join(directory, MANIFEST)
    with open(mpath, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw.decode())
        body = manifest["body"]
        text = json.dumps(body, sort_keys=True)
        ok = zlib.crc32(text.encode()) & 0xFFFFFFFF == manifest["crc32"]
        if not ok or body.get("format") != _GROUP_FORMAT:
            raise ValueError("checksum")
        if body.get("version") != FORMAT_VERSION:
            msg = f"{mpath}: unsupported group format version {body.get('version')}"
            raise CheckpointError(msg)
        order = [str(n) for n in body["order"]]
        entries = {n: body["tables"][n] for n in order}
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError):
        msg = f"{mpath}: not an embstore group manifest, or corrupted"
        raise CheckpointError(msg) from None
    tables: dict[str, Table] = {}
    try:
        for name in order:
            e = entries[name]
            fpath = os.path.join(directory, str(e["file"]))
            overrides: dict[str, Any] = {"name": name}
            if num_threads is not None:
                overrides["num_threads"] = num_threads
            t = load(fpath, [], overrides, None)
            tables[name] = t
            if t._checkpoint_id != e["checkpoint_id"]:
                msg = f"{fpath}: not the checkpoint the manifest names ({e['checkpoint_id']})"
                raise CheckpointError(msg)
    except BaseException:
        for t in tables.values():
            t.close()
        raise
    return TableGroup(tables)
