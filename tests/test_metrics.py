"""Latency metrics: histogram percentiles, per-operation and per-stage counts, the on/off
switch, reset, and lock-free recording under threads (embstore.metrics)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import _core

OPS = ("lookup", "lookup_sum", "apply_gradients", "contains", "erase")


@pytest.fixture(autouse=True)
def _metrics_on() -> Iterator[None]:
    """Every test starts (and ends) with metrics on."""
    embstore.metrics.enable(True)
    yield
    embstore.metrics.enable(True)


def _table(**kw: object) -> embstore.Table:
    return embstore.Table(dim=4, capacity=4096, optimizer=embstore.SGD(lr=0.1), **kw)  # type: ignore[arg-type]


def _run_in_threads(work: Callable[[], None], count: int) -> None:
    """Run ``work`` on ``count`` threads at once and wait for all of them."""
    threads = [threading.Thread(target=work) for _ in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)


def _exercise(t: embstore.Table, rounds: int) -> None:
    keys = np.arange(600, dtype=np.uint64)
    offsets = np.arange(0, 601, 3)
    for _ in range(rounds):
        t.lookup(keys)
        t.lookup_sum(keys, offsets)
        t.apply_gradients(keys, np.ones((200, 4), np.float32), offsets=offsets)
        t.contains(keys)
        t.erase(keys[:1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_percentiles_are_within_one_bucket_of_the_exact_quantile(seed: int) -> None:
    """Each reported percentile is >= the exact quantile and at most 12.5% above it (one
    log-linear bucket), capped by the exact maximum; count and max are exact."""
    rng = np.random.default_rng(seed)
    values = np.concatenate(
        [rng.integers(200, 5_000, 900), rng.integers(5_000, 2_000_000, 100)]
    ).astype(np.int64)
    s = _core.histogram_summary([int(v) for v in values])
    assert s["count"] == values.size
    assert s["max_us"] == pytest.approx(values.max() / 1000.0)
    assert s["mean_us"] == pytest.approx(values.mean() / 1000.0, rel=1e-9)
    ordered = np.sort(values)
    for q, key in ((0.50, "p50_us"), (0.95, "p95_us"), (0.99, "p99_us")):
        exact = ordered[int(np.ceil(q * values.size)) - 1] / 1000.0
        assert exact <= s[key] <= min(exact * 1.125 + 1e-9, s["max_us"]), (q, exact, s[key])


def test_tail_shows_in_p99_not_p50() -> None:
    """99 fast calls and one slow one: P50 is fast; P99 (the 99th value) still fast; max
    shows the outlier. With 2 slow calls in 100, P99 is slow."""
    one_slow = _core.histogram_summary([1_000] * 99 + [5_000_000])
    assert one_slow["p50_us"] < 1.2
    assert one_slow["p99_us"] < 1.2
    assert one_slow["max_us"] == pytest.approx(5000.0)
    two_slow = _core.histogram_summary([1_000] * 98 + [5_000_000] * 2)
    assert two_slow["p99_us"] > 4000


def test_every_operation_and_stage_is_counted() -> None:
    t = _table()
    _exercise(t, rounds=7)
    lat = t.stats()["latency"]
    for op in OPS:
        assert lat[op]["count"] == 7, op
    # lookup and lookup_sum both run validate/gather (lock-free); each round's lookup must
    # insert the erased id, so it also runs plan/locked_gather (ids one per "bag": no pool);
    # apply runs validate/plan/update.
    assert lat["stage.validate"]["count"] == 21
    assert lat["stage.gather"]["count"] == 14
    assert lat["stage.locked_gather"]["count"] == 7
    assert lat["stage.plan"]["count"] == 14
    assert lat["stage.update"]["count"] == 7
    assert "stage.pool" not in lat
    for entry in lat.values():
        assert 0 < entry["p50_us"] <= entry["p95_us"] <= entry["p99_us"] <= entry["max_us"]


def test_group_calls_are_recorded_in_every_table() -> None:
    a, b = _table(), _table()
    g = embstore.TableGroup({"a": a, "b": b})
    keys, offsets = np.arange(10, dtype=np.uint64), np.arange(0, 11, 5)
    for _ in range(3):
        g.lookup_sum({"a": (keys, offsets), "b": (keys, offsets)})
        g.apply_gradients({"a": (keys, offsets, np.ones((2, 4), np.float32))})
    stats = g.stats()
    assert set(stats) == {"a", "b"}
    assert stats["a"]["latency"]["group.lookup_sum"]["count"] == 3
    assert stats["b"]["latency"]["group.lookup_sum"]["count"] == 3
    assert stats["a"]["latency"]["group.apply_gradients"]["count"] == 3
    assert "group.apply_gradients" not in stats["b"]["latency"]
    assert "lookup_sum" not in stats["a"]["latency"]  # group calls have their own names
    assert stats["a"]["latency"]["stage.gather"]["count"] == 3


def test_disabled_metrics_record_nothing_and_resume() -> None:
    t = _table()
    _exercise(t, rounds=2)
    before = t.stats()["latency"]
    embstore.metrics.enable(False)
    assert not embstore.metrics.enabled()
    _exercise(t, rounds=3)
    assert t.stats()["latency"] == before
    embstore.metrics.enable(True)
    _exercise(t, rounds=1)
    assert t.stats()["latency"]["lookup"]["count"] == 3


def test_reset_starts_a_new_window_for_every_open_table() -> None:
    a, b, c = _table(), _table(), _table()
    for t in (a, b, c):
        _exercise(t, rounds=2)
    c.close()
    embstore.metrics.reset()
    assert a.stats()["latency"] == {}
    assert b.stats()["latency"] == {}
    assert a.stats()["inserts"] > 0  # counters are not latency: they stay
    _exercise(a, rounds=1)
    assert a.stats()["latency"]["lookup"]["count"] == 1


def test_concurrent_recording_loses_nothing() -> None:
    """8 threads x 200 lookups each: exactly 1600 lookups recorded (lock-free counters)."""
    t = _table(num_threads=2)
    keys = np.arange(64, dtype=np.uint64)
    t.lookup(keys)
    t.reset_metrics()

    def work() -> None:
        for _ in range(200):
            t.lookup(keys, insert=False)

    _run_in_threads(work, 8)
    assert t.stats()["latency"]["lookup"]["count"] == 1600


def test_environment_switch_turns_metrics_off() -> None:
    """EMBSTORE_METRICS=0 in the environment: off from the start, nothing recorded."""
    code = (
        "import numpy as np, embstore\n"
        "t = embstore.Table(dim=2, capacity=16)\n"
        "t.lookup(np.arange(4, dtype=np.uint64))\n"
        "print(embstore.metrics.enabled(), t.stats()['latency'])\n"
    )
    env = dict(os.environ, EMBSTORE_METRICS="0")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "{}"]


def test_counters_lock_waits_and_arena_bytes() -> None:
    """arena_bytes_in_use = rows claimed x row bytes; lock waits are counted under
    contention (8 threads on one shard) and their time is positive when counted."""
    t = embstore.Table(dim=8, capacity=1000, num_shards=1, optimizer=embstore.SGD(lr=0.1))
    st0 = t.stats()
    assert st0["arena_bytes_in_use"] == 0
    assert st0["lock_waits"] == 0
    keys = np.arange(100, dtype=np.uint64)
    t.lookup(keys)
    st = t.stats()
    assert st["arena_bytes_in_use"] == 100 * st["row_stride"] * 4
    t.erase(keys[:10])
    t.lookup(keys[:10])  # reuses the freed rows: no new arena rows
    assert t.stats()["arena_bytes_in_use"] == 100 * st["row_stride"] * 4

    def work() -> None:
        for _ in range(300):
            t.lookup(keys, insert=False)

    _run_in_threads(work, 8)
    st = t.stats()
    assert st["lock_waits"] >= 0
    assert (st["lock_waits"] == 0) == (st["lock_wait_us"] == 0)


def test_prometheus_text_parses_and_matches_stats() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    t = embstore.Table(dim=4, capacity=64, optimizer=embstore.SGD(lr=0.1), name='we"ird')
    g = embstore.TableGroup({"user": _table()})
    t.lookup(np.arange(5, dtype=np.uint64))
    g.lookup_sum({"user": (np.arange(6, dtype=np.uint64), np.array([0, 3, 6]))})
    text = embstore.metrics.prometheus_text()
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    inserts = {s.labels["table"]: s.value for s in families["embstore_inserts"].samples}
    assert inserts['we"ird'] == 5
    assert inserts["user"] == 6
    lat = [
        s
        for s in families["embstore_latency_seconds"].samples
        if s.labels.get("table") == "user" and s.labels.get("name") == "group.lookup_sum"
    ]
    by_kind = {(s.name, s.labels.get("quantile")): s.value for s in lat}
    assert by_kind[("embstore_latency_seconds_count", None)] == 1
    p50 = g["user"].stats()["latency"]["group.lookup_sum"]["p50_us"] / 1e6
    assert by_kind[("embstore_latency_seconds", "0.5")] == pytest.approx(p50, rel=1e-6)
    t.close()


def test_report_file_gets_lines_within_two_intervals(tmp_path: Path) -> None:
    """EMBSTORE_PERF_REPORT_PATH set: within two intervals the file has one line per
    recorded name, in the documented format; the process exits cleanly."""
    path = os.path.join(str(tmp_path), "perf.log")
    code = (
        "import time, numpy as np, embstore\n"
        "t = embstore.Table(dim=2, capacity=64, name='clicks')\n"
        "t.lookup(np.arange(4, dtype=np.uint64))\n"
        "t.lookup_sum(np.arange(4, dtype=np.uint64), np.array([0, 2, 4]))\n"
        "time.sleep(0.5)\n"  # two intervals of 200 ms, plus slack
    )
    env = dict(os.environ, EMBSTORE_PERF_REPORT_PATH=path, EMBSTORE_PERF_INTERVAL_MS="200")
    env.pop("EMBSTORE_METRICS", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    names = {ln.split()[3] for ln in lines}
    assert {"name=lookup", "name=lookup_sum", "name=stage.gather"} <= names
    for ln in lines:
        stamp, layer, table, *rest = ln.split()
        assert float(stamp) > 1e9
        assert layer == "layer=kv"
        assert table == "table=clicks"
        fields = dict(kv.split("=") for kv in rest)
        assert set(fields) == {"name", "count", "p50_us", "p95_us", "p99_us", "max_us"}
        assert int(fields["count"]) >= 1
        assert float(fields["p50_us"]) <= float(fields["p99_us"]) <= float(fields["max_us"])


def test_prometheus_collector_serves_the_tables() -> None:
    """register_prometheus_collector: a prometheus_client registry exposes embstore's
    counters and latency summaries (prometheus_client is an optional extra)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    embstore.metrics.register_prometheus_collector(registry)
    t = embstore.Table(dim=2, capacity=32, name="scraped")
    t.lookup(np.arange(3, dtype=np.uint64))
    exposed = prometheus_client.generate_latest(registry).decode()
    assert 'embstore_inserts_total{table="scraped"} 3.0' in exposed
    assert 'embstore_latency_seconds_count{name="lookup",table="scraped"} 1.0' in exposed


