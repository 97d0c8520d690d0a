"""Command line of ``python -m embstore bench``: flags -> :class:`BenchConfig` -> report."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from embstore.bench.page import readme_table, results_page
from embstore.bench.peers import PEERS
from embstore.bench.plot import PlotUnavailable, plot_report, require_matplotlib
from embstore.bench.reference import VerificationError
from embstore.bench.report import format_report
from embstore.bench.results_io import load_report, load_results, split_runs
from embstore.bench.runner import W5_FULL_BATCHES, BenchConfig, run
from embstore.bench.w5 import CRITEO_CARDINALITIES
from embstore.bench.workload import placement


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not vals or min(vals) <= 0:
        msg = f"expected positive integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return vals


def _positive_int(text: str) -> int:
    return _int_list(text)[0]


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _add_workload_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        choices=("w1", "w5"),
        default="w1",
        help="w1 (default) or w5: the 26 Criteo-sized tables, D=16, L=1, B=512,128; "
        "--universe then caps each table's rows (default 100,000; --full: no cap and "
        f"{W5_FULL_BATCHES} timed batches)",
    )


def build_parser(prog: str = "python -m embstore bench") -> argparse.ArgumentParser:
    """The ``bench`` argument parser."""
    quick, full = BenchConfig(), BenchConfig.full()
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Run W1 (the pooled training step on warm tables, bench/README.md) for embstore and its "
            "peers, verify every peer against numpy, and print one markdown table. The "
            f"default is a quick run (U={quick.universe:,}, {quick.batches} timed batches); "
            f"--full is the canonical size (U={full.universe:,}, {full.batches} timed batches)."
        ),
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="canonical W1 sizes (T=8, U=1,000,000, B=2048, D=32, L=1,8, "
        "threads 1,2, 20 timed batches, 3 passes); other flags override",
    )
    _add_workload_flag(p)
    p.add_argument("--tables", type=_positive_int, metavar="T", help="tables (default 8)")
    p.add_argument(
        "--universe",
        type=_positive_int,
        metavar="U",
        help=f"ids per table, all inserted before timing (default {quick.universe:,})",
    )
    p.add_argument(
        "--batch",
        type=_int_list,
        metavar="B[,B...]",
        help="examples per batch (2048; W5 512,128), each timed on the same tables",
    )
    p.add_argument("--dim", type=_int_list, metavar="D[,D...]", help="embedding dims (32)")
    p.add_argument(
        "--pooling", type=_int_list, metavar="L[,L...]", help="ids per example per table (1,8)"
    )
    p.add_argument(
        "--threads",
        type=_int_list,
        metavar="N[,N...]",
        help="thread counts of embstore and torch (1,2)",
    )
    p.add_argument(
        "--batches",
        type=_positive_int,
        metavar="N",
        help=f"timed batches per case (default {quick.batches}, --full {full.batches}, "
        f"W5 --full {W5_FULL_BATCHES})",
    )
    p.add_argument(
        "--warmup",
        type=int,
        metavar="N",
        help=f"untimed steps before timing (default {quick.warmup})",
    )
    p.add_argument(
        "--passes",
        type=_positive_int,
        metavar="N",
        help="build and time every peer N times, pooling the batches of all passes "
        f"(default {quick.passes}, --full {full.passes}; peer order rotates each pass)",
    )
    p.add_argument(
        "--peers",
        type=_str_list,
        metavar="NAME[,NAME...]",
        help=f"peers to run, from: {', '.join(PEERS)} (default: all)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    p.add_argument("--seed", type=int, help="seed of the key stream and gradients (0)")
    p.add_argument(
        "--omp-wait-policy",
        choices=("torch-default", "active", "passive"),
        help="OMP_WAIT_POLICY for torch's (and FBGEMM's) workers (default: leave it to "
        "torch; 'passive' keeps their 2-thread figures sane when other processes load the "
        "machine)",
    )
    p.add_argument(
        "--no-floor",
        action="store_true",
        help="do not measure memory rates nor report the traffic floor",
    )
    p.add_argument(
        "--floor-mib",
        type=_positive_int,
        metavar="MIB",
        help="size of the array the floor's memory rates are measured on "
        f"(default {quick.floor_array_mib}; keep it >> the last-level cache)",
    )
    _add_output_flags(p)
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """The flags that turn saved runs into a plot, a results page or the README's table."""
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw a PNG: step throughput by peer and embstore against threads "
        "(needs matplotlib)",
    )
    p.add_argument(
        "--from-json",
        metavar="PATH",
        nargs="+",
        help="do not run: print the report (and --plot) of runs saved with --json; with "
        "--markdown or --readme-table, W1 and W5 reports (told apart by their config) and "
        "files of W2-W4 figures (bench/results/)",
    )
    p.add_argument(
        "--markdown",
        metavar="OUT",
        nargs="?",
        const="-",
        help="write the results page (bench/README.md) generated from --from-json files "
        "to OUT (default: stdout); the first file's machine is the README's",
    )
    p.add_argument(
        "--readme-table",
        action="store_true",
        help="print README.md's performance table generated from --from-json files",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A :class:`BenchConfig` from parsed flags (``--full`` first, then explicit flags)."""
    if args.workload == "w5":
        cfg = BenchConfig.w5(full=args.full)
    else:
        cfg = BenchConfig.full() if args.full else BenchConfig()
    overrides: dict[str, Any] = {
        "num_tables": args.tables,
        "universe": args.universe,
        "batch_size": args.batch[0] if args.batch else None,
        "batch_sizes": args.batch,
        "dims": args.dim,
        "poolings": args.pooling,
        "threads": args.threads,
        "batches": args.batches,
        "warmup": args.warmup,
        "passes": args.passes,
        "peers": args.peers,
        "seed": args.seed,
        "json_path": args.json,
        "omp_wait_policy": args.omp_wait_policy,
        "floor_array_mib": args.floor_mib,
    }
    for k, v in overrides.items():
        if v is not None:
            setattr(cfg, k, v)
    cfg.progress = not args.no_progress
    cfg.floor = not args.no_floor
    if cfg.warmup < 0:
        msg = "--warmup must be >= 0"
        raise ValueError(msg)
    if cfg.workload == "w5":
        if cfg.num_tables > len(CRITEO_CARDINALITIES):
            msg = f"--tables: W5 has {len(CRITEO_CARDINALITIES)} tables, got {cfg.num_tables}"
            raise ValueError(msg)
    else:
        placement(cfg.universe)  # fail early on a universe that breaks the placement order
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m embstore bench`` and ``bench/run.py``.

    Returns
    -------
    int
        0 on success, 1 if a peer failed verification, 2 on bad arguments.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.plot:
        try:  # before a long run, not after it
            require_matplotlib()
        except PlotUnavailable as exc:
            parser.error(str(exc))
    if args.markdown or args.readme_table:
        return _write_pages(parser, args)
    if args.from_json:
        for path in args.from_json[:-1]:
            print(format_report(_load_or_exit(parser, path)) + "\n")
        report = _load_or_exit(parser, args.from_json[-1])
    else:
        try:
            report = run(cfg)
        except VerificationError as exc:
            print(f"verification failed: {exc}", file=sys.stderr)
            return 1
    print(format_report(report))
    if cfg.json_path and not args.from_json:
        Path(cfg.json_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"\nJSON report written to {cfg.json_path}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"\nplot written to {args.plot}")
    return 0


def _load_or_exit(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    try:
        return load_report(path)
    except (OSError, ValueError) as exc:
        parser.error(f"--from-json {path}: {exc}")


def _write_pages(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--markdown`` / ``--readme-table``: pages generated from saved results only."""
    if not args.from_json:
        parser.error("--markdown and --readme-table need --from-json FILE [FILE ...]")
    try:
        reports, workloads = load_results(args.from_json)
    except ValueError as exc:
        parser.error(f"--from-json {exc}")
    if not split_runs(reports)[0]:
        parser.error("--from-json: no W1 report among the files")
    labels = {k: v for w in workloads for k, v in w.get("machines", {}).items()}
    if args.readme_table:
        print(readme_table(reports, labels))
    if args.markdown:
        out = args.markdown
        command = " ".join(
            ["python -m embstore bench --from-json", *args.from_json, "--markdown", out]
        )
        page = results_page(reports, workloads, command)
        if out == "-":
            sys.stdout.write(page)
        else:
            Path(out).write_text(page)
    return 0
