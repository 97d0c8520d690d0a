"""Tests of the W1 bench harness itself (embstore.bench): peers agree with the numpy
reference, the traffic-floor arithmetic, the report's targets and the plot.

Optional peers and tools (torch, FBGEMM, matplotlib) are skipped when not installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import markdown_table

from embstore.bench import make_workload
from embstore.bench.peer_fbgemm import FBGEMM_INSTALL, FbgemmTbePeer, tbe_inputs
from embstore.bench.verify import verify_peer


def _small_workload(pooling: int, dim: int = 16, **kw: Any) -> Any:
    return make_workload(
        num_tables=3,
        universe=2000,
        batch_size=64,
        pooling=pooling,
        dim=dim,
        num_batches=kw.pop("num_batches", 3),
        **kw,
    )


# --------------------------------------------------------------------------------------
# FBGEMM peer
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", [1, 3])
def test_tbe_inputs_are_table_major(pooling: int) -> None:
    """TBE input: all tables' rows concatenated; offsets[t * B + b] starts bag b of table t."""
    wl = _small_workload(pooling)
    batch = wl.batches[0]
    indices, offsets = tbe_inputs(batch)
    b, n = batch.batch_size, batch.batch_size * pooling
    assert indices.dtype == np.int64
    assert offsets.dtype == np.int64
    assert offsets.shape == (len(batch.rows) * b + 1,)
    assert offsets[0] == 0
    assert offsets[-1] == indices.shape[0] == len(batch.rows) * n
    for t, rows in enumerate(batch.rows):
        for bag in (0, 1, b - 1):
            lo, hi = offsets[t * b + bag], offsets[t * b + bag + 1]
            np.testing.assert_array_equal(
                indices[lo:hi], rows[batch.offsets[bag] : batch.offsets[bag + 1]]
            )


