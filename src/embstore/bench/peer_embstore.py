"""embstore as a peer, and the warm embstore tables every bench script builds."""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from embstore.bench.env import resident_bytes
from embstore.bench.peers import Peer, register_peer
from embstore.bench.w5 import make_w5_tables
from embstore.bench.workload import EPS, LR, Batch, F32Array, TableData, U64Array, make_tables

#: Ids inserted per warm-up call (bounds the temporary output buffer).
WARM_CHUNK = 1 << 16


def warm_table(table: Any, ids: U64Array, dim: int) -> None:
    """Insert ``ids`` into an embstore table in order, ``WARM_CHUNK`` at a time."""
    buf = np.empty((min(WARM_CHUNK, max(1, ids.shape[0])), dim), dtype=np.float32)
    for lo in range(0, ids.shape[0], WARM_CHUNK):
        chunk = ids[lo : lo + WARM_CHUNK]
        table.lookup(chunk, insert=True, out=buf[: chunk.shape[0]])


def embstore_tables(
    tables: Sequence[TableData],
    dim: int,
    *,
    optimizer: Any = None,
    capacity: int | None = None,
    threads: int | None = None,
    warm: bool = True,
    warm_filter: Callable[[U64Array], U64Array] | None = None,
    **table_kwargs: Any,
) -> dict[str, Any]:
    """One embstore Table per workload table, by name: W1's initializer (Normal(0.01),
    seeded by the table index), ``optimizer`` (default W1's Adagrad), ``capacity`` (default
    the universe), warmed in placement order unless ``warm`` is false. ``warm_filter`` picks
    which of the ids to insert (W4 leaves some out); ``table_kwargs`` go to ``Table``
    (e.g. ``admission``)."""
    es = importlib.import_module("embstore")
    out: dict[str, Any] = {}
    for tab in tables:
        t = es.Table(
            dim=dim,
            capacity=capacity or tab.universe,
            optimizer=optimizer or es.Adagrad(lr=LR, eps=EPS, initial_accumulator=0.0),
            initializer=es.Normal(std=0.01, seed=tab.index),
            eviction="clock",
            num_threads=threads,
            **table_kwargs,
        )
        if warm:
            ids = tab.warm_ids if warm_filter is None else warm_filter(tab.warm_ids)
            warm_table(t, ids, dim)
        out[tab.name] = t
    return out


def memory_probe(
    num_tables: int, universe: int, dim: int, threads: int | None, workload: str = "w1"
) -> dict[str, Any]:
    """Resident memory of ``num_tables`` warm embstore tables, measured in this process.

    Meant to run in a fresh interpreter (see :func:`probe_memory`): the resident set
    before creating the tables, after creating them (shows how much of the arena is
    committed up front) and after inserting all ``universe`` ids of each (``workload``
    "w5": W5's tables, ``universe`` capping their rows).
    """
    if workload == "w5":
        tables = make_w5_tables(universe, num_tables)
    else:
        tables = make_tables(num_tables, universe)
    gc.collect()
    rss0 = resident_bytes()
    made = list(embstore_tables(tables, dim, threads=threads, warm=False).values())
    rss1 = resident_bytes()
    for t, tab in zip(made, tables, strict=True):
        warm_table(t, tab.warm_ids, dim)
    gc.collect()
    rss2 = resident_bytes()
    rows = sum(len(t) for t in made)
    out: dict[str, Any] = {
        "rows": rows,
        "dim": dim,
        "payload_bytes_per_row": 8 + 2 * 4 * dim,
        "stats_bytes_per_row": made[0].stats().get("bytes_per_row"),
    }
    if rss0 is not None and rss1 is not None and rss2 is not None and rows:
        out.update(
            rss_created_bytes=rss1 - rss0,
            rss_delta_bytes=rss2 - rss0,
            rss_bytes_per_row=(rss2 - rss0) / rows,
        )
    return out


def probe_memory(
    num_tables: int, universe: int, dim: int, threads: int | None, workload: str = "w1"
) -> dict[str, Any]:
    """Run :func:`memory_probe` in a fresh interpreter and return its result.

    A fresh process is needed because memory freed by earlier tables (or peers) stays in
    this process's allocator and would hide part of the new tables' footprint.
    """
    es = importlib.import_module("embstore")
    root = str(Path(str(es.__file__)).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    code = (
        "import json; from embstore.bench import memory_probe; "
        f"print(json.dumps(memory_probe({num_tables}, {universe}, {dim}, {threads!r}, "
        f"{workload!r})))"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
            check=True,
        )
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"dim": dim, "error": f"memory probe failed: {exc}"}
    return result


def _span(xs: Sequence[int]) -> str:
    """``"4"`` if all equal, else ``"1-64"``."""
    lo, hi = min(xs, default=0), max(xs, default=0)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


@register_peer
class EmbstorePeer(Peer):
    """embstore: one :class:`embstore.TableGroup` call per batch for all tables."""

    name = "embstore"
    label = "embstore TableGroup"
    threaded = True
    hashed = True

    def __init__(
        self, threads: int | None = None, *, capacity: int | None = None, warm: bool = True
    ) -> None:
        super().__init__(threads)
        self._capacity = capacity
        self._warm = warm
        self._tables: list[Any] = []
        self._names: list[str] = []
        self._group: Any = None
        self._extra: dict[str, Any] = {}

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            importlib.import_module("embstore")
        except ImportError as exc:
            return f"skipped: embstore core not importable ({exc})"
        return None

    @classmethod
    def memory_bytes(cls, tables: Sequence[TableData], dim: int) -> int:
        # Id + weights + accumulators, plus index and slack (measured: 1.26x at D=16).
        return int(sum(tab.universe for tab in tables) * (8 + 8 * dim) * 1.4)

    def setup(self, tables: Sequence[TableData], dim: int) -> None:
        es = importlib.import_module("embstore")
        by_name = embstore_tables(
            tables, dim, capacity=self._capacity, threads=self.threads, warm=self._warm
        )
        self._names, self._tables = list(by_name), list(by_name.values())
        self._group = es.TableGroup(by_name)
        if not self._warm:
            return
        rows = sum(len(t) for t in self._tables)
        stats = [t.stats() for t in self._tables]
        evictions = sum(int(st.get("evictions", 0)) for st in stats)
        self._extra = {
            "rows": rows,
            "stats_bytes_per_row": stats[0].get("bytes_per_row"),
            "num_shards": _span([int(st.get("num_shards", 0)) for st in stats]),
            "evictions_during_warmup": evictions,
        }
        expected = sum(tab.universe for tab in tables)
        if rows != expected or evictions:
            self._extra["warning"] = (
                f"warm-up left {rows} of {expected} ids resident ({evictions} evictions)"
            )

    def forward(self, batch: Batch) -> Sequence[Any]:
        out = self._group.lookup_sum(
            {n: (k, batch.offsets) for n, k in zip(self._names, batch.keys, strict=True)}
        )
        return [out[n] for n in self._names]

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        self._group.apply_gradients(
            {
                n: (k, batch.offsets, g)
                for n, k, g in zip(self._names, batch.keys, grads, strict=True)
            }
        )

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        rows = self._tables[table].lookup(batch.keys[table], insert=False)
        return np.asarray(rows), None

    def initial_values(self, table: int, keys: U64Array) -> F32Array:
        """The initializer's rows of ``keys`` in table ``table``."""
        return np.asarray(self._tables[table].initial_values(keys))

    def extra(self) -> dict[str, Any]:
        return dict(self._extra)

    def close(self) -> None:
        self._group = None
        self._tables.clear()
