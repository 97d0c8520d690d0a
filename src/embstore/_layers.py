"""Named layer timers: ``embstore.metrics.Timer`` and the report and Prometheus lines of the
layers around the store (trainer, client, RPC, server).

Each name ``"<layer>.<rest>"`` owns one process-wide histogram in the C++ core, of the same
kind the tables use (log-linear buckets, lock-free recording), so a C++ server's
``embstore::metrics::ScopedTimer`` and a Python ``Timer`` of the same name feed one
histogram. The store itself is the layer ``kv`` in the reports.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from embstore import _core

if TYPE_CHECKING:  # typing.Self needs Python 3.11
    from typing_extensions import Self

__all__ = ["Timer", "layer_lines", "layer_prometheus", "split_name"]

F = TypeVar("F", bound=Callable[..., Any])


def split_name(name: str) -> tuple[str, str]:
    """``"server.Lookup.Handle"`` -> ``("server", "Lookup.Handle")``."""
    layer, _, rest = name.partition(".")
    return layer, rest


class Timer:
    """A named latency timer: ``with Timer("server.Lookup.Handle"): ...`` or as a decorator
    ``@Timer("client.Lookup.Total")``.

    The name is ``"<layer>.<name>"``; every Timer of one name records into the same
    histogram, which appears in :func:`embstore.metrics.prometheus_text`, the
    ``EMBSTORE_PERF_REPORT_PATH`` report (``layer=<layer> table=- name=<name>``) and a PS
    server's ``Stats``. One Timer may be entered from many threads at once, and nested.
    Nothing is recorded while metrics are off (:func:`embstore.metrics.enable`).

    Raises
    ------
    ValueError
        If ``name`` has no ``"<layer>."`` prefix or nothing after it.
    """

    __slots__ = ("_histogram", "_local", "layer", "name")

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            msg = f"name must be a str, got {type(name).__name__}"
            raise TypeError(msg)
        self._histogram = _core.named_histogram(name)
        self.name = name
        self.layer = split_name(name)[0]
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"<embstore.metrics.Timer {self.name!r}>"

    def record_ns(self, ns: int) -> None:
        """Record a duration measured elsewhere (e.g. a queueing delay), in nanoseconds."""
        self._histogram.record(max(0, int(ns)))

    def summary(self) -> dict[str, float]:
        """``{"count", "p50_us", "p95_us", "p99_us", "max_us", "mean_us"}`` since the last
        :func:`embstore.metrics.reset`."""
        summary: dict[str, float] = _core.summarize_histograms(
            _core.HistogramSnapshot(), self._histogram.snapshot()
        )
        return summary

    def __enter__(self) -> Self:
        starts = getattr(self._local, "starts", None)
        if starts is None:
            starts = self._local.starts = []
        starts.append(time.perf_counter_ns())
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter_ns()
        self._histogram.record(end - self._local.starts.pop())

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return timed  # type: ignore[return-value]


def _line(stamp: str, name: str, h: dict[str, Any]) -> str:
    layer, rest = split_name(name)
    return (
        f"{stamp} layer={layer} table=- name={rest} count={h['count']} "
        f"p50_us={h['p50_us']:.1f} p95_us={h['p95_us']:.1f} "
        f"p99_us={h['p99_us']:.1f} max_us={h['max_us']:.1f}"
    )


class LayerWindows:
    """Named-histogram snapshots: each :meth:`lines` call covers what was recorded since the
    previous one (the periodic report's interval)."""

    def __init__(self) -> None:
        self._last: dict[str, _core.HistogramSnapshot] = {}

    def lines(self, stamp: str) -> list[str]:
        out = []
        for name, snap in _core.named_histograms():
            before = self._last.get(name, _core.HistogramSnapshot())
            self._last[name] = snap
            h = _core.summarize_histograms(before, snap)
            if h["count"]:
                out.append(_line(stamp, name, h))
        return out


def layer_lines(stamp: str) -> list[str]:
    """Report lines of every named timer since the last reset (cumulative)."""
    empty = _core.HistogramSnapshot()
    out = []
    for name, snap in _core.named_histograms():
        h = _core.summarize_histograms(empty, snap)
        if h["count"]:
            out.append(_line(stamp, name, h))
    return out


def layer_prometheus(label: Callable[[str], str]) -> list[str]:
    """The ``embstore_layer_latency_seconds`` summary family of every named timer."""
    out = [
        "# HELP embstore_layer_latency_seconds latency of the layers around the store",
        "# TYPE embstore_layer_latency_seconds summary",
    ]
    empty = _core.HistogramSnapshot()
    for name, snap in _core.named_histograms():
        h = _core.summarize_histograms(empty, snap)
        if not h["count"]:
            continue
        layer, rest = split_name(name)
        labels = f'layer="{label(layer)}",name="{label(rest)}"'
        metric = "embstore_layer_latency_seconds"
        for q, k in (("0.5", "p50_us"), ("0.95", "p95_us"), ("0.99", "p99_us")):
            out.append(f'{metric}{{{labels},quantile="{q}"}} {h[k] / 1e6:.9f}')
        out.append(f"{metric}_count{{{labels}}} {h['count']}")
        out.append(f"{metric}_sum{{{labels}}} {h['mean_us'] * h['count'] / 1e6:.9f}")
    return out