def test_fbgemm_unavailable_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FBGEMM the peer is skipped, and the message says how to install it."""
    import embstore.bench.peer_fbgemm as mod

    def missing() -> Any:
        raise ImportError("No module named 'fbgemm_gpu'")

    monkeypatch.setattr(mod, "import_fbgemm", missing)
    why = FbgemmTbePeer.unavailable()
    assert why is not None
    assert why.startswith("skipped")
    assert FBGEMM_INSTALL in why


@pytest.mark.parametrize(("pooling", "dim", "threads"), [(1, 16, 1), (4, 16, 2), (8, 128, 1)])
def test_fbgemm_peer_matches_numpy(pooling: int, dim: int, threads: int) -> None:
    """FBGEMM's forward and fused EXACT_ADAGRAD step agree with the numpy reference.

    FBGEMM's CPU update is ``acc += g * g; w -= lr * g / (sqrt(acc) + eps)`` (eps outside
    the square root, as the reference) with ``g`` summed and the step computed in double:
    within the reference's per-element tolerance (a few ulp), batch after batch (the
    accumulators carry over, read back from the module).
    """
    why = FbgemmTbePeer.unavailable()
    if why is not None:
        pytest.skip(why)
    wl = _small_workload(pooling, dim, num_batches=4)
    peer = FbgemmTbePeer(threads)
    peer.setup(wl.tables, dim)
    try:
        # Starts from the dense peers' rows, accumulators at 0.
        w0, acc0 = peer.read_rows(0, wl.batches[0])
        np.testing.assert_array_equal(
            w0, wl.tables[0].initial_rows(dim, seed=0)[wl.batches[0].rows[0]]
        )
        assert acc0 is not None
        assert not acc0.any()
        peer.prepare(wl.batches[:2], wl.grads)  # the last batches go unprepared
        for batch in wl.batches:
            res = verify_peer(peer, batch, wl.grads)
            assert res["forward_max_abs_err"] <= 1e-6
        _, acc = peer.read_rows(0, wl.batches[-1])
        assert acc is not None
        assert acc.any()
    finally:
        peer.close()


# --------------------------------------------------------------------------------------
# Traffic floor
# --------------------------------------------------------------------------------------


def test_row_sizes_and_line_words() -> None:
    """Rates are measured for index lines, weight rows and whole Adagrad rows, in lines."""
    from embstore.bench.floor import embstore_row_bytes, line_words, row_sizes

    assert embstore_row_bytes(32) == 256
    assert embstore_row_bytes(30) == 240
    assert row_sizes([32, 128]) == [64, 128, 256, 512, 1024]
    assert row_sizes([30]) == [64, 128, 256]  # 120-byte weights, 240-byte rows: in lines
    np.testing.assert_array_equal(
        line_words(np.array([0, 3], dtype=np.int64), 256), [0, 8, 16, 24, 96, 104, 112, 120]
    )


def test_step_traffic_counts_embstore_bytes() -> None:
    """Per step: 2 index lines + the weights + the whole row (read and written back) per
    distinct id; ids twice, the pooled outputs and the gradients as streams."""
    from embstore.bench.floor import step_traffic, unique_ids

    dim = 32
    wl = _small_workload(4, dim, num_batches=3)
    tr = step_traffic(wl.batches, dim)
    u = np.mean([sum(np.unique(k).shape[0] for k in b.keys) for b in wl.batches])
    assert unique_ids(wl.batches) == pytest.approx(u)
    n = 3 * 64 * 4
    assert tr.ids == n
    assert tr.unique_ids == pytest.approx(u)
    assert tr.pooling == 4
    assert tr.index_bytes == pytest.approx(2 * u * 64)
    assert tr.forward_bytes == pytest.approx(u * 128)
    assert tr.update_bytes == pytest.approx(u * 256)
    assert tr.stream_bytes == 2 * n * 8 + 2 * 3 * 64 * dim * 4
    assert tr.total_bytes == pytest.approx(
        tr.index_bytes + tr.forward_bytes + tr.update_bytes + tr.stream_bytes
    )


def test_floor_ms_divides_each_kind_by_its_rate() -> None:
    from embstore.bench.floor import Rates, Traffic, floor_cases, floor_ms

    tr = Traffic(
        dim=32,
        pooling=8,
        unique_ids=1000.0,
        ids=4000,
        index_bytes=2e6,
        forward_bytes=3e6,
        update_bytes=4e6,
        stream_bytes=10e6,
    )
    rates = Rates(
        threads=1,
        stream_gb_s=10.0,
        gather_gb_s={64: 2.0, 128: 3.0, 256: 100.0},
        update_gb_s={64: 100.0, 128: 100.0, 256: 4.0},
    )
    # 2e6/2e9 + 3e6/3e9 + 4e6/4e9 + 10e6/10e9 s = 4 ms
    assert floor_ms(tr, rates) == pytest.approx(4.0)
    assert np.isnan(floor_ms(tr, Rates(1, 10.0, {64: 2.0}, {})))  # a rate is missing
    (case,) = floor_cases([tr], [rates])
    assert case["floor_ms"] == pytest.approx(4.0)
    assert case["total_mb"] == pytest.approx(19.0)
    assert (case["dim"], case["pooling"], case["threads"]) == (32, 8, 1)


def test_measure_bandwidth_reports_every_size_and_thread_count() -> None:
    from embstore.bench.floor import measure_bandwidth

    rates = measure_bandwidth([64, 256], [1, 2], array_bytes=8 << 20, sample_bytes=1 << 20, reps=2)
    assert [r.threads for r in rates] == [1, 2]
    for r in rates:
        assert r.stream_gb_s > 0
        assert sorted(r.gather_gb_s) == [64, 256]
        assert min(r.gather_gb_s.values()) > 0
        assert sorted(r.update_gb_s) == [64, 256]
        assert min(r.update_gb_s.values()) > 0
    with pytest.raises(ValueError, match="multiple of 64"):
        measure_bandwidth([96], [1], array_bytes=1 << 20, sample_bytes=1 << 16, reps=1)


# --------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------


def _row(peer: str, dim: int, lp: int, t: int, fwd: float, step: float, **kw: Any) -> Any:
    return {
        "peer": peer,
        "dim": dim,
        "pooling": lp,
        "threads": t,
        "forward_ms": fwd,
        "step_ms": step,
        "others_cores": kw.pop("others", 0.0),
        **kw,
    }


def test_targets_verdicts() -> None:
    from embstore.bench.targets import evaluate

    results = [
        _row("embstore", 32, 1, 1, 1.0, 2.0, floor_ms=1.5),
        _row("embstore", 32, 1, 2, 0.8, 1.0, floor_ms=1.0),
        _row("embstore", 32, 8, 1, 8.0, 20.0, floor_ms=5.0),
        _row("embstore", 32, 8, 2, 4.0, 10.0, floor_ms=5.0, others=0.5),
        _row("fbgemm", 32, 1, 1, 1.0, 5.0),
        _row("fbgemm", 32, 1, 2, 1.0, 2.5),
        _row("fbgemm", 32, 8, 1, 4.0, 50.0),
        _row("fbgemm", 32, 8, 2, 4.0, 30.0),
        _row("torch", 32, 1, 1, 0.7, 9.0),
        _row("torch", 32, 1, 2, 0.6, 9.0),
        _row("torch", 32, 8, 1, 7.0, 50.0),
        _row("torch", 32, 8, 2, 3.0, 50.0),
    ]
    got = {(v.key, v.pooling): v for v in evaluate(results, [32], [1, 8], [1, 2])}
    # A peer counts at its best thread count; the status is judged at 2 threads.
    # FBGEMM / embstore step: L=1 best 2.5 -> 1.25, 2.5 -> PASS; L=8 best 30 -> 1.5, 3.0 -> PASS
    assert got[("fbgemm", 1)].values == {1: 1.25, 2: 2.5}
    assert got[("fbgemm", 1)].status == "PASS"
    assert got[("fbgemm", 8)].values == {1: 1.5, 2: 3.0}
    assert got[("fbgemm", 8)].status == "PASS"
    assert got[("fbgemm", 8)].judged_at == 2
    assert got[("fbgemm", 8)].others_cores == 0.5  # the noisiest row it reads
    assert got[("fbgemm", 1)].others_cores == 0.0  # embstore's 1-thread row is not judged
    # step / floor: L=1 1.33, 1.0 -> PASS; L=8 4.0, 2.0 -> PASS (judged at 2 threads)
    assert got[("floor", 1)].status == "PASS"
    assert got[("floor", 8)].status == "PASS"
    assert got[("floor", 8)].values == {1: 4.0, 2: 2.0}
    # no pandas rows: n/a, no value
    assert got[("pandas", 1)].status == "n/a"
    assert got[("pandas", 1)].values == {1: None, 2: None}
    # embstore fwd / torch's best fwd: L=1 threshold 1.5 (0.6: 1.67, 1.33 -> PASS);
    # L=8 1.25 (3.0: 2.67, 1.33 -> MISS)
    assert got[("torch_fwd", 1)].threshold == 1.5
    assert got[("torch_fwd", 1)].status == "PASS"
    assert got[("torch_fwd", 8)].threshold == 1.25
    assert got[("torch_fwd", 8)].status == "MISS"
    assert got[("torch_fwd", 8)].values[1] == pytest.approx(8.0 / 3.0)
    # scaling: only L > 1, only N > 1 threads: 20 / 10 = 2.0 -> PASS
    assert ("scaling", 1) not in got
    assert got[("scaling", 8)].values == {1: None, 2: 2.0}
    assert got[("scaling", 8)].status == "PASS"
    # Without a 2-thread run the status is judged at the most threads run.
    only_one = evaluate(results, [32], [8], [1])
    assert {v.key: v.status for v in only_one}["floor"] == "MISS"
    assert all(v.judged_at == 1 for v in only_one)


# --------------------------------------------------------------------------------------
# A whole (tiny) run: report, JSON round trip, plot
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_report() -> dict[str, Any]:
    from embstore.bench import BenchConfig, run

    cfg = BenchConfig(
        num_tables=2,
        universe=2000,
        batch_size=32,
        dims=(8,),
        poolings=(1, 2),
        threads=(1, 2),
        batches=2,
        warmup=1,
        passes=2,
        peers=("embstore", "numpy", "nosuchpeer"),
        progress=False,
        floor_array_mib=8,
    )
    return run(cfg)


def test_tiny_run_report_has_summary_targets_and_floor(tiny_report: dict[str, Any]) -> None:
    from embstore.bench import format_report

    text = format_report(tiny_report)
    assert "### Summary" in text
    assert "### Targets" in text
    assert "### All measurements" in text
    assert "embstore step / traffic floor" in text
    assert "nosuchpeer: skipped: unknown peer" in text
    assert "traffic floor D=8 L=2" in text
    es = [r for r in tiny_report["results"] if r["peer"] == "embstore"]
    assert len(es) == 4
    assert all(r["floor_ms"] > 0 and r["floor_ratio"] > 0 for r in es)
    assert all(r["floor_ratio"] is None for r in tiny_report["results"] if r["peer"] != "embstore")


def test_passes_pool_every_pass_and_rotate_the_peer_order(tiny_report: dict[str, Any]) -> None:
    from embstore.bench import format_report
    from embstore.bench.peers import PEERS
    from embstore.bench.runner import _rotated

    for r in tiny_report["results"]:  # 2 passes x 2 timed batches, a median per pass
        assert r["timed_batches"] == 4
        assert len(r["forward_ms_all"]) == 4
        assert len(r["pass_step_ms"]) == 2
        assert all(x > 0 for x in r["pass_step_ms"])
    # Verified once per (peer, D, L, threads), not once per pass.
    assert len(tiny_report["verification"]) == 2 * 2 + 2
    text = format_report(tiny_report)
    assert "2 passes (every peer's tables built afresh in each" in text
    assert "- step ms per pass, D=8 L=2 threads=1: embstore " in text
    a, b, c = PEERS["embstore"], PEERS["numpy"], PEERS["pandas"]
    assert [_rotated([a, b, c], p) for p in range(4)] == [
        [a, b, c],
        [b, c, a],
        [c, a, b],
        [a, b, c],
    ]
    assert _rotated([], 3) == []
    # The floor's memory rates are measured once per pass, and each kept at its best.
    assert all(r["measurements"] == 2 for r in tiny_report["floor"]["rates"])
    assert "best of 2 measurements (one per pass) of 5 on a large array" in text


def test_best_rates_keeps_each_rates_highest_measurement() -> None:
    from embstore.bench.floor import Rates, best_rates

    a = [Rates(1, 30.0, {64: 7.0, 128: 5.0}, {64: 3.0}, 0.1), Rates(2, 40.0, {64: 13.0}, {64: 6.0})]
    b = [Rates(1, 20.0, {64: 3.0, 128: 8.0}, {64: 4.0}, 0.3)]
    one, two = best_rates(a, b)
    assert (one.stream_gb_s, one.gather_gb_s, one.update_gb_s) == (
        30.0,
        {64: 7.0, 128: 8.0},
        {64: 4.0},
    )
    assert (one.others_cores, one.measurements) == (0.3, 2)
    assert two is a[1]  # measured once: kept as it was


@pytest.mark.parametrize(
    ("policy", "others", "rows", "expected"),
    [
        ("PASSIVE", 0.0, [("torch", 2)], "NOTE"),  # quiet machine: passive slows torch
        ("PASSIVE", 0.0, [("fbgemm", 2)], "NOTE"),
        ("PASSIVE", 0.0, [("torch", 1), ("embstore", 2)], None),  # no OpenMP peer on 2 threads
        ("unset (libgomp default: active)", 0.0, [("torch", 2)], None),
        ("PASSIVE", 0.5, [("torch", 2)], "WARNING"),  # loaded: passive is the remedy
        ("unset (libgomp default: active)", 0.5, [("torch", 2)], "WARNING+active"),
        ("unset (libgomp default: active)", 0.5, [("embstore", 2)], "WARNING"),
    ],
)
def test_load_notes_name_what_the_load_and_the_wait_policy_did(
    policy: str, others: float, rows: list[tuple[str, int]], expected: str | None
) -> None:
    from embstore.bench.report import format_load_notes

    env = {"omp_wait_policy": policy, "other_processes_cores": others, "cores": 2}
    text = "\n".join(format_load_notes(env, [{"peer": p, "threads": n} for p, n in rows]))
    assert ("NOTE: OMP_WAIT_POLICY=PASSIVE" in text) == (expected == "NOTE")
    assert ("WARNING: other processes used 0.50" in text) == (expected or "").startswith("WARNING")
    assert ("wait actively" in text) == (expected == "WARNING+active")


def test_report_from_json_prints_the_same(tiny_report: dict[str, Any], tmp_path: Any) -> None:
    import json

    from embstore.bench import format_report
    from embstore.bench.cli import load_report

    path = tmp_path / "run.json"
    path.write_text(json.dumps(tiny_report, default=str))
    assert format_report(load_report(path)) == format_report(tiny_report)
    (tmp_path / "bad.json").write_text('{"results": []}')
    with pytest.raises(ValueError, match="not a bench report"):
        load_report(tmp_path / "bad.json")


def test_plot_writes_a_png(tiny_report: dict[str, Any], tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    from embstore.bench.plot import plot_report

    out = plot_report(tiny_report, tmp_path / "w1.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_fails_before_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from embstore.bench import cli
    from embstore.bench.plot import PlotUnavailable

    def missing() -> Any:
        raise PlotUnavailable("--plot needs matplotlib (No module named 'matplotlib')")

    def no_run(cfg: Any) -> Any:
        raise AssertionError("ran the bench")

    monkeypatch.setattr(cli, "require_matplotlib", missing)
    monkeypatch.setattr(cli, "run", no_run)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--plot", "x.png"])
    assert exc.value.code == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_passes_flag(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from embstore.bench import cli

    parse = cli.build_parser().parse_args
    assert cli.config_from_args(parse([])).passes == 1
    assert cli.config_from_args(parse(["--full"])).passes == 3
    assert cli.config_from_args(parse(["--full", "--passes", "2"])).passes == 2

    def no_run(cfg: Any) -> Any:
        raise AssertionError("ran the bench")

    monkeypatch.setattr(cli, "run", no_run)
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--passes", bad])
        assert exc.value.code == 2
        assert "--passes" in capsys.readouterr().err


def run_bench_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Runs ``bench/<name>`` with ``args`` under this interpreter (so with the embstore this
    test imports: installed, or PYTHONPATH=src), capturing its output."""
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, str(root / "bench" / name), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_w3_runner_reports_throughput_latency_and_contention_per_k(tmp_path: Path) -> None:
    """bench/w3_callers.py at a tiny size: one row per K with the median ids/s of its
    interleaved rounds and their range, each call type's P50 / P99, and the contention
    columns (calls, read tasks redone, lock waits); --json writes K=8 against K=2 for the
    results page."""
    from embstore.bench.page import results_page
    from embstore.bench.results_io import load_results

    args = ["--tables", "2", "--universe", "4096", "--seconds", "0.6", "--rounds", "2"]
    path = tmp_path / "w3.json"
    out = run_bench_script("w3_callers.py", *args, "--threads", "1,2,8", "--json", str(path))
    assert out.returncode == 0, out.stderr
    _, (work,) = load_results([str(path)])
    (entry,) = work["w3"]
    assert entry["k8_m_ids_per_s"] > 0
    assert entry["k2_m_ids_per_s"] > 0
    assert entry["worst_p99_over_p50"] >= 1
    ratio = entry["k8_m_ids_per_s"] / entry["k2_m_ids_per_s"]
    assert f"| {entry['k8_m_ids_per_s']:.2f} | {entry['k2_m_ids_per_s']:.2f} | {ratio:.2f}x |" in (
        results_page([], [work], "CMD")
    )
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| K |"))
    assert "read tasks redone" in header
    assert "lock waits (total wait)" in header
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in lines[1:]
        if line[:3] in ("| 1", "| 2", "| 8")
    }
    assert set(rows) == {"1", "2", "8"}
    for k, cells in rows.items():
        ids_per_s, fwd, apply, calls, redone, waits = (c.strip() for c in cells)
        median, spread = ids_per_s.split(" M (")
        low, high = (float(x) for x in spread.removesuffix(")").split("-"))
        assert 0 < low <= float(median) <= high
        assert " / " in fwd
        assert int(calls) > 0
        assert int(redone) >= 0
        assert int(waits.split(" (")[0]) >= 0
        assert waits.endswith(" ms)")
        assert apply == "-" if k == "1" else " / " in apply  # K=1 runs forward callers only


