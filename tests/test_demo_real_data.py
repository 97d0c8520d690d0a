"""The demo's figures on the real CTR samples (``../shared/data``, see its README).

Each test runs the demo's command line with the flags README.md gives for that figure, so
what is checked here is what a user runs. Skipped, saying so, when the data is absent.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from embstore.demo import cli

LAST_LINE = re.compile(r"^test_auc=(\d\.\d{4}) test_logloss=(\d+\.\d{4}) examples_per_s=(\d+)$")

FRAPPE = ["--epochs", "2"]
CRITEO = ["--lr", "0.02", "--dim", "4", "--batch-size", "128"]  # one epoch (the default)


def demo(args: list[str]) -> tuple[float, list[str]]:
    out = io.StringIO()
    assert cli.main([*args, "--quiet"], out=out) == 0
    lines = out.getvalue().splitlines()
    match = LAST_LINE.match(lines[-1])
    assert match, lines[-1]
    return float(match[1]), lines


def need(directory: Path, name: str) -> str:
    path = directory / name
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return str(path)


@pytest.mark.parametrize("model", ["fm", "dnn"])
def test_frappe_test_auc_at_least_0_93(shared_data: Path, model: str) -> None:
    if model == "dnn":
        pytest.importorskip("torch")
    train = need(shared_data, "frappe.validation.libfm")
    test = need(shared_data, "frappe.test.libfm")
    auc, lines = demo(["--data", train, "--test", test, "--model", model, *FRAPPE])
    assert "57722 train / 28860 test examples" in lines[0]
    assert auc >= 0.93  # a logistic regression gets 0.922


@pytest.mark.parametrize("model", ["fm", "dnn"])
def test_criteo_10k_test_auc_at_least_0_72(shared_data: Path, model: str) -> None:
    if model == "dnn":
        pytest.importorskip("torch")
    data = need(shared_data, "criteo_kaggle_10k.txt")
    auc, lines = demo(["--data", data, "--model", model, *CRITEO])
    assert "8000 train / 2000 test examples" in lines[0]  # first 8,000 / last 2,000
    assert "1 epoch(s)" in lines[1]
    assert auc >= 0.72
