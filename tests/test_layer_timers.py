"""Named layer timers (embstore.metrics.Timer): one histogram per name, in the report file,
the Prometheus text and the window differences."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import _core
from embstore.metrics import Timer


@pytest.fixture(autouse=True)
def _fresh_window() -> None:
    embstore.metrics.enable(True)
    embstore.metrics.reset()


def test_context_manager_and_decorator_feed_one_histogram() -> None:
    t = Timer("test.Op.Total")

    @Timer("test.Op.Total")
    def work(x: int) -> int:
        return x + 1

    with t, t:  # nested entries of one Timer
        pass
    assert work(1) == 2
    assert t.summary()["count"] == 3
    assert Timer("test.Op.Total").summary()["count"] == 3  # same name, same histogram


def test_record_ns_matches_the_tables_percentile_rule() -> None:
    values = [int(v) for v in np.random.default_rng(3).integers(100, 5_000_000, 500)]
    t = Timer("test.Recorded.Total")
    for v in values:
        t.record_ns(v)
    assert t.summary() == _core.histogram_summary(values)


def test_threads_share_a_timer() -> None:
    t = Timer("test.Threads.Total")

    def run() -> None:
        for _ in range(200):
            with t:
                pass

    threads = [threading.Thread(target=run) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.summary()["count"] == 800


@pytest.mark.parametrize("name", ["", "nodot", ".Lookup", "server.", 3])
def test_bad_names_are_refused(name: object) -> None:
    with pytest.raises((ValueError, TypeError), match="name"):
        Timer(name)  # type: ignore[arg-type]


def test_disabled_metrics_record_nothing() -> None:
    t = Timer("test.Off.Total")
    embstore.metrics.enable(False)
    try:
        with t:
            pass
        t.record_ns(1000)
    finally:
        embstore.metrics.enable(True)
    assert t.summary()["count"] == 0


def test_report_has_layer_lines_next_to_kv_lines(tmp_path: Path) -> None:
    path = str(tmp_path / "perf.log")
    reporter = embstore.metrics.PerfReporter(path, interval_ms=60_000)
    table = embstore.Table(dim=2, capacity=16, name="layered")
    table.lookup(np.arange(3, dtype=np.uint64))
    with Timer("server.Lookup.Handle"):
        pass
    reporter.write_once()
    with Timer("server.Lookup.Handle"):
        pass
    reporter.write_once()
    lines = Path(path).read_text().splitlines()
    parsed = [dict(kv.split("=") for kv in ln.split()[1:]) for ln in lines]
    handle = [p for p in parsed if p["layer"] == "server" and p["name"] == "Lookup.Handle"]
    assert [p["count"] for p in handle] == ["1", "1"]  # one per interval
    assert all(p["table"] == "-" for p in handle)
    assert any(p["layer"] == "kv" and p["table"] == "layered" for p in parsed)
    table.close()


def test_prometheus_text_has_the_layer_family() -> None:
    parser = pytest.importorskip("prometheus_client.parser", reason="prometheus_client absent")
    t = Timer("client.Lookup.RPC")
    t.record_ns(2_000_000)
    families = {
        f.name: f for f in parser.text_string_to_metric_families(embstore.metrics.prometheus_text())
    }
    samples = families["embstore_layer_latency_seconds"].samples
    count = [
        s.value
        for s in samples
        if s.name.endswith("_count") and s.labels == {"layer": "client", "name": "Lookup.RPC"}
    ]
    assert count == [1]


def test_reset_clears_named_timers() -> None:
    t = Timer("test.Reset.Total")
    t.record_ns(500)
    embstore.metrics.reset()
    assert t.summary()["count"] == 0
