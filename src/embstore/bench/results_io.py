"""Reading saved results: runner reports (``--json``, W1 or W5) and the other workloads' figures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from embstore.bench.env import environment

#: The ``kind`` of a JSON file holding W2, W3, W4, checkpoint and optimizer figures.
WORKLOADS_KIND = "embstore-bench-workloads"


def _read_object(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        msg = "not a bench report (not a JSON object)"
        raise ValueError(msg)  # noqa: TRY004 - a bad file, reported like the others
    return data


def _checked_report(report: dict[str, Any]) -> dict[str, Any]:
    missing = [k for k in ("environment", "config", "results", "table") if k not in report]
    if missing:
        msg = f"not a bench report (missing {', '.join(missing)})"
        raise ValueError(msg)
    report.setdefault("memory", [])
    report.setdefault("setup", [])
    report.setdefault("verification", [])
    report.setdefault("skipped", {})
    return report


def load_report(path: str | Path) -> dict[str, Any]:
    """A runner report (W1 or W5) saved with ``--json``.

    Raises
    ------
    ValueError
        If the file is not such a report.
    """
    return _checked_report(_read_object(path))


def load_results(paths: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runner reports (W1 and W5: see :func:`split_runs`) and the workload-figure files
    among ``paths``, each in the given order.

    Raises
    ------
    ValueError
        If a file is neither kind, naming the file.
    """
    reports, workloads = [], []
    for path in paths:
        try:
            data = _read_object(path)
            if data.get("kind") == WORKLOADS_KIND:
                workloads.append(data)
            else:
                reports.append(_checked_report(data))
        except (OSError, ValueError) as exc:
            msg = f"{path}: {exc}"
            raise ValueError(msg) from exc
    return reports, workloads


def is_w5(report: dict[str, Any]) -> bool:
    """Whether a runner report is a W5 run (its config says so; older reports are W1)."""
    return bool(report["config"].get("workload", "w1") == "w5")


def split_runs(
    reports: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The W1 reports and the W5 reports among ``reports``, each in the given order."""
    return [r for r in reports if not is_w5(r)], [r for r in reports if is_w5(r)]


def workloads_record(**sections: list[dict[str, Any]]) -> dict[str, Any]:
    """A workloads file for one run of a bench script (``--json``): each section's entries
    (``w2``, ``w3``, ``w4``, ...) stamped with this machine's CPU, the commit and the date,
    ready for ``--from-json ... --markdown``."""
    env = environment()
    stamp = {"machine": env["cpu"], "commit": env["commit"], "date": str(env["date"])[:10]}
    return {
        "kind": WORKLOADS_KIND,
        **{name: [{**stamp, **e} for e in entries] for name, entries in sections.items()},
    }
