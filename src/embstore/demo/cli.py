"""``python -m embstore demo``: train a CTR model whose sparse features live in embstore.

Reads (or generates) the data, builds one Adagrad table per field, trains the model in
order over the training part, logs a line per window of steps, evaluates on the held-out
part read-only and prints ``test_auc=0.xxxx test_logloss=0.xxxx examples_per_s=N`` last.
With ``--holdout F`` it tunes instead: it trains on the first part of the training data,
scores its last ``F`` and prints ``holdout_auc=...``; the test data is never read.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from embstore.demo import readers
from embstore.demo.data import CTRData, DataError
from embstore.demo.defaults import DEFAULTS, default_factor_scale, default_lr
from embstore.demo.evaluation import auc
from embstore.demo.fm import FactorizationMachine, build_group
from embstore.demo.report import ProgressBar, check_plot_available, format_record, write_plot
from embstore.demo.synthetic import synthetic
from embstore.demo.train import Model, evaluate, train

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m embstore demo",
        description="Train a CTR model (a factorization machine, or DeepFM with torch) whose "
        "sparse features go through embstore tables with Adagrad, log AUC, logloss, "
        "throughput and the store's latency as it trains, then evaluate on held-out data. "
        "The last line is 'test_auc=... test_logloss=... examples_per_s=...'.",
    )
    data = p.add_argument_group("data")
    data.add_argument(
        "--data",
        metavar="PATH",
        help="a Criteo-format TSV (label, 13 integer, 26 categorical columns) or a libFM file "
        "(label id:value ...); default: a synthetic CTR stream generated in-process",
    )
    data.add_argument("--format", choices=("auto", "criteo", "libfm"), default="auto")
    data.add_argument(
        "--test",
        metavar="PATH",
        help="held-out file (same format); default: the last --test-fraction of the data",
    )
    data.add_argument("--test-fraction", type=float, default=0.2, metavar="F")
    data.add_argument(
        "--holdout",
        type=float,
        default=None,
        metavar="F",
        help="tuning: train on the training part but its last F, report the AUC on that F "
        "(last line 'holdout_auc=...'); the test data is not read",
    )
    data.add_argument(
        "--examples",
        type=int,
        default=DEFAULTS["examples"],
        metavar="N",
        help="synthetic data: number of examples (default %(default)s)",
    )
    data.add_argument(
        "--fields",
        type=int,
        default=DEFAULTS["fields"],
        metavar="N",
        help="synthetic data: number of fields (default %(default)s)",
    )
    model = p.add_argument_group("model and training")
    model.add_argument("--model", choices=("fm", "dnn"), default="fm", help="dnn needs torch")
    model.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], metavar="N")
    model.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], metavar="B")
    model.add_argument(
        "--dim", type=int, default=DEFAULTS["dim"], help="factor dimension (rows hold dim + 1)"
    )
    model.add_argument(
        "--lr",
        type=float,
        default=None,
        help="Adagrad learning rate of the tables (default 0.1 * min(1, 10 / fields))",
    )
    model.add_argument(
        "--factor-scale",
        type=float,
        default=None,
        metavar="C",
        help="factor vectors are C times the stored ones: their step and initial scale "
        "relative to the first-order weights (default min(1, 45 / pairs of fields))",
    )
    model.add_argument("--init-std", type=float, default=DEFAULTS["init_std"], metavar="S")
    model.add_argument(
        "--l2", type=float, default=0.0, help="fm: L2 penalty on the pooled rows (default 0)"
    )
    model.add_argument(
        "--dense-lr", type=float, default=1e-3, help="dnn: Adam learning rate of the MLP"
    )
    model.add_argument("--threads", type=int, default=None, help="worker threads per table")
    model.add_argument("--seed", type=int, default=0)
    out = p.add_argument_group("output")
    out.add_argument(
        "--log-every",
        type=int,
        default=0,
        metavar="N",
        help="log a line every N steps (default: about 20 lines per run)",
    )
    out.add_argument(
        "--plot", metavar="PNG", help="write AUC and throughput over steps (matplotlib)"
    )
    out.add_argument("--quiet", action="store_true", help="no progress bar and no step lines")
    return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("epochs", "batch_size", "dim", "examples", "fields"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("lr", "factor_scale", "dense_lr"):
        value = getattr(args, name)
        if value is not None and (not value > 0 or not math.isfinite(value)):
            parser.error(f"--{name.replace('_', '-')} must be a positive number")
    if args.init_std < 0 or args.l2 < 0 or args.log_every < 0:
        parser.error("--init-std, --l2 and --log-every must be >= 0")
    if not 0.0 < args.test_fraction < 1.0:
        parser.error("--test-fraction must be in (0, 1)")
    if args.holdout is not None and not 0.0 < args.holdout < 1.0:
        parser.error("--holdout must be in (0, 1)")
    if args.threads is not None and args.threads <= 0:
        parser.error("--threads must be positive")
    for flag, path in (("--data", args.data), ("--test", args.test)):
        if path is not None and not Path(path).is_file():
            parser.error(f"{flag}: no such file: {path}")
    if args.test is not None and args.data is None:
        parser.error("--test needs --data")
    if args.model == "dnn" and importlib.util.find_spec("torch") is None:
        parser.error("--model dnn needs torch: pip install 'embstore[torch]'")
    if args.plot is not None and (problem := check_plot_available()) is not None:
        parser.error(problem)


def _load(args: argparse.Namespace) -> tuple[CTRData, CTRData, str, float | None]:
    """(train, test or holdout, description, hidden model's AUC there for synthetic data)."""
    if args.data is None:
        gen = synthetic(args.examples, args.fields, seed=args.seed)
        train, test = gen.data.split(args.test_fraction)
        where = f"synthetic CTR stream, {args.fields} Zipf fields"
    else:
        data = readers.read(args.data, args.format)
        if args.test is None:
            train, test = data.split(args.test_fraction)
            where = f"{args.data}, last {args.test_fraction:.0%} held out"
        elif args.holdout is None:
            train, test = data, readers.read(args.test, args.format, like=data)
            where = f"{args.data}, tested on {args.test}"
        else:  # tuning: the test file is not even read
            train, test, where = data, data.take(0, 0), str(args.data)
    if args.holdout is not None:
        train, test = train.split(args.holdout)
        where += f", tuning on the last {args.holdout:.0%} of the training part"
    if args.data is None:
        oracle = auc(test.labels, gen.logits[len(train) : len(train) + len(test)])
        return train, test, where, oracle
    return train, test, f"{where}, {train.num_fields} fields", None


def _capacities(train: CTRData) -> dict[str, int]:
    """Rows per table: every training id fits, so nothing is evicted (the evaluation is
    read-only and inserts nothing)."""
    return {
        name: n + n // 8 + 64 for name, n in zip(train.fields, train.distinct_ids(), strict=True)
    }


def run(args: argparse.Namespace, out: TextIO) -> int:
    def say(line: str) -> None:
        print(line, file=out, flush=True)

    t0 = time.perf_counter()
    train_data, test_data, description, oracle = _load(args)
    load_s = time.perf_counter() - t0
    positive = float(train_data.labels.mean())
    if not 0.0 < positive < 1.0:
        msg = "the training data must hold both positive and negative examples"
        raise DataError(msg)
    bias = math.log(positive / (1.0 - positive))  # start at the base rate
    fields = train_data.num_fields
    lr = default_lr(fields) if args.lr is None else args.lr
    scale = default_factor_scale(fields) if args.factor_scale is None else args.factor_scale
    group = build_group(
        train_data.fields,
        _capacities(train_data),
        dim=args.dim,
        lr=lr,
        init_std=args.init_std,
        seed=args.seed,
        threads=args.threads,
    )
    model: Model
    if args.model == "dnn":
        from embstore.demo.dnn import DeepFM

        model = DeepFM(group, dense_lr=args.dense_lr, bias=bias, factor_scale=scale, seed=args.seed)
    else:
        model = FactorizationMachine(group, lr=lr, l2=args.l2, bias=bias, factor_scale=scale)
    steps = args.epochs * train_data.num_batches(args.batch_size)
    log_every = args.log_every or max(1, steps // 20)
    held = "test" if args.holdout is None else "holdout"
    say(
        f"data: {description}: {len(train_data)} train / {len(test_data)} {held} examples, "
        f"{positive:.1%} positive (loaded in {load_s:.1f} s)"
    )
    say(
        f"model: {args.model}, {len(group)} embstore tables of dim {args.dim}+1, "
        f"Adagrad(lr={lr:.4g}), factor scale {scale:.4g}, batch {args.batch_size}, "
        f"{args.epochs} epoch(s), {steps} steps"
    )
    result = train(
        model,
        train_data,
        epochs=args.epochs,
        batch_size=args.batch_size,
        log_every=log_every,
        on_record=None if args.quiet else (lambda r: say(format_record(r))),
        progress=ProgressBar(steps, enabled=not args.quiet),
    )
    rows = sum(len(t) for t in group.values())
    test_auc, test_logloss = evaluate(model, test_data)
    inserted = sum(len(t) for t in group.values()) - rows
    say(
        f"trained {result.steps} steps ({result.examples} examples) in {result.seconds:.2f} s; "
        f"the tables hold {rows} rows; the read-only evaluation inserted {inserted}"
    )
    if oracle is not None:
        say(f"the hidden model's own {held} AUC (the best possible here): {oracle:.4f}")
    if args.plot is not None:
        write_plot(args.plot, result.records, f"embstore demo: {args.model}, {description}")
        say(f"plot: {args.plot}")
    say(
        f"{held}_auc={test_auc:.4f} {held}_logloss={test_logloss:.4f} "
        f"examples_per_s={result.examples_per_s:.0f}"
    )
    return 0


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the demo with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    try:
        return run(args, sys.stdout if out is None else out)
    except DataError as exc:  # unreadable data: say why, no traceback
        print(f"python -m embstore demo: error: {exc}", file=sys.stderr)
        return 1
