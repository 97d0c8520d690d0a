"""Merged metrics of a sharded store: counters summed per table, latency histograms added
bucket by bucket across shards before percentiles are taken (an average of P99s is not a
P99), and the client's own layers (route, round trips, reduce) in the same histograms."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _core

__all__ = ["Layers", "merge", "raw_buckets"]

#: Per-table stats that describe the table, not counts: taken from shard 0.
_SAME = ("dim", "row_stride", "bytes_per_row")

Raw = tuple[npt.NDArray[np.uint64], int, int]  # bucket counts, sum_ns, max_ns


def raw_buckets(tables: dict[str, Any]) -> dict[str, dict[str, Raw]]:
    """name -> timer -> raw histogram, for every open table of a shard."""
    out = {}
    for name, table in tables.items():
        impl = table._internals().core
        if impl is not None:
            out[name] = dict(_core.timer_buckets(impl))
    return out


def _add(acc: dict[str, Raw], timer: str, raw: Raw) -> None:
    counts, total, top = raw
    if timer in acc:
        c0, t0, m0 = acc[timer]
        acc[timer] = (c0 + counts, t0 + int(total), max(m0, int(top)))
    else:
        acc[timer] = (np.array(counts, dtype=np.uint64), int(total), int(top))


def _summaries(hists: dict[str, Raw]) -> dict[str, dict[str, float]]:
    return {t: dict(_core.summarize_buckets(c, s, m)) for t, (c, s, m) in sorted(hists.items())}


class Layers:
    """Client-side latency histograms (the core's buckets), one per layer name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hists: dict[str, list[Any]] = {}

    def record(self, name: str, ns: int) -> None:
        ns = max(0, int(ns))
        bucket = int(_core.latency_bucket_of(ns))
        with self._lock:
            h = self._hists.get(name)
            if h is None:
                h = self._hists[name] = [np.zeros(int(_core.LATENCY_BUCKETS), np.uint64), 0, 0]
            h[0][bucket] += 1
            h[1] += ns
            h[2] = max(h[2], ns)

    def summaries(self) -> dict[str, dict[str, float]]:
        with self._lock:
            hists = {n: (h[0].copy(), h[1], h[2]) for n, h in self._hists.items()}
        return _summaries(hists)


def merge(per_shard: Sequence[dict[str, Any]], layers: Layers) -> dict[str, Any]:
    """``{"tables": {name: summed counters + merged "latency"}, "client": {layer: summary},
    "shards": [each shard's Table.stats() per table]}``."""
    tables: dict[str, dict[str, Any]] = {}
    hists: dict[str, dict[str, Raw]] = {}
    for shard_stats in per_shard:
        for name, st in shard_stats["tables"].items():
            acc = tables.setdefault(name, {})
            for key, value in st.items():
                if key == "latency" or isinstance(value, dict):
                    continue
                if key in _SAME:
                    acc.setdefault(key, value)
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    acc[key] = acc.get(key, 0) + value
        for name, timers in shard_stats["raw"].items():
            for timer, raw in timers.items():
                _add(hists.setdefault(name, {}), timer, raw)
    for name, acc in tables.items():
        acc["latency"] = _summaries(hists.get(name, {}))
    return {
        "tables": tables,
        "client": layers.summaries(),
        "shards": [s["tables"] for s in per_shard],
    }
