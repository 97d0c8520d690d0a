"""W1 step time of embstore with each fused optimizer, in one run.

``PYTHONPATH=src python bench/optimizers.py [--universe U] [--threads N] [--batches N]``

Same key stream, warm tables (placement order) and TableGroup calls as the W1 runner
(``python -m embstore bench``), but embstore alone: one row per (optimizer, L) with the
median forward, backward + update and step in ms, and the row stride (floats per row).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import embstore
from embstore.bench import embstore_tables, make_tables, make_workload, warm_table

OPTIMIZERS: dict[str, Any] = {
    "SGD": embstore.SGD(lr=0.01),
    "SGD(momentum=0.9)": embstore.SGD(lr=0.01, momentum=0.9),
    "Adagrad": embstore.Adagrad(lr=0.01),
    "RowWiseAdagrad": embstore.RowWiseAdagrad(lr=0.01),
    "Adam": embstore.Adam(lr=0.001),
    "FTRL": embstore.FTRL(alpha=0.05, l1=1e-4),
}
# Adagrad with the training-completeness features on: (table kwargs, set_step per batch).
VARIANTS: dict[str, tuple[dict[str, Any], bool]] = {
    "Adagrad + CountFilter(min_count=2)": (
        {"admission": embstore.CountFilter(min_count=2, width=1 << 20, depth=4)},
        False,
    ),
    "Adagrad + set_step every batch": ({}, True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--universe", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    tables = make_tables(args.tables, args.universe)
    workloads = {
        pooling: make_workload(
            num_tables=args.tables,
            universe=args.universe,
            batch_size=2048,
            pooling=pooling,
            dim=args.dim,
            num_batches=args.batches + args.warmup,
            tables=tables,
        )
        for pooling in (1, 8)
    }
    print(
        f"W1 embstore step by optimizer: T={args.tables} U={args.universe:,} D={args.dim} "
        f"B=2048 threads={args.threads}, medians of {args.batches} batches after "
        f"{args.warmup} warm-up\n"
    )
    print("| optimizer | row stride (floats) | L | fwd ms | bwd+upd ms | step ms |")
    print("|---|---|---|---|---|---|")
    runs: list[tuple[str, Any, dict[str, Any], bool]] = [
        (name, opt, {}, False) for name, opt in OPTIMIZERS.items()
    ]
    runs += [(name, OPTIMIZERS["Adagrad"], kw, steps) for name, (kw, steps) in VARIANTS.items()]
    for name, opt, extra, steps in runs:
        group = embstore_tables(tables, args.dim, optimizer=opt, threads=args.threads, **extra)
        if "admission" in extra:  # a second sighting admits every warm id
            for tab, t in zip(tables, group.values(), strict=True):
                warm_table(t, tab.warm_ids, args.dim)
        g = embstore.TableGroup(group)
        stride = next(iter(group.values())).stats()["row_stride"]
        for pooling, wl in workloads.items():
            fwd, bwd = [], []
            for i, batch in enumerate(wl.batches):
                if steps:
                    g.set_step(i + 1)
                feats = {n: (k, batch.offsets) for n, k in zip(group, batch.keys, strict=True)}
                a = time.perf_counter()
                g.lookup_sum(feats)
                b = time.perf_counter()
                g.apply_gradients(
                    {
                        n: (k, batch.offsets, gr)
                        for n, k, gr in zip(group, batch.keys, wl.grads, strict=True)
                    }
                )
                c = time.perf_counter()
                if i >= args.warmup:
                    fwd.append(b - a)
                    bwd.append(c - b)
            step = np.add(fwd, bwd)
            print(
                f"| {name} | {stride} | {pooling} | {np.median(fwd) * 1e3:.2f} | "
                f"{np.median(bwd) * 1e3:.2f} | {np.median(step) * 1e3:.2f} |",
                flush=True,
            )
        for t in group.values():
            t.close()


if __name__ == "__main__":
    main()
