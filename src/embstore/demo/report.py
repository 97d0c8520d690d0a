"""What the demo shows while it trains: log lines, a progress bar and the optional plot."""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import embstore

__all__ = [
    "LogRecord",
    "ProgressBar",
    "check_plot_available",
    "format_record",
    "latency_window",
    "write_plot",
]

#: ``group.stats()`` latency names of the forward and backward calls of a step.
LOOKUP = "group.lookup_sum"
APPLY = "group.apply_gradients"


@dataclass(frozen=True)
class LogRecord:
    """One log line: the window of steps since the previous line."""

    step: int
    epoch: int
    examples: int
    auc: float
    logloss: float
    examples_per_s: float
    latency_us: Mapping[str, float]


def latency_window(group: embstore.TableGroup) -> dict[str, float]:
    """P50/P99 (microseconds) of the group's lookup and apply calls since the last window,
    then start a new window. Empty when metrics are off (``EMBSTORE_METRICS=0``)."""
    names = group.names
    if not names:
        return {}
    # A group call records its whole duration into every table it touches: read one.
    latency = group[names[0]].stats()["latency"]
    out: dict[str, float] = {}
    for label, name in (("lookup", LOOKUP), ("apply", APPLY)):
        h = latency.get(name)
        if h and h["count"]:
            out[f"{label}_p50_us"] = float(h["p50_us"])
            out[f"{label}_p99_us"] = float(h["p99_us"])
    for table in group.values():
        table.reset_metrics()
    return out


def _number(x: float, digits: int) -> str:
    return "nan" if math.isnan(x) else f"{x:.{digits}f}"


def format_record(r: LogRecord) -> str:
    """``step=.. epoch=.. examples=.. auc=.. logloss=.. examples_per_s=.. lookup_p50_us=..``."""
    parts = [
        f"step={r.step}",
        f"epoch={r.epoch}",
        f"examples={r.examples}",
        f"auc={_number(r.auc, 4)}",
        f"logloss={_number(r.logloss, 4)}",
        f"examples_per_s={r.examples_per_s:.0f}",
    ]
    parts += [f"{k}={v:.1f}" for k, v in r.latency_us.items()]
    return " ".join(parts)


class ProgressBar:
    """A one-line progress bar on a terminal, redrawn at most ``hz`` times a second.

    Disabled (every method a no-op) when ``enabled`` is false or ``stream`` is not a tty.
    """

    def __init__(
        self, total: int, *, stream: TextIO | None = None, enabled: bool = True, hz: float = 10.0
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.total = max(1, total)
        self.enabled = enabled and _isatty(self.stream)
        self._interval = 1.0 / hz
        self._last = 0.0
        self._shown = False

    def update(self, done: int, note: str = "", *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < self._interval:
            return
        self._last = now
        frac = min(1.0, done / self.total)
        width = 30
        fill = int(frac * width)
        bar = "=" * fill + (">" if fill < width else "") + " " * (width - fill - 1)
        self.stream.write(f"\r[{bar}] {frac:4.0%} {done}/{self.total} steps {note}\x1b[K")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        """Erase the bar (before a log line is printed, and at the end)."""
        if self.enabled and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def check_plot_available() -> str | None:
    """None when matplotlib can be imported, else the error message for ``--plot``."""
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install matplotlib (or 'embstore[plot]')"
    return None


def write_plot(path: str, records: Sequence[LogRecord], title: str) -> None:
    """AUC and throughput over the steps, one panel each, as an image file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig: Any
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    top.plot(steps, [r.auc for r in records], marker=".")
    top.set_ylabel("streaming AUC")
    top.grid(True, alpha=0.3)
    bottom.plot(steps, [r.examples_per_s for r in records], marker=".", color="tab:green")
    bottom.set_ylabel("examples/s")
    bottom.set_xlabel("step")
    bottom.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