def test_churn_and_readonly_runner_reports_w2_and_interleaved_w4(tmp_path: Path) -> None:
    """bench/churn_and_readonly.py at a small size (a batch's distinct ids fit in U/4):
    W2's step against the same run's W1 step, its hit rate and RSS; W4's latency,
    throughput and miss rate (about the 10% of ids left out of the warm-up), and with torch
    installed the ratio to torch's forward with the range of its per-round ratios over the
    interleaved rounds."""
    from embstore.bench.results_io import load_results

    args = ["--tables", "2", "--universe", "20000", "--batches", "12", "--w4-rounds", "2"]
    out = run_bench_script("churn_and_readonly.py", *args, "--json", str(tmp_path / "w.json"))
    assert out.returncode == 0, out.stderr
    _, (work,) = load_results([str(tmp_path / "w.json")])
    (w2,), (w4,) = work["w2"], work["w4"]
    assert w2["w2_step_ms"][0] > 0
    assert 0 < w2["hit_rate"] < 1
    assert w4["m_ids_per_s"][0] > 0
    assert len(w4["torch_m_ids_per_s"]) in (0, 1)
    w2 = next(line for line in out.stdout.splitlines() if line.startswith("W2 "))
    w4 = next(line for line in out.stdout.splitlines() if line.startswith("W4 "))
    step = float(w2.split("step median ")[1].split(" ms")[0])
    ratio = float(w2.split(" ms = ")[1].split("x the W1 step")[0])
    hit_rate = float(w2.split("hit rate ")[1].split(",")[0])
    assert step > 0
    assert ratio > 0
    assert 0 < hit_rate < 1
    assert "RSS after batch 12 " in w2
    assert w2.endswith(" MiB")
    p50 = float(w4.split("P50 ")[1].split(" ms")[0])
    p99 = float(w4.split("P99 ")[1].split(" ms")[0])
    miss_rate = float(w4.rsplit("miss rate ", 1)[1])
    assert 0 < p50 <= p99
    assert 0.02 < miss_rate < 0.3
    if "torch not installed" in w4:
        return
    versus = float(w4.split(" = ")[1].split("x torch's")[0])
    low, high = (float(x) for x in w4.split("per round ")[1].split("x over")[0].split("-"))
    assert versus > 0
    assert 0 < low <= high
    assert "over 2 interleaved rounds" in w4


