"""``--plot PATH``: a PNG of a run's throughput, against the peers and against threads.

Left: step throughput (examples/s, log scale) of every peer, grouped by ``(D, L,
threads)``, with the traffic floor's throughput (``B / floor``, the most embstore's
layout could do at the measured memory rates) as a black bar across each group. Right:
embstore's step throughput against the thread count for each ``(D, L)``, with the ideal
(linear) scaling from one thread dashed.

Works from a fresh run or from a saved report (``--from-json``). matplotlib is optional
(the ``bench`` extra); :func:`require_matplotlib` says how to install it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Colour of each known peer (others get matplotlib's cycle).
PEER_COLORS = {
    "embstore": "#1f77b4",
    "fbgemm": "#d62728",
    "torch": "#ff7f0e",
    "numpy": "#7f7f7f",
    "pandas": "#2ca02c",
}


class PlotUnavailable(RuntimeError):
    """matplotlib is missing."""


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend.

    Raises
    ------
    PlotUnavailable
        If matplotlib cannot be imported (with the install line).
    """
    try:
        mpl = importlib.import_module("matplotlib")
        mpl.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError as exc:
        msg = (
            f"--plot needs matplotlib ({exc}): pip install matplotlib, or pip install "
            "'embstore[bench]'"
        )
        raise PlotUnavailable(msg) from exc


def _cases(results: Sequence[dict[str, Any]]) -> list[tuple[int, int, int]]:
    return list(dict.fromkeys((r["dim"], r["pooling"], r["threads"]) for r in results))


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Draw the two panels of ``report`` (as :func:`embstore.bench.run` returns it, or as
    loaded from its JSON) into the PNG ``path``; return the path."""
    plt = require_matplotlib()
    results: list[dict[str, Any]] = report["results"]
    if not results:
        msg = "the report has no results to plot"
        raise ValueError(msg)
    cfg = report["config"]
    # W5 times several batch sizes: the plot shows the headline one (the first).
    batch = int((cfg.get("batch_sizes") or [cfg["batch_size"]])[0])
    results = [r for r in results if r.get("batch_size") in (None, 0, batch)]
    cases = _cases(results)
    peers = list(dict.fromkeys(r["peer"] for r in results))
    by = {(r["peer"], r["dim"], r["pooling"], r["threads"]): r for r in results}
    labels = {
        r["peer"]: r["label"] + (" *" if r["measured_threads"] is None else "") for r in results
    }

    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [2.2, 1]}, constrained_layout=True
    )
    width = 0.8 / max(1, len(peers))
    for j, peer in enumerate(peers):
        xs, ys = [], []
        for i, (d, lp, t) in enumerate(cases):
            row = by.get((peer, d, lp, t))
            if row is not None and row["examples_per_s"] > 0:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(row["examples_per_s"])
        ax1.bar(xs, ys, width, label=labels[peer], color=PEER_COLORS.get(peer))
    floor_label = "traffic floor: B / floor ms (embstore at the measured memory rates)"
    for i, (d, lp, t) in enumerate(cases):
        es = by.get(("embstore", d, lp, t))
        if es is not None and es.get("floor_ms"):
            ax1.hlines(
                batch / (es["floor_ms"] * 1e-3),
                i - 0.45,
                i + 0.45,
                colors="black",
                label=floor_label,
            )
            floor_label = "_nolegend_"
    ax1.set_xticks(range(len(cases)), [f"D={d}\nL={lp}\n{t} thr" for d, lp, t in cases])
    ax1.set_yscale("log")
    ax1.set_ylabel("step throughput, examples/s (log)")
    ax1.set_title(
        f"{str(cfg.get('workload', 'w1')).upper()} step throughput by peer "
        f"(T={cfg['num_tables']}, U={cfg['universe']:,}, B={batch})"
    )
    ax1.grid(axis="y", which="both", alpha=0.3)
    ax1.legend(
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=3,
        title="* single-threaded peer (measured once, shown in every thread group)",
        title_fontsize=7,
    )

    threads = sorted({t for _d, _lp, t in cases})
    for d, lp in dict.fromkeys((d, lp) for d, lp, _t in cases):
        pts = [
            (t, by[("embstore", d, lp, t)]["examples_per_s"])
            for t in threads
            if ("embstore", d, lp, t) in by
        ]
        if not pts:
            continue
        line = ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"D={d} L={lp}")
        one = dict(pts).get(1)
        if one:
            ax2.plot(
                threads, [one * t for t in threads], "--", color=line[0].get_color(), alpha=0.5
            )
    ax2.plot([], [], "k--", alpha=0.5, label="ideal scaling from 1 thread")
    ax2.set_xticks(threads)
    ax2.set_xlabel("threads")
    ax2.set_yscale("log")
    ax2.set_ylabel("embstore step throughput, examples/s (log)")
    ax2.set_title("embstore vs threads")
    ax2.grid(which="both", alpha=0.3)
    ax2.legend(fontsize=8)

    env = report.get("environment", {})
    fig.suptitle(
        f"embstore bench, commit {env.get('commit', '?')}, {env.get('cpu', '?')}, "
        f"{env.get('date', '')}; other processes used {env.get('other_processes_cores', '?')} "
        "cores on average",
        fontsize=9,
    )
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
