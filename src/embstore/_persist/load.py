"""Loading: a table from a checkpoint chain, and a group from its directory."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _core
from embstore._internals import TableInternals
from embstore._persist.chain import open_chain, select
from embstore._persist.header import SavedTable
from embstore._persist.manifest import GROUP_FORMAT, MANIFEST, unseal
from embstore._persist.read import RowGroup, prefetch_groups
from embstore.checkpoint import FORMAT_VERSION, CheckpointError, CheckpointReader

#: Keyword arguments of Table.load that may differ from the saved table.
LOAD_OVERRIDES = ("capacity", "num_shards", "num_threads", "name", "on_evict", "eviction")

_Masks = list[npt.NDArray[np.bool_]] | None


def _check_arguments(
    deltas: Sequence[str | os.PathLike[str]], overrides: dict[str, Any], keep: str | None
) -> None:
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


def _plan_rows(
    readers: list[CheckpointReader], capacity: Any, keep: str | None
) -> tuple[list[CheckpointReader], _Masks, bool]:
    """Which rows to load (None: all of the one file); raises CapacityError if they do not
    fit. Returns the readers to load from (re-opened after a pre-pass), the masks and
    whether rows were dropped."""
    if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer):
        msg = f"capacity must be an int, got {type(capacity).__name__}"
        raise TypeError(msg)
    total = readers[0].num_rows
    masks: _Masks = None
    dropped = False
    if len(readers) > 1 or (keep == "recent" and total > capacity):
        masks, dropped = select(readers, int(capacity), keep)
        total = int(sum(int(m.sum()) for m in masks))
        readers = [CheckpointReader(r.path) for r in readers]  # re-open for the main pass
    if total > capacity:
        msg = (
            f"{readers[-1].path}: the checkpoint holds {total} rows, more than capacity "
            f"{capacity}; load with a larger capacity or keep='recent'"
        )
        raise _core.CapacityError(msg)
    return readers, masks, dropped


def _import_group(
    impl: _core.Table, item: RowGroup, mask: npt.NDArray[np.bool_] | None, seen: int
) -> int:
    """Restores one row group's selected rows; returns how many found no room."""
    buf, n = item.buffers, item.n
    ids, rows, steps = buf.ids[:n], buf.rows[:n], buf.steps[:n]
    if mask is not None:
        m = mask[seen : seen + n]
        if not m.all():
            ids, rows, steps = ids[m], rows[m], steps[m]
    k = int(ids.shape[0])
    if not k:
        return 0
    stored = int(impl.import_rows(ids=ids, rows=rows, steps=steps, restore=True, placed=None))
    return k - stored


def _import_file(
    impl: _core.Table,
    r: CheckpointReader,
    width: int,
    mask: npt.NDArray[np.bool_] | None,
    sketches: dict[int, np.ndarray],
) -> int:
    """Restores one file's selected rows (its sketch counters go into ``sketches``);
    returns how many rows found no room."""
    not_placed = seen = 0
    file_sketch: dict[int, np.ndarray] = {}
    with contextlib.closing(prefetch_groups(r, width)) as items:
        for item in items:  # closing: the reader thread stops even on an error
            if isinstance(item, tuple):  # a sketch section
                file_sketch[item[0]] = item[1]
                continue
            not_placed += _import_group(impl, item, mask, seen)
            seen += item.n
            item.release()
    if seen != r.num_rows:
        raise r.error("corrupted (row count differs from the trailer)")
    if file_sketch:
        sketches.clear()
        sketches.update(file_sketch)  # the latest file's counters
    return not_placed


def _restore_counters(impl: _core.Table, cfg: SavedTable, sketches: dict[int, np.ndarray]) -> None:
    if sketches and cfg.admission is not None and impl.num_shards == cfg.num_shards:
        for s, counters in sketches.items():
            if s < impl.num_shards:
                impl.restore_sketch(shard=s, counters=np.ascontiguousarray(counters))
    if cfg.step_tracking:
        impl.set_step(cfg.step)


def load(
    path: str | os.PathLike[str],
    deltas: Sequence[str | os.PathLike[str]],
    overrides: dict[str, Any],
    keep: str | None,
) -> TableInternals:
    """``Table.load``: the internals of the loaded table."""
    start = time.perf_counter_ns()
    _check_arguments(deltas, overrides, keep)
    readers, configs = open_chain(path, list(deltas))
    cfg = configs[-1]
    capacity = overrides.get("capacity", cfg.capacity)
    table: TableInternals | None = None
    try:
        readers, masks, dropped = _plan_rows(readers, capacity, keep)
        table = TableInternals(cfg.spec(overrides))
        impl = table.live()
        not_placed = 0
        sketches: dict[int, np.ndarray] = {}
        for f, r in enumerate(readers):
            mask = None if masks is None else masks[f]
            not_placed += _import_file(impl, r, cfg.row_width, mask, sketches)
        if not_placed and keep != "recent":
            msg = (
                f"{readers[-1].path}: {not_placed} rows did not fit: a shard of the new table "
                f"(capacity {capacity}, {impl.num_shards} shards) has no room for its share; "
                "load with a larger capacity or keep='recent'"
            )
            raise _core.CapacityError(msg)
        _restore_counters(impl, cfg, sketches)
        dropped = dropped or not_placed > 0
        table.checkpoint_id = None if dropped else readers[-1].checkpoint_id
    except BaseException:
        if table is not None:
            table.close()
        raise
    finally:
        for r in readers:
            r.close()
    impl.record_latency(name="load", ns=time.perf_counter_ns() - start)
    return table


def _read_manifest(directory: str) -> tuple[str, list[str], dict[str, Any]]:
    """The manifest's path, its table names in order and their entries."""
    mpath = os.path.join(directory, MANIFEST)
    with open(mpath, "rb") as f:
        raw = f.read()
    try:
        body = unseal(raw)
        if body.get("format") != GROUP_FORMAT:
            raise ValueError("format")
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
    return mpath, order, entries


def load_group(
    directory: str | os.PathLike[str], num_threads: int | None
) -> dict[str, TableInternals]:
    """``TableGroup.load``: the internals of every table, by name, in the saved order."""
    directory = os.fspath(directory)
    _, order, entries = _read_manifest(directory)
    tables: dict[str, TableInternals] = {}
    try:
        for name in order:
            e = entries[name]
            fpath = os.path.join(directory, str(e["file"]))
            overrides: dict[str, Any] = {"name": name}
            if num_threads is not None:
                overrides["num_threads"] = num_threads
            t = load(fpath, [], overrides, None)
            tables[name] = t
            if t.checkpoint_id != e["checkpoint_id"]:
                msg = f"{fpath}: not the checkpoint the manifest names ({e['checkpoint_id']})"
                raise CheckpointError(msg)
    except BaseException:
        for t in tables.values():
            t.close()
        raise
    return tables