def test_churn_and_readonly_runner_rejects_no_rounds() -> None:
    out = run_bench_script("churn_and_readonly.py", "--w4-rounds", "0", timeout=60)
    assert out.returncode == 2
    assert "--w4-rounds must be at least 1" in out.stderr


# --------------------------------------------------------------------------------------
# The results page (bench/README.md) and the README's table, generated from JSON
# --------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def _step(report: dict[str, Any], peer: str, d: int, lp: int, t: int) -> float:
    (row,) = [
        r
        for r in report["results"]
        if (r["peer"], r["dim"], r["pooling"], r["threads"]) == (peer, d, lp, t)
    ]
    return float(row["step_ms"])


def test_results_page_tables_and_ratios_come_from_the_json(
    tiny_report: dict[str, Any], tmp_path: Any
) -> None:
    import json

    from embstore.bench.page import readme_table, results_page
    from embstore.bench.results_io import WORKLOADS_KIND, load_results

    path = tmp_path / "run.json"
    path.write_text(json.dumps(tiny_report, default=str))
    work = {
        "kind": WORKLOADS_KIND,
        "machines": {"m": {"name": "Test VM", "about": "made up"}},
        "w2": [
            {
                "machine": "m",
                "commit": "abc",
                "w2_step_ms": [3.0, 5.0],
                "w1_step_ms": [2.0, 4.0],
                "hit_rate": 0.9,
                "evictions_m_per_s": [1.0, 2.0],
                "rss_mib": [100, 101],
            }
        ],
        "w4": [
            {
                "machine": "m",
                "commit": "abc",
                "m_ids_per_s": [30.0],
                "torch_m_ids_per_s": [40.0],
                "p50_ms": [0.3, 0.3],
                "p99_ms": [0.5, 0.6],
                "miss_rate": 0.1,
            }
        ],
    }
    wpath = tmp_path / "workloads.json"
    wpath.write_text(json.dumps(work))
    reports, workloads = load_results([str(path), str(wpath)])
    assert len(reports) == 1
    assert len(workloads) == 1
    page = results_page(reports, workloads, "CMD")
    assert "<!-- Generated by `CMD`" in page
    assert "## How to run" in page
    assert "## Method" in page
    assert "## W1: training step" in page
    # The W1 table: one line per (D, L, threads), numpy's step and its ratio to embstore's.
    rows = markdown_table(page, "D")
    assert [(int(r[0]), int(r[1]), int(r[2])) for r in rows] == [
        (8, 1, 1),
        (8, 1, 2),
        (8, 2, 1),
        (8, 2, 2),
    ]
    for r in rows:
        d, lp, t = int(r[0]), int(r[1]), int(r[2])
        es, npy = _step(tiny_report, "embstore", d, lp, t), _step(tiny_report, "numpy", d, lp, t)
        assert r[4] == f"{es:.2f}"
        assert r[8] == f"{npy:.2f} ({npy / es:.2f}x)"
    # W2 and W4: the ratios are computed from the figures, run by run.
    assert (
        "| Test VM | abc | 3.00, 5.00 | 2.00, 4.00 | 1.50x, 1.25x | 0.900 | 1.00-2.00 M |" in page
    )
    assert "| 30.0 | 40.0 | 0.75x | 0.30 | 0.50-0.60 | 0.100 |" in page
    # The README table: embstore at 2 threads against numpy at its best thread count.
    table = readme_table(reports)
    rrows = markdown_table(table, "D, L")
    assert [r[0] for r in rrows] == ["8, 2", "8, 1"]
    for r in rrows:
        lp = int(r[0].split(",")[1])
        es = _step(tiny_report, "embstore", 8, lp, 2)
        best_numpy = min(_step(tiny_report, "numpy", 8, lp, t) for t in (1, 2))
        assert r[1] == f"**{es:.2f} ms**"
        assert r[4] == f"{best_numpy / es:.2f}x"
        assert r[2] == "n/a"  # FBGEMM did not run


