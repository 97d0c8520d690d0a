"""The results page's W5 section, generated from W5 runner reports (``--workload w5 --json``).

Every quantity is the W5 report's own: the summaries are :func:`report.format_summary` per
batch size and the targets table pivots :func:`targets_w5.w5_target_values` into one line
per (B, threads), so the page and ``python -m embstore bench --workload w5`` agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from embstore.bench import page_text, targets_w5
from embstore.bench.report import format_summary
from embstore.bench.runner import BenchConfig
from embstore.bench.targets import TARGET_THREADS
from embstore.bench.w5 import CRITEO_CARDINALITIES, w5_cardinalities

Report = dict[str, Any]

#: Columns of the targets table: (target text in targets_w5, column title).
_TARGET_COLUMNS = (
    (targets_w5.FLOOR, "step / floor"),
    (targets_w5.FORWARD, "fwd / torch fwd"),
    (targets_w5.FBGEMM, "FBGEMM step / embstore step"),
    (targets_w5.SCALING, "speedup vs 1 thread / floor's"),
)

#: Config fields that ``python -m embstore bench`` sets from a flag, with the flag.
_FLAGS = (
    ("num_tables", "--tables"),
    ("universe", "--universe"),
    ("batch_sizes", "--batch"),
    ("dims", "--dim"),
    ("poolings", "--pooling"),
    ("threads", "--threads"),
    ("batches", "--batches"),
    ("warmup", "--warmup"),
    ("passes", "--passes"),
    ("peers", "--peers"),
    ("seed", "--seed"),
    ("omp_wait_policy", "--omp-wait-policy"),
    ("floor_array_mib", "--floor-mib"),
)


def batch_sizes(results: Sequence[Mapping[str, Any]]) -> list[int]:
    """The batch sizes of a W5 run's results, in run order."""
    return list(dict.fromkeys(int(r.get("batch_size") or 0) for r in results))


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, (list, tuple)) else v


def bench_command(config: Mapping[str, Any]) -> str:
    """The ``python -m embstore bench`` command that runs a W5 report's ``config`` again
    (``--full`` when no table is capped, then every flag whose value differs from it)."""
    full = int(config["universe"]) >= max(CRITEO_CARDINALITIES)
    base = asdict(BenchConfig.w5(full=full))
    args = ["python -m embstore bench --workload w5", *(["--full"] if full else [])]
    for key, flag in _FLAGS:
        value = _plain(config.get(key, base[key]))
        if value == _plain(base[key]):
            continue
        args.append(f"{flag} {','.join(map(str, value)) if isinstance(value, list) else value}")
    if not config.get("floor", True):
        args.append("--no-floor")
    return " ".join(args)


def _value(v: float | None, op: str, thr: float, judged: bool) -> str:
    """A ratio cell: the value, with the target's verdict where it is judged."""
    if v is None or not math.isfinite(v):
        return "n/a"
    text = targets_w5.format_ratio(v, op, thr)
    return f"{text} {targets_w5.target_status(v, op, thr)}" if judged else text


def targets_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One line per (B, threads): embstore's step and each W5 target's value (with its
    verdict at the judged thread count); "-" where a target does not apply."""
    values = targets_w5.w5_target_values(results)
    found = {(text, bs): (op, thr, vals) for text, bs, op, thr, vals in values}
    sizes = batch_sizes(results)
    threads = sorted({int(r["threads"]) for r in results})
    at = TARGET_THREADS if TARGET_THREADS in threads else max(threads)
    small, big = min(sizes), max(sizes)
    ids_text = targets_w5.IDS_RATE.format(small=small, big=big)
    columns = [*_TARGET_COLUMNS, (ids_text, f"ids/s vs B={big}'s")]
    head = ["B", "threads", "embstore step ms", *(title for _, title in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bs in sizes:
        for t in threads:
            es = next(
                (
                    r
                    for r in results
                    if (r["peer"], int(r.get("batch_size") or 0), int(r["threads"]))
                    == ("embstore", bs, t)
                ),
                None,
            )
            cells = [str(bs), str(t), f"{float(es['step_ms']):.2f}" if es else "-"]
            for text, _ in columns:
                entry = found.get((text, bs))
                if entry is None or t not in entry[2]:
                    cells.append("-")
                    continue
                op, thr, vals = entry
                judged = t == at or text in targets_w5.AT_EVERY_THREAD_COUNT
                cells.append(_value(vals[t], op, thr, judged))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + _targets_line(values, at)


def _targets_line(values: Sequence[tuple[str, int, str, float, Any]], at: int) -> str:
    """The targets, each threshold once (per batch size where they differ)."""
    by_text: dict[str, list[tuple[int, str, float]]] = {}
    for text, bs, op, thr, _ in values:
        by_text.setdefault(text, []).append((bs, op, thr))
    parts = []
    for text, cases in by_text.items():
        if len({(op, thr) for _, op, thr in cases}) == 1:
            _, op, thr = cases[0]
            parts.append(f"{text} {op} {thr:g}x")
        else:
            parts.append(
                text + " " + ", ".join(f"{op} {thr:g}x at B={bs}" for bs, op, thr in cases)
            )
    return (
        f"Targets (issue 32), judged at {at} threads (the forward at every thread count): "
        + "; ".join(parts)
        + "."
    )


def run_line(report: Report, label: str) -> str:
    """One line on a W5 run: machine, commit, date, command, sizes and noise."""
    env, cfg = report["environment"], report["config"]
    cards = w5_cardinalities(int(cfg["universe"]), int(cfg["num_tables"]))
    sizes = ", ".join(str(b) for b in batch_sizes(report["results"]))
    return (
        f"- **{label}** (`{env['cpu']}`, {env['cores']} cores): commit {env['commit']}, "
        f"{str(env['date'])[:10]}, `{bench_command(cfg)}`; torch {env['torch']}, "
        f"fbgemm-gpu-cpu {env.get('fbgemm', 'n/a')}, OMP_WAIT_POLICY "
        f"{env.get('omp_wait_policy')}; T={len(cards)} tables of {min(cards):,} to "
        f"{max(cards):,} rows ({sum(cards):,} in all), B={sizes}, {cfg.get('passes', 1)} "
        f"pass(es) x {cfg['batches']} timed batches; other processes used "
        f"{float(env.get('other_processes_cores') or 0):.2f} cores"
    )


def w5_section(runs: Sequence[tuple[Report, str]]) -> list[str]:
    """The W5 section: per (report, machine label), its run line, the summary of each
    batch size and the targets table."""
    out = ["## W5: 26 Criteo-sized tables", "", page_text.W5_INTRO]
    for report, label in runs:
        results = report["results"]
        out += ["", f"### {label}", "", run_line(report, label)]
        if not results:
            continue
        for bs in batch_sizes(results):
            sub = [r for r in results if int(r.get("batch_size") or 0) == bs]
            out += ["", f"Summary at B={bs}:", "", format_summary(sub)]
        out += ["", "Targets:", "", targets_table(results)]
    return out
