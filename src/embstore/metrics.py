"""Metrics of every table: counters, per-operation and per-stage latency histograms, a
periodic report file and a Prometheus text export.

Latency: each table records, for every call, the duration of the operation (``lookup``,
``lookup_sum``, ``apply_gradients``, ``contains``, ``erase``) and of the stages of a batch
(``stage.validate``; ``stage.gather``: lookups' lock-free index probe, row read and per-bag
sums; ``stage.plan``: grouping ids by shard; ``stage.locked_gather`` and ``stage.pool``: a
lookup that must insert (or raced with a writer, or tracks steps) redone under the shard
locks, then pooled; ``stage.update``: apply's duplicate sums + fused optimizer under the
shard locks; ``stage.wait``: the time the calling thread spent waiting for helper threads
after running out of tasks, summed over the call's stages: load imbalance), and of checkpoints (``save``: a save or save_delta from its start to the file
being durable; ``load``: a Table.load). A :class:`~embstore.TableGroup` call records its whole duration
into every table it touches, as ``group.lookup_sum`` / ``group.apply_gradients``. ``Table.stats()["latency"]`` maps each recorded name to
``{"count", "p50_us", "p95_us", "p99_us", "max_us", "mean_us"}``. Recording is lock-free
(relaxed atomic counters in log-linear buckets, 8 per power of two, so percentiles are
exact to within 12.5%; ``max_us`` is exact).

Counters (``Table.stats()``), kept per shard and summed on read: size, capacity, hits,
misses, inserts, evictions, erased, lock_waits and lock_wait_us (shard-lock acquisitions
that had to block, and their total wait), reused_rows (applied ids whose row came from
the training lookup before, see docs/semantics.md), read_retries (lock-free read tasks a
concurrent writer got in the way of, redone row by row), arena_bytes_in_use.

Switches, read at import:

- ``EMBSTORE_METRICS=0``: latency timers off (no clock is read); :func:`enable` toggles.
- ``EMBSTORE_PERF_REPORT_PATH=file``: a daemon thread appends, every
  ``EMBSTORE_PERF_INTERVAL_MS`` (default 5000) milliseconds, one line per table and name
  recorded during that interval: ``<unix time> table=<t> name=<n> count=<c> p50_us=..
  p95_us=.. p99_us=.. max_us=..`` (after the stamp, ``layer=kv`` for the tables, and
  ``layer=<layer> table=-`` for :class:`Timer`'s named layer timers) describing only the calls of that interval (the difference
  of two snapshots of the histograms; ``max_us`` is exact when the interval set a new
  maximum, else the upper bound of its highest bucket). It only reads the lock-free
  histograms, so it never blocks a call, and it stops at interpreter exit.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from embstore import _core
from embstore._layers import LayerWindows, Timer, layer_lines, layer_prometheus


class _Tracked(Protocol):
    """What metrics needs of a table (its internals, which register themselves)."""

    name: str
    core: _core.Table | None


__all__ = [
    "PerfReporter",
    "Timer",
    "enable",
    "enabled",
    "merge_histograms",
    "prometheus_text",
    "register_prometheus_collector",
    "report_lines",
    "reset",
    "summarize_histogram",
]

_tables: weakref.WeakSet[_Tracked] = weakref.WeakSet()
_ids = itertools.count()


def register(table: _Tracked) -> str:
    """Track ``table`` for :func:`reset` and the reports; returns a default name for it."""
    _tables.add(table)
    return f"table{next(_ids)}"


def _open_tables() -> list[_Tracked]:
    return sorted((t for t in list(_tables) if t.core is not None), key=lambda t: t.name)


def enable(on: bool = True) -> None:
    """Turn latency recording on or off for every table in the process."""
    _core.set_metrics_enabled(bool(on))


def enabled() -> bool:
    """Whether latency recording is on."""
    return bool(_core.metrics_enabled())


def reset() -> None:
    """Start a new window: clear the latency histograms of every open table and every
    named :class:`Timer`."""
    for table in _open_tables():
        core = table.core
        if core is not None:  # else closed meanwhile
            core.reset_timers()
    _core.reset_named_histograms()


def _stats(table: _Tracked) -> dict[str, Any] | None:
    core = table.core
    return None if core is None else dict(core.stats())  # None: closed meanwhile


def _format_lines(stamp: str, table: _Tracked, latency: dict[str, Any]) -> list[str]:
    return [
        f"{stamp} layer=kv table={table.name} name={name} count={h['count']} "
        f"p50_us={h['p50_us']:.1f} p95_us={h['p95_us']:.1f} "
        f"p99_us={h['p99_us']:.1f} max_us={h['max_us']:.1f}"
        for name, h in sorted(latency.items())
    ]


def report_lines(now: float | None = None) -> list[str]:
    """Lines for every open table's latency since the last :func:`reset` (cumulative); the
    periodic report uses :class:`PerfReporter`'s per-interval windows instead."""
    stamp = f"{time.time() if now is None else now:.3f}"
    lines = []
    for table in _open_tables():
        st = _stats(table)
        if st is None:
            continue
        lines += _format_lines(stamp, table, st["latency"])
    return lines + layer_lines(stamp)


class _Windows:
    """Per-table histogram snapshots: each call returns what was recorded since the last."""

    def __init__(self) -> None:
        self._last: weakref.WeakKeyDictionary[_Tracked, _core.TimerSnapshot] = (
            weakref.WeakKeyDictionary()
        )
        self._layers = LayerWindows()

    def lines(self, now: float | None = None) -> list[str]:
        stamp = f"{time.time() if now is None else now:.3f}"
        lines = []
        for table in _open_tables():
            impl = table.core
            if impl is None:  # closed meanwhile
                continue
            snap = impl.timer_snapshot()
            # First sight of a table: everything it recorded so far (an empty snapshot).
            before = self._last.get(table, _core.TimerSnapshot())
            self._last[table] = snap
            lines += _format_lines(stamp, table, _core.latency_between(before, snap))
        return lines + self._layers.lines(stamp)