def _committed_command() -> tuple[list[str], str]:
    """The files and output of the command stamped on the committed results page."""
    text = (REPO / "bench" / "README.md").read_text()
    start = text.index("<!-- Generated by `") + len("<!-- Generated by `")
    command = text[start : text.index("`", start)]
    args = command.split()
    files = args[args.index("--from-json") + 1 : args.index("--markdown")]
    return files, command


def test_committed_results_page_is_what_the_generator_prints() -> None:
    from embstore.bench.page import results_page
    from embstore.bench.results_io import load_results

    files, command = _committed_command()
    assert command.endswith("--markdown bench/README.md")
    reports, workloads = load_results([str(REPO / f) for f in files])
    expected = results_page(reports, workloads, command)
    assert (REPO / "bench" / "README.md").read_text() == expected, (
        "bench/README.md is out of date: regenerate it with " + command
    )
    for png in (REPO / "bench" / "results").glob("*.png"):
        assert f"results/{png.name}" in expected


def test_readme_performance_table_is_what_the_generator_prints() -> None:
    from embstore.bench.page import readme_table
    from embstore.bench.results_io import load_results

    files, _ = _committed_command()
    reports, workloads = load_results([str(REPO / f) for f in files])
    labels = {k: v for w in workloads for k, v in w.get("machines", {}).items()}
    assert readme_table(reports, labels) in (REPO / "README.md").read_text(), (
        "README.md's performance table is out of date: paste the output of "
        "python -m embstore bench --from-json " + " ".join(files) + " --readme-table"
    )