def test_periodic_report_covers_each_interval_only(tmp_path: Path) -> None:
    """The reporter's lines describe the calls of their own interval: counts restart every
    interval, a quiet interval writes nothing, and a reset() in between is handled."""
    path = os.path.join(str(tmp_path), "perf.log")
    t = embstore.Table(dim=2, capacity=64, name="windowed")
    keys = np.arange(4, dtype=np.uint64)
    reporter = embstore.metrics.PerfReporter(path, interval_ms=60_000)  # never fires alone

    def counts() -> dict[str, int]:
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if "table=windowed" in ln]
        open(path, "w").close()
        out = {}
        for ln in lines:
            fields = dict(kv.split("=") for kv in ln.split()[3:])
            assert float(fields["p50_us"]) <= float(fields["p99_us"]) <= float(fields["max_us"])
            out[fields["name"]] = int(fields["count"])
        return out

    for _ in range(3):
        t.lookup(keys)
    reporter.write_once()
    assert counts()["lookup"] == 3
    for _ in range(2):
        t.lookup(keys)
    reporter.write_once()
    assert counts()["lookup"] == 2  # not 5: only this interval
    reporter.write_once()
    assert counts() == {}  # a quiet interval
    t.lookup(keys)
    embstore.metrics.reset()
    t.lookup(keys)
    reporter.write_once()
    assert counts()["lookup"] == 1  # what came after the reset
    assert t.stats()["latency"]["lookup"]["count"] == 1
    t.close()


def test_waiting_for_workers_is_timed() -> None:
    """A batch split over helper threads records ``stage.wait`` (the caller waiting for
    helpers after its own tasks), never more than the whole call."""
    t = embstore.Table(dim=8, capacity=100_000, num_threads=2, name="waits")
    keys = np.arange(50_000, dtype=np.uint64)
    for _ in range(5):
        t.lookup_sum(keys, np.arange(0, 50_001, 8))
        t.apply_gradients(keys[:8192], np.ones((8192, 8), np.float32))
    lat = t.stats()["latency"]
    assert lat["stage.wait"]["count"] >= 1
    assert lat["stage.wait"]["max_us"] <= max(
        lat["lookup_sum"]["max_us"], lat["apply_gradients"]["max_us"]
    )
    t.close()
