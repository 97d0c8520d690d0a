"""The results page (``--markdown``) and the README's table, generated from saved results.

Input: W1 reports saved with ``--json`` (one per machine and D; the first file's machine is
the one the README quotes), optionally W5 reports (``--workload w5 --json``, told apart by
their config; the section is ``page_w5``) and workloads files (W2, W3, W4, checkpoints,
optimizers). Every figure and ratio on the page is computed here from those files, so the
page cannot drift from the data; the prose around the tables is ``page_text``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from embstore.bench import page_text
from embstore.bench.page_w5 import batch_sizes, bench_command, w5_section
from embstore.bench.report import format_summary
from embstore.bench.results_io import split_runs
from embstore.bench.targets import TARGET_THREADS, TARGETS, evaluate, index_results
from embstore.bench.w5 import CRITEO_CARDINALITIES

Report = dict[str, Any]
#: CPU string -> {"name": short machine name, "about": one line on it} (workloads file).
Labels = dict[str, dict[str, str]]

#: Peers of the README table, with their column titles.
README_PEERS = (
    ("fbgemm", "vs FBGEMM TBE"),
    ("torch", "vs torch `embedding_bag` + sparse Adagrad"),
    ("numpy", "vs numpy dense floor"),
    ("pandas", "vs pandas + numpy store"),
)


def ratio(x: float | None) -> str:
    """A ratio as the page prints it."""
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def _span(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def machines(reports: Sequence[Report]) -> list[tuple[str, list[Report]]]:
    """Reports grouped by CPU, machines in order of first appearance, each's reports by D."""
    groups: dict[str, list[Report]] = {}
    for r in reports:
        groups.setdefault(str(r["environment"]["cpu"]), []).append(r)
    return [(cpu, sorted(rs, key=lambda r: min(r["config"]["dims"]))) for cpu, rs in groups.items()]


def merged_results(reports: Sequence[Report]) -> list[dict[str, Any]]:
    """The result rows of several runs of one machine (each run its own D)."""
    return [row for r in reports for row in r["results"]]


def _label(cpu: str, labels: Labels) -> str:
    return labels.get(cpu, {}).get("name", cpu)


def machine_line(cpu: str, reports: Sequence[Report], labels: Labels) -> str:
    """One line: the machine, software, commit, dates, size and noise of its runs."""
    env = reports[0]["environment"]
    cfg = reports[0]["config"]
    commits = ", ".join(dict.fromkeys(str(r["environment"]["commit"]) for r in reports))
    dates = ", ".join(dict.fromkeys(str(r["environment"]["date"])[:10] for r in reports))
    others = max(float(r["environment"].get("other_processes_cores") or 0) for r in reports)
    return (
        f"- **{_label(cpu, labels)}** (`{cpu}`, {env['cores']} cores"
        f"{'; ' + labels[cpu]['about'] if 'about' in labels.get(cpu, {}) else ''}): commit {commits}, "
        f"{dates}; Python {env['python']}, numpy {env['numpy']}, torch {env['torch']}, "
        f"fbgemm-gpu-cpu {env.get('fbgemm', 'n/a')}, pandas {env['pandas']}; "
        f"OMP_WAIT_POLICY {env.get('omp_wait_policy')}; T={cfg['num_tables']}, "
        f"U={cfg['universe']:,}, B={cfg['batch_size']}, {cfg.get('passes', 1)} pass(es) x "
        f"{cfg['batches']} timed batches; other processes used at most {others:.2f} cores"
    )


def _cases(results: Sequence[dict[str, Any]]) -> tuple[list[int], list[int], list[int]]:
    def uniq(key: str) -> list[int]:
        return sorted(dict.fromkeys(int(r[key]) for r in results))

    return uniq("dim"), uniq("pooling"), uniq("threads")


