"""Merging the shards' stats: counters are summed per table; latency stays per shard.

The core exposes only per-table latency summaries (percentiles), not the raw histogram
buckets, and percentiles cannot be merged (an average of P99s is not a P99). So
``stats()["tables"][name]["latency"]`` is absent and each shard's summaries are under
``stats()["shards"]``; merging needs the core to expose the buckets (see docs/ray.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["merge"]

#: Per-table stats that describe the table, not counts: taken from shard 0.
_SAME = ("dim", "row_stride", "bytes_per_row")


def merge(per_shard: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """``{"tables": {name: summed counters}, "shards": per_shard}``."""
    tables: dict[str, dict[str, Any]] = {}
    for shard_stats in per_shard:
        for name, st in shard_stats.items():
            acc = tables.setdefault(name, {})
            for key, value in st.items():
                if key == "latency" or isinstance(value, dict):
                    continue
                if key in _SAME:
                    acc.setdefault(key, value)
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    acc[key] = acc.get(key, 0) + value
    return {"tables": tables, "shards": list(per_shard)}
