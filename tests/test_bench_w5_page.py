"""W5 on the results page (``--markdown``) and in the README's table (``--readme-table``).

A tiny real W5 run (tables capped at 300 rows) is saved as JSON and given to the
generators with a committed W1 report: the W5 section and rows must carry the run's own
figures, recomputed here from its result rows, and leave W1's output unchanged. torch is
one of the run's peers when installed (its ratios are then checked too).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from helpers import markdown_table

REPO = Path(__file__).resolve().parents[1]
W1_JSON = REPO / "bench" / "results" / "w1_d32_xeon.json"


@pytest.fixture(scope="module")
def w5_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from embstore.bench import BenchConfig, run

    cfg = BenchConfig.w5()
    cfg.universe = 300
    cfg.batch_sizes = (64, 16)
    cfg.batch_size = 64
    cfg.batches, cfg.warmup = 3, 1
    cfg.peers = ("embstore", "numpy", "torch")
    cfg.progress = False
    cfg.floor_array_mib = 8
    path = tmp_path_factory.mktemp("w5") / "w5.json"
    path.write_text(json.dumps(run(cfg), default=str))
    return path


def _row(report: dict[str, Any], peer: str, bs: int, t: int) -> dict[str, Any] | None:
    rows = [
        r for r in report["results"] if (r["peer"], r["batch_size"], r["threads"]) == (peer, bs, t)
    ]
    assert len(rows) <= 1
    return rows[0] if rows else None


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _target(v: float, op: str, thr: float) -> str:
    """A target's ratio as the page prints it (3 decimals where 2 would round it onto the
    other side of the threshold)."""
    from embstore.bench.targets_w5 import format_ratio

    return format_ratio(v, op, thr)


def test_runs_are_told_apart_by_their_config(w5_json: Path) -> None:
    from embstore.bench.results_io import load_results, split_runs

    reports, workloads = load_results([str(W1_JSON), str(w5_json)])
    assert workloads == []
    w1, w5 = split_runs(reports)
    assert [r["config"].get("workload", "w1") for r in w1] == ["w1"]  # no key: an older W1 run
    assert [r["config"]["workload"] for r in w5] == ["w5"]


def test_results_page_has_a_w5_section_with_the_runs_figures(w5_json: Path) -> None:
    from embstore.bench.page import results_page
    from embstore.bench.report import format_summary
    from embstore.bench.results_io import load_results

    reports, _ = load_results([str(W1_JSON), str(w5_json)])
    w5 = reports[1]
    page = results_page(reports, [], "CMD")
    without = results_page(reports[:1], [], "CMD")
    assert page.index("## W1: training step") < page.index("## W5: 26 Criteo-sized tables")
    assert page.index("## W5: 26 Criteo-sized tables") < page.index("## Memory")
    # W1's part is untouched; W5 adds its section and a memory row, nothing else.
    head = page[: page.index("## W5")]
    assert head == without[: without.index("## Memory")]
    for bs in (64, 16):
        sub = [r for r in w5["results"] if r["batch_size"] == bs]
        assert f"Summary at B={bs}:\n\n{format_summary(sub)}\n" in page
    assert (
        "`python -m embstore bench --workload w5 --universe 300 --batch 64,16 --batches 3 "
        "--warmup 1 --peers embstore,numpy,torch --floor-mib 8`"
    ) in page
    rows = markdown_table(page[page.index("## W5") :], "B")
    assert [(int(r[0]), int(r[1])) for r in rows] == [(64, 1), (64, 2), (16, 1), (16, 2)]
    has_torch = _row(w5, "torch", 64, 1) is not None
    for cells in rows:
        bs, t = int(cells[0]), int(cells[1])
        es = _row(w5, "embstore", bs, t)
        assert es is not None
        step, floor, fwd, fbgemm, scaling, ids = cells[2:]
        assert step == f"{es['step_ms']:.2f}"
        floor_limit = 1.5 if bs == 64 else 2.0
        assert floor.split()[0] == _target(es["step_ms"] / es["floor_ms"], "<=", floor_limit)
        torch = _row(w5, "torch", bs, t)
        want = _target(es["forward_ms"] / torch["forward_ms"], "<=", 1.0) if torch else "n/a"
        assert fwd.split()[0] == want
        if torch:  # the forward is judged at every thread count
            assert fwd.endswith(" met")  # "met" or "NOT met"
        assert fbgemm == "n/a"  # FBGEMM did not run
        if t == 1:
            assert scaling == "-"
            # The other targets are judged at 2 threads only.
            assert all(" met" not in c for c in (floor, fbgemm, scaling, ids))
        else:
            one = _row(w5, "embstore", bs, 1)
            assert one is not None
            expected = (one["step_ms"] / es["step_ms"]) / (one["floor_ms"] / es["floor_ms"])
            assert scaling.split()[0] == _target(expected, ">=", 0.9)
            assert scaling.endswith(" met")  # "met" or "NOT met"
            assert floor.endswith(" met")
        if bs == 64:
            assert ids == "-"
        else:
            big = _row(w5, "embstore", 64, t)
            assert big is not None
            assert ids.split()[0] == _target(es["ids_per_s"] / big["ids_per_s"], ">=", 0.6)
    assert has_torch == ("n/a" not in "".join(r[4] for r in rows))
    assert "ids/s at B=16 / ids/s at B=64 >= 0.6x" in page
    mem = w5["memory"][0]
    assert f"| Xeon VM, W5 | 16 | {mem['rows']:,} |" not in page  # no labels given
    assert f"| {w5['environment']['cpu']}, W5 | 16 | {mem['rows']:,} |" in page


def test_readme_table_gains_w5_rows(w5_json: Path) -> None:
    from embstore.bench.page import readme_table
    from embstore.bench.results_io import load_results

    reports, _ = load_results([str(W1_JSON), str(w5_json)])
    w5 = reports[1]
    w1_only = readme_table(reports[:1])
    table = readme_table(reports)
    w1_lines = w1_only.split("\n\n")[0]
    assert table.startswith(w1_lines + "\n| W5: 16, 1, B=64 |")
    assert table.split("\n\n")[1].startswith(w1_only.split("\n\n")[1] + " W5 rows: ")
    rows = [r for r in markdown_table(table, "D, L") if r[0].startswith("W5")]
    assert [r[0] for r in rows] == ["W5: 16, 1, B=64", "W5: 16, 1, B=16"]
    for cells in rows:
        bs = int(cells[0].rsplit("=", 1)[1])
        es = _row(w5, "embstore", bs, 2)
        assert es is not None
        assert cells[1] == f"**{es['step_ms']:.2f} ms**"
        assert cells[2] == "n/a"  # FBGEMM
        assert cells[5] == "n/a"  # pandas
        numpy = min(r["step_ms"] for t in (1, 2) if (r := _row(w5, "numpy", bs, t)))
        assert cells[4] == _x(numpy / es["step_ms"])
        torch = [r["step_ms"] for t in (1, 2) if (r := _row(w5, "torch", bs, t))]
        assert cells[3] == (_x(min(torch) / es["step_ms"]) if torch else "n/a")
    env = w5["environment"]
    assert f"W5 rows: {env['cores']}-core {env['cpu']}, {str(env['date'])[:10]}, " in table
    assert "(26 Criteo tables capped at U=300 rows)." in table


def test_bench_command_runs_the_same_config_again() -> None:
    from embstore.bench.cli import build_parser, config_from_args
    from embstore.bench.page_w5 import bench_command
    from embstore.bench.runner import BenchConfig

    full = BenchConfig.w5(full=True)
    full.passes, full.omp_wait_policy = 2, "passive"
    quick = BenchConfig.w5()
    quick.batch_sizes, quick.batch_size, quick.threads, quick.floor = (128,), 128, (2,), False
    capped = BenchConfig.w5(full=True)
    capped.universe, capped.num_tables, capped.seed = 5000, 10, 3
    for cfg in (full, quick, capped, BenchConfig.w5()):
        command = bench_command(asdict(cfg))
        assert command.startswith("python -m embstore bench --workload w5")
        args = shlex.split(command)[4:]
        again = asdict(config_from_args(build_parser().parse_args(args)))
        want = asdict(cfg)
        for key in ("json_path", "progress"):
            again.pop(key)
            want.pop(key)
        assert again == want, command
    assert bench_command(asdict(full)).endswith(
        "--workload w5 --full --passes 2 --omp-wait-policy passive"
    )


def test_cli_pages_take_w5_reports(w5_json: Path, tmp_path: Path) -> None:
    from embstore.bench.cli import main

    out = tmp_path / "page.md"
    assert main(["--from-json", str(W1_JSON), str(w5_json), "--markdown", str(out)]) == 0
    assert "## W5: 26 Criteo-sized tables" in out.read_text()
    with pytest.raises(SystemExit):
        main(["--from-json", str(w5_json), "--readme-table"])  # no W1 report