def test_ray_doc_sharded_table_is_what_the_bench_prints() -> None:
    import importlib.util

    text = (REPO / "docs" / "ray.md").read_text()
    marker = "<!-- generated: PYTHONPATH=src python bench/sharded.py --table "
    start = text.index(marker) + len(marker)
    files = text[start : text.index(" -->", start)].split()
    assert files, "docs/ray.md names no run"
    spec = importlib.util.spec_from_file_location("bench_sharded", REPO / "bench" / "sharded.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = module.table([str(REPO / f) for f in files])
    assert text.index(table) == text.index("-->", start) + len("-->\n"), (
        "docs/ray.md's sharded table is out of date: regenerate it with the command above it"
    )


def test_markdown_flag_writes_the_page(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from embstore.bench.cli import main

    files, _ = _committed_command()
    out = tmp_path / "page.md"
    assert main(["--from-json", *(str(REPO / f) for f in files), "--markdown", str(out)]) == 0
    assert out.read_text().startswith("# Benchmark results")
    assert main(["--from-json", str(REPO / files[0]), "--readme-table"]) == 0
    assert "| D, L | embstore step, 2 threads |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--markdown"])


# --------------------------------------------------------------------------------------
# W5: 26 Criteo-sized tables
# --------------------------------------------------------------------------------------


def test_w5_tables_have_criteo_sizes_ids_and_a_permuted_placement() -> None:
    from embstore.bench import splitmix64
    from embstore.bench.w5 import CRITEO_CARDINALITIES, make_w5_tables, w5_cardinalities

    assert len(CRITEO_CARDINALITIES) == 26
    assert sum(CRITEO_CARDINALITIES) == 33_762_577
    assert w5_cardinalities() == list(CRITEO_CARDINALITIES)
    capped = w5_cardinalities(1000)
    assert capped == [min(c, 1000) for c in CRITEO_CARDINALITIES]
    assert capped[8] == 3
    assert capped[5] == 24
    with pytest.raises(ValueError, match="max_rows"):
        w5_cardinalities(0)
    tables = make_w5_tables(1000)
    assert [t.universe for t in tables] == capped
    for t, tab in enumerate(tables):
        ranks = np.arange(tab.universe, dtype=np.uint64)
        np.testing.assert_array_equal(tab.ids, splitmix64(ranks + np.uint64(t << 32)))
        np.testing.assert_array_equal(np.sort(tab.row), np.arange(tab.universe))
        np.testing.assert_array_equal(tab.warm_ids[tab.row], tab.ids)
    big = tables[2]
    assert not np.array_equal(big.row, np.arange(1000))  # not the identity
    assert not np.array_equal(big.row, tables[3].row)  # one permutation per table
    again = make_w5_tables(1000, num_tables=3)
    assert len(again) == 3
    np.testing.assert_array_equal(again[2].row, big.row)  # fixed seed