class PerfReporter:
    """A daemon thread appending, every ``interval_ms``, one line per table and name for the
    calls recorded during that interval (see the module docstring)."""

    def __init__(self, path: str, interval_ms: float = 5000.0) -> None:
        if interval_ms <= 0:
            msg = f"interval_ms must be positive, got {interval_ms!r}"
            raise ValueError(msg)
        self.path = path
        self.interval_s = interval_ms / 1000.0
        self._windows = _Windows()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="embstore-perf-report", daemon=True)

    def start(self) -> PerfReporter:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write_once()

    def write_once(self) -> None:
        """Append the lines of the interval that ends now."""
        lines = self._windows.lines()
        if lines:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")

    def stop(self) -> None:
        """Stop the thread (waits for an append in progress)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(1.0, 2 * self.interval_s))


def _start_reporter_from_environment() -> PerfReporter | None:
    path = os.environ.get("EMBSTORE_PERF_REPORT_PATH")
    if not path:
        return None
    interval = float(os.environ.get("EMBSTORE_PERF_INTERVAL_MS", "5000"))
    reporter = PerfReporter(path, interval).start()
    atexit.register(reporter.stop)
    return reporter


_reporter = _start_reporter_from_environment()

# -- Prometheus -------------------------------------------------------------------------

_COUNTERS = (
    ("hits", "counter", "lookups that found their id"),
    ("misses", "counter", "lookups that did not find their id"),
    ("inserts", "counter", "rows inserted"),
    ("evictions", "counter", "rows evicted by CLOCK"),
    ("erased", "counter", "rows removed by erase"),
    ("lock_waits", "counter", "shard-lock acquisitions that had to wait"),
    ("reused_rows", "counter", "applied ids whose row the lookup before had resolved"),
    ("read_retries", "counter", "lock-free read tasks redone row by row after a writer raced"),
    ("size", "gauge", "rows present"),
    ("capacity", "gauge", "most rows the table holds"),
    ("arena_bytes_in_use", "gauge", "bytes of arena rows ever claimed"),
)


def merge_histograms(parts: Sequence[Any]) -> Any:
    """Latency histogram snapshots (``ShardedTableGroup.stats()["raw"]`` entries, say of
    several trainers' stores) added bucket by bucket: one snapshot."""
    return _core.merge_histograms(list(parts))


def summarize_histogram(snapshot: Any) -> dict[str, Any]:
    """A histogram snapshot's count, mean, percentiles and max, as in
    ``Table.stats()["latency"]``."""
    return dict(_core.summarize_histograms(_core.HistogramSnapshot(), snapshot))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text() -> str:
    """Counters and latency summaries of every open table in the Prometheus text format
    (version 0.0.4), labelled by ``table`` (and ``name`` for latencies)."""
    tables = [(t.name, s) for t in _open_tables() if (s := _stats(t)) is not None]
    return format_prometheus([(f'table="{_label(name)}"', st) for name, st in tables])


def format_prometheus(entries: list[tuple[str, dict[str, Any]]]) -> str:
    """The Prometheus text of ``Table.stats()`` dicts, each with its label string (e.g.
    ``shard="0",table="user"``: a sharded store labels every shard's tables)."""
    out: list[str] = []
    # Text format 0.0.4: TYPE names the sample name itself (counters end in _total).
    for key, kind, help_text in _COUNTERS:
        metric = f"embstore_{key}_total" if kind == "counter" else f"embstore_{key}"
        out.append(f"# HELP {metric} {help_text}")
        out.append(f"# TYPE {metric} {kind}")
        for labels, st in entries:
            out.append(f"{metric}{{{labels}}} {st[key]}")
    out.append("# HELP embstore_lock_wait_seconds_total time spent waiting for shard locks")
    out.append("# TYPE embstore_lock_wait_seconds_total counter")
    for labels, st in entries:
        out.append(f"embstore_lock_wait_seconds_total{{{labels}}} {st['lock_wait_us'] / 1e6:.9f}")
    out.append("# HELP embstore_latency_seconds latency of operations and batch stages")
    out.append("# TYPE embstore_latency_seconds summary")
    for table_labels, st in entries:
        for op, h in sorted(st["latency"].items()):
            labels = f'{table_labels},name="{_label(op)}"'
            for q, k in (("0.5", "p50_us"), ("0.95", "p95_us"), ("0.99", "p99_us")):
                out.append(f'embstore_latency_seconds{{{labels},quantile="{q}"}} {h[k] / 1e6:.9f}')
            out.append(f"embstore_latency_seconds_count{{{labels}}} {h['count']}")
            out.append(
                f"embstore_latency_seconds_sum{{{labels}}} {h['mean_us'] * h['count'] / 1e6:.9f}"
            )
    out += layer_prometheus(_label)
    return "\n".join(out) + "\n"


def register_prometheus_collector(registry: Any = None) -> Any:
    """Register a collector that serves :func:`prometheus_text` through ``prometheus_client``
    (an optional dependency) in ``registry`` (default: its global REGISTRY); returns it."""
    from prometheus_client.core import REGISTRY
    from prometheus_client.parser import text_string_to_metric_families

    class _Collector:
        def collect(self) -> Any:
            yield from text_string_to_metric_families(prometheus_text())

    collector = _Collector()
    (REGISTRY if registry is None else registry).register(collector)
    return collector
