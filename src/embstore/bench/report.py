"""The report: result rows, the markdown table and the text around it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embstore.bench.workload import EPS, LR, ZIPF_ALPHA


@dataclass
class ResultRow:
    """One line of the result table."""

    peer: str
    label: str
    dim: int
    pooling: int
    threads: int
    measured_threads: int | None
    forward_ms: float
    backward_ms: float
    step_ms: float
    ids_per_s: float
    examples_per_s: float
    forward_gb_per_s: float
    timed_batches: int
    forward_ratio: float | None = None
    step_ratio: float | None = None
    others_cores: float | None = None
    forward_ms_all: list[float] = field(default_factory=list)
    backward_ms_all: list[float] = field(default_factory=list)


def median_ms(xs: Sequence[float]) -> float:
    return float(np.median(np.asarray(xs))) * 1e3 if xs else float("nan")


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}f}"


def _fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def _fmt_rate(x: float) -> str:
    if not math.isfinite(x):
        return "n/a"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    return f"{x / 1e3:.1f} k"


def format_table(rows: Sequence[ResultRow]) -> str:
    """The markdown result table."""
    head = (
        "| peer | D | L | threads | fwd ms | bwd+upd ms | step ms | step ids/s "
        "| step examples/s | fwd vs embstore | step vs embstore | others |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        thr = f"{r.threads}" if r.measured_threads is not None else f"{r.threads}*"
        lines.append(
            f"| {r.label} | {r.dim} | {r.pooling} | {thr} | {_fmt(r.forward_ms)} "
            f"| {_fmt(r.backward_ms)} | {_fmt(r.step_ms)} | {_fmt_rate(r.ids_per_s)} "
            f"| {_fmt_rate(r.examples_per_s)} | {_fmt_ratio(r.forward_ratio)} "
            f"| {_fmt_ratio(r.step_ratio)} | {_fmt(r.others_cores)} |"
        )
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    """Header, result table, memory and verification lines as markdown."""
    env, cfg = report["environment"], report["config"]
    out = [
        "## embstore bench: WORKLOADS.md W1 (pooled training step, warm tables)",
        "",
        (
            f"- commit {env['commit']}, embstore {env['embstore']}, {env['date']}; other "
            f"processes used {_fmt(env.get('other_processes_cores'))} cores on average during "
            f"the run (load average {env.get('loadavg_start')} at start)"
        ),
        (
            f"- CPU {env['cpu']}, {env['cores']} cores ({env['cores_usable']} usable), "
            f"Python {env['python']}, numpy {env['numpy']}, torch {env['torch']} "
            f"(OMP_WAIT_POLICY={env.get('omp_wait_policy')}), fbgemm-gpu-cpu "
            f"{env.get('fbgemm', 'n/a')}, pandas {env['pandas']}"
        ),
        (
            f"- T={cfg['num_tables']} tables, U={cfg['universe']:,} ids each (all inserted "
            f"before timing, in placement order), B={cfg['batch_size']}, Zipf alpha "
            f"{ZIPF_ALPHA}, Adagrad lr {LR} eps {EPS}, seed {cfg['seed']}"
        ),
        (
            f"- medians over {cfg['batches']} timed batches after {cfg['warmup']} untimed "
            "warm-up batch(es); step = forward + backward of the same batch; ratios are "
            "peer / embstore (> 1: embstore is faster); others = cores used by other "
            "processes while the row was timed (rows above ~0.2 are unreliable)"
        ),
        "",
        report["table"],
        "",
    ]
    if any(r["measured_threads"] is None for r in report["results"]):
        out.append(
            "\\* single-threaded peer (numpy/pandas ignore the thread setting): measured "
            "once per D and L, repeated in each thread group for the ratio."
        )
        out.append("")
    others = env.get("other_processes_cores")
    if others is not None and others > 0.2:
        out.append(
            f"- WARNING: other processes used {others:.2f} of the {env.get('cores')} cores on "
            "average during this run: figures are noisy, 2-thread figures most of all."
        )
        if "PASSIVE" not in str(env.get("omp_wait_policy")) and any(
            r["peer"] in ("torch", "fbgemm") and (r["threads"] or 1) > 1 for r in report["results"]
        ):
            out.append(
                "  torch's and FBGEMM's multi-threaded rows are unreliable under contention "
                "(their OpenMP workers wait actively); rerun on a quiet machine, or with "
                "--omp-wait-policy passive (slower for them on a quiet machine)."
            )
    for name, why in report["skipped"].items():
        out.append(f"- {name}: {why}")
    for m in report["memory"]:
        if "error" in m:
            out.append(f"- embstore memory, D={m['dim']}: {m['error']}")
            continue
        rss = m.get("rss_bytes_per_row")
        payload = m["payload_bytes_per_row"]
        overhead = f"{(rss / payload - 1) * 100:+.0f}%" if rss else "n/a"
        created = m.get("rss_created_bytes")
        out.append(
            f"- embstore memory, D={m['dim']} (fresh process): {m['rows']:,} rows, RSS "
            f"+{_fmt((m.get('rss_delta_bytes') or 0) / 2**20, 1)} MiB = {_fmt(rss, 1)} "
            f"bytes/row (of which {_fmt((created or 0) / 2**20, 1)} MiB at creation); "
            f"stats()['bytes_per_row'] = {_fmt(m.get('stats_bytes_per_row'), 1)}; "
            f"id + weights + accumulators = {payload} bytes/row, RSS overhead {overhead}"
        )
    for m in report["setup"]:
        if m.get("peer") == "embstore":
            out.append(
                f"- embstore build + warm-up, D={m['dim']} threads={m['threads']}: "
                f"{m['setup_s']:.1f} s for {m.get('rows', 0):,} rows"
                f" ({m.get('num_shards')} shards per table)"
            )
            if "warning" in m:
                out.append(f"  - WARNING: {m['warning']}")
    errs = report["verification"]
    if errs:
        fe = max(v["forward_max_abs_err"] for v in errs)
        ue = max(v.get("update_max_abs_err", 0.0) for v in errs)
        out.append(
            f"- verified before timing: {len(errs)} (peer, D, L, threads) cases, forward "
            f"max abs err {fe:.2g}, Adagrad step max abs err {ue:.2g} vs numpy"
        )
        exact = [v for v in errs if v["peer"] == "embstore"]
        if exact:
            out.append(
                "- embstore vs numpy: forward max abs err "
                f"{max(v['forward_max_abs_err'] for v in exact):.2g}, Adagrad step max abs err "
                f"{max(v['update_max_abs_err'] for v in exact):.2g}"
            )
    return "\n".join(out)
