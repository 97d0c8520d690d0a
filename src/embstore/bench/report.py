"""The report: result rows, the markdown table and the text around it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embstore.bench.targets import Verdict, evaluate, index_results
from embstore.bench.targets_w5 import format_w5_targets
from embstore.bench.w5 import w5_cardinalities
from embstore.bench.workload import EPS, LR, ZIPF_ALPHA

#: Universe of W1 at full size: the targets are defined there.
CANONICAL_UNIVERSE = 1_000_000


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
    #: The traffic floor of embstore's step at this (D, L, threads), ms.
    floor_ms: float | None = None
    #: embstore rows: step / floor.
    floor_ratio: float | None = None
    #: Median step (ms) of each pass, in pass order (the run's ``passes``).
    pass_step_ms: list[float] = field(default_factory=list)
    #: Examples per batch (W5 times two batch sizes on the same tables).
    batch_size: int = 0


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
    """The markdown result table (with a B column when the run timed several batch sizes)."""
    by_batch = len({r.batch_size for r in rows}) > 1
    head = (
        f"| peer |{' B |' if by_batch else ''} D | L | threads | fwd ms | bwd+upd ms | step ms "
        "| step ids/s | step examples/s | fwd vs embstore | step vs embstore | others |"
    )
    lines = [head, "|" + "---|" * (13 if by_batch else 12)]
    for r in rows:
        thr = f"{r.threads}" if r.measured_threads is not None else f"{r.threads}*"
        b = f" {r.batch_size} |" if by_batch else ""
        lines.append(
            f"| {r.label} |{b} {r.dim} | {r.pooling} | {thr} | {_fmt(r.forward_ms)} "
            f"| {_fmt(r.backward_ms)} | {_fmt(r.step_ms)} | {_fmt_rate(r.ids_per_s)} "
            f"| {_fmt_rate(r.examples_per_s)} | {_fmt_ratio(r.forward_ratio)} "
            f"| {_fmt_ratio(r.step_ratio)} | {_fmt(r.others_cores)} |"
        )
    return "\n".join(lines)


def _cases(results: Sequence[dict[str, Any]]) -> tuple[list[int], list[int], list[int]]:
    """The D, L and thread counts of the results, in run order."""

    def uniq(key: str) -> list[int]:
        return list(dict.fromkeys(int(r[key]) for r in results))

    return uniq("dim"), uniq("pooling"), uniq("threads")


def format_summary(results: Sequence[dict[str, Any]]) -> str:
    """One line per ``(D, L, threads)``: embstore's forward and step, the floor, the
    scaling, and each peer's step (and torch's forward) with its ratio to embstore's."""
    ix = index_results(results)
    dims, pools, threads = _cases(results)
    peers = [p for p in dict.fromkeys(r["peer"] for r in results) if p != "embstore"]
    head = [
        "D",
        "L",
        "threads",
        "embstore fwd ms",
        "embstore step ms",
        "floor ms",
        "step / floor",
        "speedup vs 1 thread",
    ]
    head += [f"{p} step ms (x)" for p in peers]
    if "torch" in peers:
        head.append("torch fwd ms (x)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(peer: str, d: int, lp: int, t: int, what: str) -> str:
        row, es = ix.get((peer, d, lp, t)), ix.get(("embstore", d, lp, t))
        if row is None:
            return "-"
        ratio = row[what] / es[what] if es and es[what] else None
        return f"{_fmt(row[what])} ({_fmt_ratio(ratio)})"

    for d in dims:
        for lp in pools:
            for t in threads:
                es = ix.get(("embstore", d, lp, t))
                one = ix.get(("embstore", d, lp, 1))
                speedup = (
                    one["step_ms"] / es["step_ms"]
                    if es and one and t != 1 and es["step_ms"]
                    else None
                )
                cells = [
                    str(d),
                    str(lp),
                    str(t),
                    _fmt(es["forward_ms"]) if es else "-",
                    _fmt(es["step_ms"]) if es else "-",
                    _fmt(es.get("floor_ms")) if es else "-",
                    _fmt_ratio(es.get("floor_ratio")) if es else "-",
                    _fmt_ratio(speedup) if t != 1 else "-",
                ]
                cells += [cell(p, d, lp, t, "step_ms") for p in peers]
                if "torch" in peers:
                    cells.append(cell("torch", d, lp, t, "forward_ms"))
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_targets(verdicts: Sequence[Verdict], threads: Sequence[int]) -> str:
    """The targets table: one line per (target, D, L), the value per embstore thread count
    (peers at their best thread count) and the status at the thread count it is judged at."""
    judged = f"status at {verdicts[0].judged_at} threads" if verdicts else "status"
    head = ["target", "D", "L", *(f"embstore {t} thread(s)" for t in threads), judged, "others"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in verdicts:
        vals = [
            _fmt_ratio(v.values.get(t)) if v.values.get(t) is not None else "-" for t in threads
        ]
        lines.append(
            f"| {v.text} (target {v.op} {v.threshold:g}x) | {v.dim} | {v.pooling} | "
            + " | ".join(vals)
            + f" | {v.status} | {_fmt(v.others_cores)} |"
        )
    return "\n".join(lines)


def format_floor(floor: dict[str, Any] | None) -> list[str]:
    """Lines on the traffic floor: the rates measured and each case's bytes and floor."""
    if not floor:
        return ["- traffic floor: not measured (--no-floor)"]
    out = []
    for r in floor["rates"]:
        gather = ", ".join(f"{k} B {v:.2f}" for k, v in r["gather_gb_s"].items())
        update = ", ".join(f"{k} B {v:.2f}" for k, v in r["update_gb_s"].items())
        times = int(r.get("measurements", 1))
        best = "best of 5" if times <= 1 else f"best of {times} measurements (one per pass) of 5"
        out.append(
            f"- memory rates, {r['threads']} thread(s), {best} on a large array "
            f"(other processes used {_fmt(r.get('others_cores'))} cores meanwhile): random "
            f"row gather {gather} GB/s; random row read-modify-write {update} GB/s; copy "
            f"{r['stream_gb_s']:.1f} GB/s (read + written)"
        )
    seen = set()
    by_batch = len({c.get("batch_size") for c in floor["cases"]}) > 1
    for c in floor["cases"]:
        key = (c["dim"], c["pooling"], c.get("batch_size"))
        if key in seen:
            continue
        seen.add(key)
        per = ", ".join(
            f"{x['floor_ms']:.2f} ms at {x['threads']} thread(s)"
            for x in floor["cases"]
            if (x["dim"], x["pooling"], x.get("batch_size")) == key
        )
        b = f" B={c['batch_size']}" if by_batch else ""
        out.append(
            f"- traffic floor{b} D={c['dim']} L={c['pooling']}: {c['unique_ids']:,.0f} distinct "
            f"of {c['ids']:,} ids per batch, {c['total_mb']:.1f} MB per step (index "
            f"{c['index_bytes'] / 1e6:.1f}, forward rows {c['forward_bytes'] / 1e6:.1f}, "
            f"backward rows {c['update_bytes'] / 1e6:.1f} read and written, streams "
            f"{c['stream_bytes'] / 1e6:.1f}) -> {per}"
        )
    return out


def _passes_text(cfg: dict[str, Any]) -> str:
    passes = int(cfg.get("passes", 1))
    if passes <= 1:
        return ""
    return f"{passes} passes (every peer's tables built afresh in each, peer order rotated) x "


def format_passes(results: Sequence[dict[str, Any]]) -> list[str]:
    """One line per case: each peer's step median in each pass (runs of 2+ passes)."""
    if not results:
        return []
    lowest = min(r["threads"] for r in results)
    by_batch = len({r.get("batch_size") for r in results}) > 1
    cases: dict[tuple[int, int, int, int], list[str]] = {}
    for r in results:
        per = r.get("pass_step_ms") or []
        if len(per) < 2 or (r["measured_threads"] is None and r["threads"] != lowest):
            continue  # a single-threaded peer is listed once per (D, L)
        key = (r.get("batch_size") or 0, r["dim"], r["pooling"], r["threads"])
        cases.setdefault(key, []).append(f"{r['peer']} {', '.join(_fmt(x) for x in per)}")
    return [
        f"- step ms per pass, {f'B={bs} ' if by_batch else ''}D={dim} L={lp} threads={threads}: "
        f"{'; '.join(parts)}"
        for (bs, dim, lp, threads), parts in cases.items()
    ]


def format_load_notes(env: dict[str, Any], results: Sequence[dict[str, Any]]) -> list[str]:
    """Notes on what the machine's load and the OpenMP wait policy did to the figures."""
    out = []
    passive = "PASSIVE" in str(env.get("omp_wait_policy"))
    openmp_multi = any(
        r["peer"] in ("torch", "fbgemm") and (r["threads"] or 1) > 1 for r in results
    )
    others = env.get("other_processes_cores")
    if others is not None and others > 0.2:
        out.append(
            f"- WARNING: other processes used {others:.2f} of the {env.get('cores')} cores on "
            "average during this run: figures are noisy, 2-thread figures most of all."
        )
        if not passive and openmp_multi:
            out.append(
                "  torch's and FBGEMM's multi-threaded rows are unreliable under contention "
                "(their OpenMP workers wait actively); rerun on a quiet machine, or with "
                "--omp-wait-policy passive (slower for them on a quiet machine)."
            )
    elif passive and openmp_multi:
        # Measured: W1 D=32, 2 threads, on the 2-core Xeon VM, torch's forward 2.58 ms
        # passive against 1.90 ms by default at L=8, 1.2 against 0.40 ms at L=1.
        out.append(
            "- NOTE: OMP_WAIT_POLICY=PASSIVE on a quiet machine: torch's and FBGEMM's OpenMP "
            "workers sleep between parallel regions, which slows their multi-threaded rows "
            "(up to 3x at L=1), and the targets take each peer at its best thread count, so "
            "they may flatter embstore here. Quote a run with the default policy."
        )
    return out


def format_report(report: dict[str, Any]) -> str:
    """Header, summary, targets, result table, floor, memory and verification lines."""
    env, cfg = report["environment"], report["config"]
    w5 = cfg.get("workload") == "w5"
    out = _header_lines(env, cfg, w5)
    results = report["results"]
    if results and w5:
        out += format_w5_sections(results)
    elif results:
        out += _w1_sections(results, cfg)
    out += [report["table"], ""]
    if any(r["measured_threads"] is None for r in report["results"]):
        out.append(
            "\\* single-threaded peer (numpy/pandas ignore the thread setting): measured "
            "once per D and L, repeated in each thread group for the ratio."
        )
        out.append("")
    out += format_load_notes(env, report["results"])
    for name, why in report["skipped"].items():
        out.append(f"- {name}: {why}")
    out += format_passes(report["results"])
    out += format_floor(report.get("floor"))
    out += _footer_lines(report)
    return "\n".join(out)


def _header_lines(env: dict[str, Any], cfg: dict[str, Any], w5: bool) -> list[str]:
    """The report's title and its run, machine, table and method lines."""
    return [
        "## embstore bench: W5 (26 Criteo-sized tables, D=16, small batches)"
        if w5
        else "## embstore bench: W1 (pooled training step, warm tables)",
        "",
        (
            f"- commit {env['commit']}, embstore {env['embstore']} "
            f"({env.get('kernels', 'n/a')} kernels), {env['date']}; other "
            f"processes used {_fmt(env.get('other_processes_cores'))} cores on average during "
            f"the run (load average {env.get('loadavg_start')} at start)"
        ),
        (
            f"- CPU {env['cpu']}, {env['cores']} cores ({env['cores_usable']} usable), "
            f"Python {env['python']}, numpy {env['numpy']}, torch {env['torch']} "
            f"(OMP_WAIT_POLICY={env.get('omp_wait_policy')}), fbgemm-gpu-cpu "
            f"{env.get('fbgemm', 'n/a')}, pandas {env['pandas']}"
        ),
        _w5_sizes_line(cfg)
        if w5
        else (
            f"- T={cfg['num_tables']} tables, U={cfg['universe']:,} ids each (all inserted "
            f"before timing, in placement order), B={cfg['batch_size']}, Zipf alpha "
            f"{ZIPF_ALPHA}, Adagrad lr {LR} eps {EPS}, seed {cfg['seed']}"
        ),
        (
            f"- medians over {_passes_text(cfg)}{cfg['batches']} timed batches after "
            f"{cfg['warmup']} untimed warm-up batch(es); step = forward + backward of the "
            "same batch; ratios are peer / embstore (> 1: embstore is faster); others = "
            "cores used by other processes while the row was timed (rows above ~0.2 are "
            "unreliable)"
        ),
        "",
    ]


def _w1_sections(results: list[dict[str, Any]], cfg: dict[str, Any]) -> list[str]:
    """W1's summary and targets tables, with how to read them."""
    out: list[str] = []
    dims, pools, threads = _cases(results)
    out += [
        ("### Summary: embstore against each peer (x = peer / embstore, > 1: embstore is faster)"),
        "",
        format_summary(results),
        "",
        "### Targets: ratios measured in this run",
        "",
        format_targets(evaluate(results, dims, pools, threads), threads),
        "",
        (
            "Each peer at its best (lowest) median over the thread counts run; the status "
            "is judged at the targets' thread count (2, else the most run); n/a: a peer it "
            "needs did not run; others: the most cores other processes used while the rows "
            "the judged value reads were timed (above ~0.2 the verdict is unreliable)."
        ),
        "",
    ]
    if cfg["universe"] != CANONICAL_UNIVERSE:
        out += [
            (
                f"The targets are defined on W1 at full size (--full, U="
                f"{CANONICAL_UNIVERSE:,}); this run used U={cfg['universe']:,}, so the "
                "verdicts are indicative only (smaller tables fit the caches better)."
            ),
            "",
        ]
    out += ["### All measurements", ""]
    return out


def _footer_lines(report: dict[str, Any]) -> list[str]:
    """Memory, setup, RSS and verification lines."""
    out: list[str] = []
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
    held = [m for m in report["setup"] if m.get("rss_mib") is not None]
    if held:
        per = ", ".join(
            f"{m['peer']} D={m['dim']}"
            + (f" t={m['threads']}" if m.get("threads") else "")
            + f" {m['rss_mib'] / 1024:.1f}"
            for m in held
        )
        peak = report["environment"].get("peak_rss_mib")
        out.append(
            f"- process RSS with each peer's tables built, GiB (one peer at a time): {per}; "
            f"peak RSS of the run {_fmt((peak or 0) / 1024, 1)} GiB"
        )
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
    return out


def _w5_sizes_line(cfg: dict[str, Any]) -> str:
    cards = w5_cardinalities(cfg["universe"], cfg["num_tables"])
    sizes = ", ".join(str(b) for b in (cfg.get("batch_sizes") or [cfg["batch_size"]]))
    return (
        f"- T={len(cards)} tables of {min(cards):,} to {max(cards):,} rows "
        f"({sum(cards):,} in all; Criteo cardinalities capped at {cfg['universe']:,}), every "
        f"id inserted before timing in a fixed random order per table, B={sizes}, Zipf "
        f"alpha {ZIPF_ALPHA}, Adagrad lr {LR} eps {EPS}, seed {cfg['seed']}"
    )


def format_w5_sections(results: Sequence[dict[str, Any]]) -> list[str]:
    """W5's summary (one table per batch size) and issue 32's targets."""
    out = []
    for bs in dict.fromkeys(int(r.get("batch_size") or 0) for r in results):
        sub = [r for r in results if int(r.get("batch_size") or 0) == bs]
        out += [
            (
                f"### Summary, B={bs}: embstore against each peer (x = peer / embstore, > 1: "
                "embstore is faster)"
            ),
            "",
            format_summary(sub),
            "",
        ]
    out += [
        "### Targets (issue 32, W5): ratios measured in this run",
        "",
        format_w5_targets(results),
        "",
        "### All measurements",
        "",
    ]
    return out
