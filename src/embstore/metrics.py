"""Latency metrics of every table: per-operation and per-stage histograms.

Each table records, for every call, the duration of the operation (``lookup``,
``lookup_sum``, ``apply_gradients``, ``contains``, ``erase``) and of the stages of a batch
(``stage.validate``, ``stage.plan`` (grouping ids by shard), ``stage.gather`` (index probe +
row copy under the shard locks), ``stage.pool`` (per-bag sums), ``stage.update`` (duplicate
sums + fused optimizer)). A :class:`~embstore.TableGroup` call records its whole duration
into every table it touches. ``Table.stats()["latency"]`` maps each recorded name to
``{"count", "p50_us", "p95_us", "p99_us", "max_us", "mean_us"}``.

Recording is lock-free (relaxed atomic counters in log-linear buckets, 8 per power of two,
so percentiles are exact to within 12.5%; ``max_us`` is exact). Metrics are on unless the
environment has ``EMBSTORE_METRICS=0`` at import, or :func:`enable` turns them off; off,
the timers read no clock at all.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from embstore import _core

if TYPE_CHECKING:
    from embstore.table import Table

__all__ = ["enable", "enabled", "reset"]

_tables: weakref.WeakSet[Table] = weakref.WeakSet()


def register(table: Table) -> None:
    """Track ``table`` so that :func:`reset` reaches it (called by ``Table.__init__``)."""
    _tables.add(table)


def enable(on: bool = True) -> None:
    """Turn latency recording on or off for every table in the process."""
    _core.set_metrics_enabled(bool(on))


def enabled() -> bool:
    """Whether latency recording is on."""
    return bool(_core.metrics_enabled())


def reset() -> None:
    """Start a new window: clear the latency histograms of every open table."""
    for table in list(_tables):
        if not table.closed:
            table.reset_metrics()