def test_w5_batches_draw_each_table_over_its_own_universe() -> None:
    from embstore.bench.w5 import make_w5_tables

    tables = make_w5_tables(500)
    wl = make_workload(
        num_tables=26, universe=500, batch_size=256, pooling=1, dim=16, num_batches=2,
        tables=tables,
    )  # fmt: skip
    for batch in wl.batches:
        assert batch.num_ids == 26 * 256
        for tab, keys, rows in zip(tables, batch.keys, batch.rows, strict=True):
            assert rows.min() >= 0
            assert rows.max() < tab.universe
            np.testing.assert_array_equal(tab.warm_ids[rows], keys)
    assert set(np.unique(wl.batches[0].keys[8])) <= set(tables[8].ids)  # the 3-row table
    # Zipf: the hottest rank of a big table is drawn far more often than 1/U.
    hot = tables[2].ids[0]
    assert np.mean(wl.batches[0].keys[2] == hot) > 20 / 500


@pytest.fixture(scope="module")
def w5_report() -> dict[str, Any]:
    from embstore.bench import BenchConfig, run

    cfg = BenchConfig.w5()
    cfg.universe = 300
    cfg.batch_sizes = (64, 16)
    cfg.batches, cfg.warmup = 2, 1
    cfg.peers = ("embstore", "numpy")
    cfg.progress = False
    cfg.floor_array_mib = 8
    return run(cfg)


def test_w5_tiny_run_verifies_every_peer_at_every_batch_size(w5_report: dict[str, Any]) -> None:
    from embstore.bench import format_report

    ver = w5_report["verification"]
    # embstore at 1 and 2 threads and numpy, at each batch size.
    assert sorted((v["peer"], v["batch_size"]) for v in ver) == sorted(
        [
            ("embstore", 64),
            ("embstore", 64),
            ("numpy", 64),
            ("embstore", 16),
            ("embstore", 16),
            ("numpy", 16),
        ]
    )
    assert all(v["forward_max_abs_err"] == 0.0 for v in ver if v["peer"] == "embstore")
    rows = w5_report["results"]
    assert {(r["batch_size"], r["threads"]) for r in rows} == {(64, 1), (64, 2), (16, 1), (16, 2)}
    es = [r for r in rows if r["peer"] == "embstore"]
    assert all(r["floor_ms"] > 0 and r["floor_ratio"] > 0 for r in es)
    for r in rows:
        assert r["ids_per_s"] == pytest.approx(26 * r["batch_size"] / (r["step_ms"] * 1e-3))
    text = format_report(w5_report)
    assert "## embstore bench: W5" in text
    assert "Criteo cardinalities capped at 300" in text
    assert "### Summary, B=64" in text
    assert "### Summary, B=16" in text
    assert "Targets (issue 32, W5)" in text
    assert "ids/s at B=16 / ids/s at B=64" in text
    assert "traffic floor B=16 D=16 L=1" in text
    assert "(1-4 shards per table)" not in text  # capped at 300 rows: one shard each
    mem = w5_report["memory"][0]
    assert mem["rows"] == sum(min(c, 300) for c in _criteo())


def _criteo() -> tuple[int, ...]:
    from embstore.bench.w5 import CRITEO_CARDINALITIES

    return CRITEO_CARDINALITIES


def test_w5_targets_table_judges_each_target() -> None:
    from embstore.bench.targets_w5 import format_w5_targets, w5_target_values

    def row(peer: str, bs: int, t: int, fwd: float, step: float, floor: float) -> dict[str, Any]:
        return {
            "peer": peer, "batch_size": bs, "threads": t, "forward_ms": fwd, "step_ms": step,
            "floor_ms": floor if peer == "embstore" else None,
            "floor_ratio": step / floor if peer == "embstore" else None,
            "ids_per_s": 26 * bs / step,
        }  # fmt: skip

    results = [
        row("embstore", 512, 1, 1.0, 4.0, 2.0),
        row("embstore", 512, 2, 0.6, 2.4, 1.2),  # 1.67x speedup, floor's 1.67x: 1.0
        row("torch", 512, 1, 1.2, 9.0, 0.0),
        row("torch", 512, 2, 0.5, 9.0, 0.0),
        row("fbgemm", 512, 1, 2.0, 8.0, 0.0),
        row("fbgemm", 512, 2, 2.0, 9.0, 0.0),
        row("embstore", 128, 1, 0.5, 2.0, 1.0),
        row("embstore", 128, 2, 0.5, 1.6, 0.6),
    ]
    vals = {(text, bs): v for text, bs, _, _, v in w5_target_values(results)}
    assert vals[("embstore step / traffic floor", 512)] == {1: 2.0, 2: 2.0}
    fwd = vals[("embstore fwd / torch fwd (same threads)", 512)]
    assert fwd[1] == pytest.approx(1 / 1.2)
    assert fwd[2] == pytest.approx(1.2)
    assert vals[("FBGEMM step (best threads) / embstore step", 512)][2] == pytest.approx(8 / 2.4)
    assert vals[("speedup over 1 thread / the floor's", 512)][2] == pytest.approx(1.0)
    ratio = vals[("ids/s at B=128 / ids/s at B=512", 128)][2]
    assert ratio == pytest.approx((128 / 1.6) / (512 / 2.4))
    text = format_w5_targets(results)
    line = next(x for x in text.splitlines() if x.startswith("| embstore fwd / torch"))
    assert line.endswith("NOT met at 2 thread(s) |")  # 1.2x at 2 threads; 0.83x at 1
    assert "| n/a |" in text  # no FBGEMM at B=128
    # The forward is judged at every thread count: a miss at 1 thread alone fails it too.
    results[2] = row("torch", 512, 1, 0.8, 9.0, 0.0)  # embstore's 1.0 ms: 1.25x
    results[3] = row("torch", 512, 2, 0.9, 9.0, 0.0)  # 0.67x
    line = next(
        x for x in format_w5_targets(results).splitlines() if x.startswith("| embstore fwd")
    )
    assert line.endswith("NOT met at 1 thread(s) |")
    results[2] = row("torch", 512, 1, 1.5, 9.0, 0.0)
    line = next(
        x for x in format_w5_targets(results).splitlines() if x.startswith("| embstore fwd")
    )
    assert line.endswith("| met |")


