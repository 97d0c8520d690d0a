"""``python -m embstore demo`` end to end: output format, learning, errors, progress, plot."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.demo import cli, report
from embstore.demo.synthetic import synthetic

LAST_LINE = re.compile(
    r"^test_auc=(0\.\d{4}|1\.0000) test_logloss=(\d+\.\d{4}) examples_per_s=(\d+)$"
)
STEP_LINE = re.compile(
    r"^step=\d+ epoch=\d+ examples=\d+ auc=\S+ logloss=\S+ examples_per_s=\d+ "
    r"lookup_p50_us=[\d.]+ lookup_p99_us=[\d.]+ apply_p50_us=[\d.]+ apply_p99_us=[\d.]+$"
)
TINY = ["--examples", "20000", "--dim", "8", "--seed", "1"]


def run_demo(args: list[str]) -> tuple[int, list[str]]:
    out = io.StringIO()
    status = cli.main(args, out=out)
    return status, out.getvalue().splitlines()


def last_line(lines: list[str]) -> tuple[float, float, int]:
    match = LAST_LINE.match(lines[-1])
    assert match, lines[-1]
    return float(match[1]), float(match[2]), int(match[3])


def test_import_embstore_loads_neither_torch_nor_the_demo() -> None:
    code = (
        "import sys, embstore; print(sorted(m for m in sys.modules "
        "if m in ('torch', 'embstore.demo', 'embstore.torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tiny_synthetic_run_learns_and_ends_with_the_summary_line() -> None:
    status, lines = run_demo([*TINY, "--log-every", "10"])
    assert status == 0
    test_auc, test_logloss, examples_per_s = last_line(lines)
    assert test_auc > 0.65  # learnable data: well above chance
    assert 0 < test_logloss < 0.6
    assert examples_per_s > 0
    steps = [line for line in lines if line.startswith("step=")]
    assert len(steps) == 7  # 63 steps: every 10, and the end of the epoch
    assert all(STEP_LINE.match(line) for line in steps), steps
    assert "the read-only evaluation inserted 0" in "\n".join(lines)
    assert "hidden model's own test AUC" in lines[-2]


def test_defaults_on_eight_fields_are_the_fixed_ones() -> None:
    _, lines = run_demo([*TINY, "--quiet"])
    assert "Adagrad(lr=0.1), factor scale 1, batch 256" in lines[1]
    _, wide = run_demo([*TINY, "--quiet", "--fields", "39"])
    assert "39 embstore tables" in wide[1]
    assert "Adagrad(lr=0.02564), factor scale 0.06073, batch 256" in wide[1]
    assert last_line(wide)[0] > 0.6  # the wide stream is still learned


def test_holdout_tunes_on_the_training_part() -> None:
    status, lines = run_demo([*TINY, "--quiet", "--holdout", "0.25"])
    assert status == 0
    assert "12000 train / 4000 holdout examples" in lines[0]  # 16,000 training examples
    assert "hidden model's own holdout AUC" in lines[-2]
    match = re.match(
        r"^holdout_auc=(0\.\d{4}) holdout_logloss=\d+\.\d{4} examples_per_s=\d+$", lines[-1]
    )
    assert match
    assert float(match[1]) > 0.6


def test_same_seed_same_result() -> None:
    a = last_line(run_demo([*TINY, "--quiet"])[1])
    b = last_line(run_demo([*TINY, "--quiet"])[1])
    assert a[:2] == b[:2]


def test_quiet_prints_no_step_lines() -> None:
    status, lines = run_demo([*TINY, "--quiet"])
    assert status == 0
    assert not any(line.startswith("step=") for line in lines)


def test_log_lines_without_metrics_have_no_latency() -> None:
    embstore.metrics.enable(False)
    try:
        status, lines = run_demo([*TINY, "--log-every", "30"])
    finally:
        embstore.metrics.enable(True)
    assert status == 0
    steps = [line for line in lines if line.startswith("step=")]
    assert steps
    assert all("lookup_p50_us" not in line for line in steps)


def test_module_command_line() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    help_text = subprocess.run(
        [sys.executable, "-m", "embstore", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert "demo" in help_text
    done = subprocess.run(
        [sys.executable, "-m", "embstore", "demo", "--examples", "5000", "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert LAST_LINE.match(done.stdout.splitlines()[-1])
    assert done.stderr == ""  # not a tty: no progress bar


def test_files_criteo_and_libfm(tmp_path: Path) -> None:
    gen = synthetic(6000, 3, seed=2).data
    # libFM: global ids, field k = k-th feature; held out in a second file
    lines = [
        " ".join([str(int(y)), *(f"{int(i) % 100_000}:1" for i in gen.ids[:, n])])
        for n, y in enumerate(gen.labels)
    ]
    (tmp_path / "train.libfm").write_text("\n".join(lines[:5000]) + "\n")
    (tmp_path / "test.libfm").write_text("\n".join(lines[5000:]) + "\n")
    status, out = run_demo(
        [
            "--data",
            str(tmp_path / "train.libfm"),
            "--test",
            str(tmp_path / "test.libfm"),
            "--quiet",
            "--dim",
            "4",
        ]
    )
    assert status == 0
    assert last_line(out)[0] > 0.6
    assert "5000 train / 1000 test examples" in out[0]
    # Criteo: categorical columns from the ids, integers from a noisy copy of the label
    rng = np.random.default_rng(0)
    crit = []
    for n, y in enumerate(gen.labels):
        ints = [str(int(y) * 50 + int(rng.integers(0, 20)))] + [""] * 12
        cats = [f"{int(i) % 2**32:08x}" for i in gen.ids[:, n]] + [""] * 23
        crit.append("\t".join([str(int(y)), *ints, *cats]))
    (tmp_path / "c.txt").write_text("\n".join(crit) + "\n")
    status, out = run_demo(["--data", str(tmp_path / "c.txt"), "--quiet", "--dim", "4"])
    assert status == 0
    assert last_line(out)[0] > 0.75
    assert "4800 train / 1200 test examples" in out[0]
    assert "39 fields" in out[0]


def test_dnn_model() -> None:
    pytest.importorskip("torch")
    status, lines = run_demo([*TINY, "--model", "dnn", "--log-every", "30"])
    assert status == 0
    assert last_line(lines)[0] > 0.6
    assert all(STEP_LINE.match(line) for line in lines if line.startswith("step="))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "/nonexistent/x.txt"], "no such file"),
        (["--test", __file__], "--test needs --data"),
        (["--lr", "0"], "--lr must be a positive number"),
        (["--factor-scale", "-1"], "--factor-scale must be a positive number"),
        (["--holdout", "1"], "--holdout must be in (0, 1)"),
        (["--batch-size", "0"], "--batch-size must be positive"),
        (["--test-fraction", "1.5"], "--test-fraction"),
        (["--model", "xgboost"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_malformed_data_exits_1_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.libfm"
    path.write_text("1 1:1\n0 2:1\n1 oops\n")
    assert cli.main(["--data", str(path)]) == 1
    assert re.search(r"error: .*bad\.libfm:3: a libFM feature", capsys.readouterr().err)
    one_class = tmp_path / "ones.libfm"
    one_class.write_text("1 1:1\n" * 10)
    assert cli.main(["--data", str(one_class)]) == 1
    assert "both positive and negative" in capsys.readouterr().err


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal() -> None:
    tty = FakeTty()
    bar = report.ProgressBar(10, stream=tty, hz=1e9)
    bar.update(5, "auc=0.7")
    bar.clear()
    assert "\r[" in tty.getvalue()
    assert "50%" in tty.getvalue()
    assert "5/10 steps" in tty.getvalue()
    for stream, enabled in ((io.StringIO(), True), (FakeTty(), False)):
        quiet = report.ProgressBar(10, stream=stream, enabled=enabled)
        quiet.update(5, force=True)
        quiet.clear()
        assert stream.getvalue() == ""


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="has torch")
def test_dnn_without_torch_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([*TINY, "--model", "dnn"])
    assert exc.value.code == 2
    assert "--model dnn needs torch" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="has matplotlib")
def test_plot_without_matplotlib_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([*TINY, "--plot", "x.png"])
    assert exc.value.code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    status, lines = run_demo([*TINY, "--quiet", "--plot", str(png)])
    assert status == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in lines
