"""Merged metrics of a sharded store: counters summed per table, latency histograms added
bucket by bucket across shards before percentiles are taken (an average of P99s is not a
P99), and the client's own layers (route, round trips, reduce) in the same histograms."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from embstore import _core, metrics

__all__ = ["Layers", "merge", "raw_buckets"]

#: Per-table stats that describe the table, not counts: taken from shard 0.
_SAME = ("dim", "row_stride", "bytes_per_row")


def raw_buckets(tables: dict[str, Any]) -> dict[str, dict[str, _core.HistogramSnapshot]]:
    """name -> timer -> histogram snapshot (picklable), for every open table of a shard."""
    out = {}
    for name, table in tables.items():
        impl = table._internals().core
        if impl is not None:
            out[name] = dict(_core.table_histograms(impl))
    return out


def _summaries(hists: dict[str, _core.HistogramSnapshot]) -> dict[str, dict[str, float]]:
    """timer -> summary of its histogram; timers nothing recorded are left out."""
    out = {}
    for timer, snap in sorted(hists.items()):
        summary = metrics.summarize_histogram(snap)
        if summary["count"]:
            out[timer] = summary
    return out


class Layers:
    """Client-side latency histograms (standalone core histograms), one per layer name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hists: dict[str, _core.LatencyHistogram] = {}

    def record(self, name: str, ns: int) -> None:
        h = self._hists.get(name)
        if h is None:
            with self._lock:
                h = self._hists.setdefault(name, _core.LatencyHistogram())
        h.record(max(0, int(ns)))

    def snapshots(self) -> dict[str, _core.HistogramSnapshot]:
        with self._lock:
            return {n: h.snapshot() for n, h in self._hists.items()}


def merge(per_shard: Sequence[dict[str, Any]], layers: Layers) -> dict[str, Any]:
    """``{"tables": {name: summed counters + merged "latency"}, "client": {layer: summary},
    "shards": [each shard's Table.stats() per table], "raw": {"tables": {name: {timer:
    merged histogram}}, "client": {layer: histogram}}}`` (raw: picklable snapshots, to
    merge further, e.g. over several trainers' clients)."""
    tables: dict[str, dict[str, Any]] = {}
    hists: dict[str, dict[str, list[_core.HistogramSnapshot]]] = {}
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
            for timer, snap in timers.items():
                hists.setdefault(name, {}).setdefault(timer, []).append(snap)
    merged = {
        name: {t: metrics.merge_histograms(parts) for t, parts in timers.items()}
        for name, timers in hists.items()
    }
    for name, acc in tables.items():
        acc["latency"] = _summaries(merged.get(name, {}))
    client = layers.snapshots()
    return {
        "tables": tables,
        "client": _summaries(client),
        "shards": [s["tables"] for s in per_shard],
        "raw": {"tables": merged, "client": client},
    }