def test_w5_ratios_near_a_threshold_show_the_side_they_are_on() -> None:
    from embstore.bench.targets_w5 import format_ratio

    assert format_ratio(0.896, ">=", 0.9) == "0.896x"  # 0.90x would read as met
    assert format_ratio(0.904, ">=", 0.9) == "0.90x"
    assert format_ratio(1.004, "<=", 1.0) == "1.004x"
    assert format_ratio(3.58, ">=", 3.0) == "3.58x"


def test_w5_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from embstore.bench import cli

    cfg = cli.config_from_args(cli.build_parser().parse_args(["--workload", "w5"]))
    assert (cfg.workload, cfg.num_tables, cfg.universe) == ("w5", 26, 100_000)
    assert cfg.cases_batch == (512, 128)
    assert cfg.dims == (16,)
    assert cfg.poolings == (1,)
    full = cli.config_from_args(cli.build_parser().parse_args(["--workload", "w5", "--full"]))
    assert full.universe == 10_131_227
    assert full.passes == 3
    small = cli.config_from_args(
        cli.build_parser().parse_args(["--workload", "w5", "--batch", "128", "--universe", "10"])
    )
    assert small.cases_batch == (128,)
    assert sum(t.universe for t in small.make_tables()) < 26 * 10
    with pytest.raises(ValueError, match="--tables"):
        cli.config_from_args(cli.build_parser().parse_args(["--workload", "w5", "--tables", "27"]))


def test_a_peer_that_does_not_fit_in_memory_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before building a peer's tables the runner checks them against MemAvailable."""
    from embstore.bench import BenchConfig, run, runner
    from embstore.bench.peer_dense import NumpyDensePeer
    from embstore.bench.w5 import make_w5_tables

    tables = make_w5_tables(1_000_000)
    rows = sum(min(c, 1_000_000) for c in _criteo())
    assert NumpyDensePeer.memory_bytes(tables, 16) == rows * 128  # weights + accumulators
    monkeypatch.setattr(runner, "available_bytes", lambda: 3 << 29)
    why = runner._no_room(NumpyDensePeer, tables, 16)
    assert why is not None
    assert f"{rows * 128 / 2**30:.1f} GiB" in why
    assert "1.5 GiB is available" in why
    assert runner._no_room(NumpyDensePeer, tables[:2], 16) is None  # 262 KiB fits
    cfg = BenchConfig.w5()
    cfg.universe, cfg.batch_sizes, cfg.batches, cfg.warmup = 50, (8,), 1, 0
    cfg.peers, cfg.progress, cfg.floor = ("numpy",), False, False
    monkeypatch.setattr(runner, "available_bytes", lambda: 1 << 20)
    report = run(cfg)
    assert report["results"] == []
    assert "numpy D=16 threads=-" in report["skipped"]


def test_w5_plot_shows_the_headline_batch(w5_report: dict[str, Any], tmp_path: Any) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    from embstore.bench.plot import plot_report

    out = plot_report(w5_report, tmp_path / "w5.png")
    assert out.stat().st_size > 0


def test_w5_full_times_more_batches_than_w1_full() -> None:
    """W5's steps are short: its --full run times W5_FULL_BATCHES a pass, W1's keeps 20, and
    an explicit --batches still wins."""
    from embstore.bench.cli import build_parser, config_from_args
    from embstore.bench.runner import W5_FULL_BATCHES

    def cfg(*argv: str) -> Any:
        return config_from_args(build_parser().parse_args(list(argv)))

    assert cfg("--workload", "w5", "--full").batches == W5_FULL_BATCHES == 100
    assert cfg("--full").batches == 20
    assert cfg("--workload", "w5").batches == cfg().batches
    assert cfg("--workload", "w5", "--full", "--batches", "7").batches == 7