def targets_matrix(results: Sequence[dict[str, Any]]) -> str:
    """One line per target, one column per (D, L): the value at the judged thread count."""
    dims, pools, threads = _cases(results)
    verdicts = evaluate(results, dims, pools, threads)
    cols = [(d, lp) for d in dims for lp in pools]
    head = ["target", *(f"D={d} L={lp}" for d, lp in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tg in TARGETS:
        cells = [f"{tg.text} ({tg.op} {tg.threshold(8):g}x)"]
        if tg.key == "torch_fwd":
            cells[0] = f"{tg.text} (<= 1.25x at L>1, <= 1.5x at L=1)"
        for d, lp in cols:
            v = next((v for v in verdicts if (v.key, v.dim, v.pooling) == (tg.key, d, lp)), None)
            if v is None:
                cells.append("-")
            else:
                cells.append(f"{ratio(v.values.get(v.judged_at))} {v.status}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def w1_section(groups: Sequence[tuple[str, list[Report]]], labels: Labels) -> list[str]:
    """Per machine: the runner's summary table and the targets at 2 threads."""
    out = [
        "## W1: training step",
        "",
        page_text.W1_INTRO,
    ]
    for cpu, reports in groups:
        results = merged_results(reports)
        out += [
            "",
            f"### {_label(cpu, labels)}",
            "",
            format_summary(results),
            "",
            f"Targets at {TARGET_THREADS} threads:",
            "",
            targets_matrix(results),
        ]
    return [*out, "", page_text.TARGETS_NOTE, "", page_text.PLOT]


def memory_section(
    groups: Sequence[tuple[str, list[Report]]], labels: Labels, w5: Sequence[Report] = ()
) -> list[str]:
    """Resident memory per row of W1's tables (then W5's, if given), against the id +
    weights + Adagrad payload."""
    out = [
        "## Memory",
        "",
        page_text.MEMORY_INTRO,
        "",
        "| machine | D | rows | RSS bytes/row | `stats()['bytes_per_row']` | payload | RSS / payload |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = [(_label(cpu, labels), r) for cpu, reports in groups for r in reports]
    runs += [(_label(str(r["environment"]["cpu"]), labels) + ", W5", r) for r in w5]
    for label, report in runs:
        for m in (m for m in report["memory"] if "error" not in m):
            rss, payload = float(m["rss_bytes_per_row"]), int(m["payload_bytes_per_row"])
            out.append(
                f"| {label} | {m['dim']} | {m['rows']:,} | {rss:.1f} | "
                f"{float(m['stats_bytes_per_row']):.1f} | {payload} | {rss / payload:.3f}x |"
            )
    return out


def _runs(xs: Sequence[float]) -> str:
    return ", ".join(ratio(x) for x in xs)


def workloads_sections(work: dict[str, Any], labels: Labels) -> list[str]:
    """W2, W3, W4, checkpoint and optimizer tables; ratios computed from the figures."""
    lab = {**labels, **work.get("machines", {})}
    out = [
        "## W2: eviction churn",
        "",
        page_text.W2_INTRO,
        "",
        "| machine | commit | W2 step ms | W1 step ms | W2 / W1 | hit rate | evictions/s | RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in work.get("w2", []):
        ratios = [a / b for a, b in zip(e["w2_step_ms"], e["w1_step_ms"], strict=True)]
        out.append(
            f"| {_label(e['machine'], lab)} | {e['commit']} | "
            f"{', '.join(f'{x:.2f}' for x in e['w2_step_ms'])} | "
            f"{', '.join(f'{x:.2f}' for x in e['w1_step_ms'])} | {_runs(ratios)} | "
            f"{e['hit_rate']:.3f} | {_span(e['evictions_m_per_s'])} M | {_span(e['rss_mib'], '{:.0f}')} |"
        )
    out += [
        "",
        "## W3: concurrent callers",
        "",
        page_text.W3_INTRO,
        "",
        "| machine | commit | K=8 M ids/s | K=2 M ids/s | K=8 / K=2 | worst P99 / P50 |",
        "|---|---|---|---|---|---|",
    ]
    for e in work.get("w3", []):
        k8, k2 = float(e["k8_m_ids_per_s"]), float(e["k2_m_ids_per_s"])
        out.append(
            f"| {_label(e['machine'], lab)} | {e['commit']} | {k8:.2f} | {k2:.2f} | "
            f"{ratio(k8 / k2)} | {ratio(float(e['worst_p99_over_p50']))} |"
        )
    out += [
        "",
        "## W4: read-only lookup",
        "",
        page_text.W4_INTRO,
        "",
        "| machine | commit | embstore M ids/s | torch M ids/s | embstore / torch | P50 ms | P99 ms | miss rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in work.get("w4", []):
        torch_rates = e.get("torch_m_ids_per_s") or []
        same = len(torch_rates) == len(e["m_ids_per_s"])
        ratios = [a / b for a, b in zip(e["m_ids_per_s"], torch_rates, strict=True)] if same else []
        out.append(
            f"| {_label(e['machine'], lab)} | {e['commit']} | "
            f"{', '.join(f'{x:.1f}' for x in e['m_ids_per_s'])} | "
            f"{', '.join(f'{x:.1f}' for x in torch_rates) or '-'} | {_runs(ratios) or 'n/a'} | "
            f"{_span(e['p50_ms'])} | {_span(e['p99_ms'])} | {e['miss_rate']:.3f} |"
        )
    return out + checkpoint_section(work, lab) + optimizer_section(work, lab)


def checkpoint_section(work: dict[str, Any], lab: Labels) -> list[str]:
    """Save and load throughput of W1's eight tables (268 MB files), and a save's memory."""
    if not work.get("checkpoint"):
        return []
    out = [
        "",
        "## Checkpoints",
        "",
        page_text.CHECKPOINT_INTRO,
        "",
        "| machine | commit | to | save GB/s | load GB/s | peak extra RSS of a table |",
        "|---|---|---|---|---|---|",
    ]
    for e in work["checkpoint"]:
        out.append(
            f"| {_label(e['machine'], lab)} | {e['commit']} | {e['dir']} | "
            f"{_span(e['save_gb_s'])} ({e['save_best_gb_s']:.2f}) | "
            f"{_span(e['load_gb_s'])} ({e['load_best_gb_s']:.2f}) | "
            f"{_span(e['extra_rss_pct'], '{:.1f}')}% |"
        )
    return out


def optimizer_section(work: dict[str, Any], lab: Labels) -> list[str]:
    """W1's embstore step per optimizer (row stride = weights + optimizer state)."""
    opt = work.get("optimizers")
    if not opt:
        return []
    out = [
        "",
        "## Step time by optimizer",
        "",
        page_text.OPTIMIZER_INTRO.format(machine=_label(opt["machine"], lab), commit=opt["commit"]),
        "",
        "| optimizer | row stride (floats) | L | fwd ms | bwd+upd ms | step ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in opt["rows"]:
        out.append(
            f"| {r['optimizer']} | {r['stride']} | {r['pooling']} | {r['forward_ms']:.2f} | "
            f"{r['backward_ms']:.2f} | {r['step_ms']:.2f} |"
        )
    return out


def merge_workloads(workloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several workloads files as one: their entries in file order, the last optimizer table."""
    merged: dict[str, Any] = {"machines": {}}
    for w in workloads:
        merged["machines"].update(w.get("machines", {}))
        for key in ("w2", "w3", "w4", "checkpoint"):
            merged.setdefault(key, []).extend(w.get(key, []))
        if w.get("optimizers"):
            merged["optimizers"] = w["optimizers"]
    return merged


def _readme_row(case: str, es_step: float, rows: Sequence[dict[str, Any]]) -> str:
    """A README line: embstore's step and each peer's best step (over the thread counts
    of ``rows``, the results of one case) over it."""
    cells = [case, f"**{es_step:.2f} ms**"]
    for peer, _ in README_PEERS:
        steps = [float(r["step_ms"]) for r in rows if r["peer"] == peer]
        cells.append(ratio(min(steps) / es_step) if steps else "n/a")
    return "| " + " | ".join(cells) + " |"


def _w5_readme(w5: Report, labels: Labels) -> tuple[list[str], str]:
    """The README lines of a W5 run (one per batch size, largest first) and their note."""
    results = w5["results"]
    threads = sorted({int(r["threads"]) for r in results})
    t = TARGET_THREADS if TARGET_THREADS in threads else max(threads, default=TARGET_THREADS)
    cfg, env = w5["config"], w5["environment"]
    d, lp = cfg["dims"][0], cfg["poolings"][0]
    lines = []
    for bs in sorted(batch_sizes(results), reverse=True):
        rows = [r for r in results if int(r.get("batch_size") or 0) == bs]
        es = next((r for r in rows if (r["peer"], int(r["threads"])) == ("embstore", t)), None)
        if es is not None:
            lines.append(_readme_row(f"W5: {d}, {lp}, B={bs}", float(es["step_ms"]), rows))
    universe = int(cfg["universe"])
    sizes = (
        "at their Criteo sizes"
        if universe >= max(CRITEO_CARDINALITIES)
        else f"capped at U={universe:,} rows"
    )
    flags = bench_command(cfg).removeprefix("python -m embstore bench ")
    note = (
        f"W5 rows: {env['cores']}-core {_label(str(env['cpu']), labels)}, "
        f"{str(env['date'])[:10]}, `{flags}` ({cfg['num_tables']} Criteo tables {sizes})."
    )
    return lines, note


def readme_table(reports: Sequence[Report], labels: Labels | None = None) -> str:
    """The README's performance table: the first machine's W1 embstore step at 2 threads
    against each peer at its best thread count, with its machine line; then, given a W5
    report (the first of that machine's, else the first), its rows and a note on its run."""
    labels = labels or {}
    w1, w5 = split_runs(reports)
    cpu, runs = machines(w1)[0]
    results = merged_results(runs)
    ix = index_results(results)
    dims, pools, threads = _cases(results)
    t = TARGET_THREADS if TARGET_THREADS in threads else max(threads)
    head = ["D, L", f"embstore step, {t} threads", *(title for _, title in README_PEERS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in dims:
        for lp in sorted(pools, reverse=True):
            es = ix.get(("embstore", d, lp, t))
            if es is None:
                continue
            case = [r for r in results if (r["dim"], r["pooling"]) == (d, lp)]
            lines.append(_readme_row(f"{d}, {lp}", float(es["step_ms"]), case))
    env = runs[0]["environment"]
    note = (
        f"2-core {_label(cpu, labels)}, {str(env['date'])[:10]}, `--full` "
        f"(U={runs[0]['config']['universe']:,}): each ratio is the peer's step over embstore's "
        "in the same run (> 1: embstore is faster), each peer at its best thread count."
    )
    if w5:
        same = [r for r in w5 if str(r["environment"]["cpu"]) == cpu]
        w5_lines, w5_note = _w5_readme((same or w5)[0], labels)
        lines += w5_lines
        note += " " + w5_note
    return "\n".join(lines) + "\n\n" + note


def results_page(
    reports: Sequence[Report], workloads: Sequence[dict[str, Any]], command: str
) -> str:
    """The whole page: fixed text, then the tables computed from ``reports`` and ``workloads``."""
    labels: Labels = {}
    for w in workloads:
        labels.update(w.get("machines", {}))
    w1, w5 = split_runs(reports)
    groups = machines(w1)
    out = [
        page_text.TITLE,
        "",
        page_text.STAMP.format(command=command),
        "",
        page_text.INTRO,
        "## Machines",
        "",
        *(machine_line(cpu, rs, labels) for cpu, rs in groups),
        "",
        *w1_section(groups, labels),
        "",
    ]
    if w5:
        runs = [(r, _label(str(r["environment"]["cpu"]), labels)) for r in w5]
        out += [*w5_section(runs), ""]
    out += [*memory_section(groups, labels, w5), ""]
    if workloads:
        out += [*workloads_sections(merge_workloads(workloads), labels), ""]
    out += [page_text.HOW_TO_RUN, page_text.METHOD, page_text.MICRO]
    return "\n".join(out).rstrip() + "\n"
