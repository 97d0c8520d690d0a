"""Loading: a table from a checkpoint chain, and a group from its directory, read by the
C++ core (``_core.checkpoint_load`` / ``checkpoint_load_group``); the spec of the loaded
table is decoded from the last file's header."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from embstore import _arrays, _core
from embstore._internals import TableInternals
from embstore._persist.header import HeaderView, SavedTable
from embstore._persist.manifest import MANIFEST
from embstore.spec import TableSpec

#: Keyword arguments of Table.load that may differ from the saved table.
LOAD_OVERRIDES = ("capacity", "num_shards", "num_threads", "name", "on_evict", "eviction")


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
    capacity = overrides.get("capacity")
    if "capacity" in overrides and (
        isinstance(capacity, bool) or not isinstance(capacity, int | np.integer)
    ):
        msg = f"capacity must be an int, got {type(capacity).__name__}"
        raise TypeError(msg)


def saved_table(path: str) -> SavedTable:
    """The checked table configuration in the header of the checkpoint at ``path``."""
    return SavedTable(HeaderView(path, json.loads(_core.checkpoint_read_header(path))))


def _wrap(loaded: dict[str, Any], spec: TableSpec) -> TableInternals:
    """The internals around a core the core's loader returned."""
    core: _core.Table = loaded["table"]
    return TableInternals(spec, core)


def load(
    path: str | os.PathLike[str],
    deltas: Sequence[str | os.PathLike[str]],
    overrides: dict[str, Any],
    keep: str | None,
) -> TableInternals:
    """``Table.load``: the internals of the loaded table."""
    _check_arguments(deltas, overrides, keep)
    paths = [os.fspath(p) for p in deltas]
    base = os.fspath(path)
    # The spec first: bad overrides raise before a row is read.
    spec = saved_table(paths[-1] if paths else base).spec(overrides)
    args = spec.core_args()
    loaded = _core.checkpoint_load(
        base,
        paths,
        capacity=spec.capacity,
        num_shards=spec.num_shards,
        num_threads=spec.num_threads,
        eviction=args["eviction"],
        stage_evicted=bool(args["stage_evicted"]),
        keep_recent=keep == "recent",
    )
    return _wrap(loaded, spec)  # the core records the load's latency


def load_group(
    directory: str | os.PathLike[str], num_threads: int | None
) -> dict[str, TableInternals]:
    """``TableGroup.load``: the internals of every table, by name, in the saved order."""
    directory = os.fspath(directory)
    if num_threads is not None:
        _arrays.positive_int("num_threads", num_threads)
    loaded = _core.checkpoint_load_group(directory, num_threads)
    with open(os.path.join(directory, MANIFEST), "rb") as f:  # checked by the core
        entries = json.loads(f.read().decode())["body"]["tables"]
    tables: dict[str, TableInternals] = {}
    for name, d in loaded:
        overrides: dict[str, Any] = {"name": name}
        if num_threads is not None:
            overrides["num_threads"] = num_threads
        cfg = saved_table(os.path.join(directory, str(entries[name]["file"])))
        tables[name] = _wrap(d, cfg.spec(overrides))
    return tables
