"""Cost of the built-in latency metrics on the W1 step, measured in one process.

``PYTHONPATH=src python bench/metrics_cost.py [--universe U] [--batches N] [--threads N]``

The same warm tables and key stream as the W1 runner (D=32, L=8); metrics are switched on
and off batch by batch (``embstore.metrics.enable``), so both arms see the same machine
state, and the medians of each arm are compared.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import embstore
from embstore.bench import embstore_tables, make_tables, make_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--universe", type=int, default=1_000_000)
    p.add_argument("--pooling", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, default=100, help="timed batches per arm")
    args = p.parse_args()
    tables = make_tables(args.tables, args.universe)
    wl = make_workload(
        num_tables=args.tables,
        universe=args.universe,
        batch_size=2048,
        pooling=args.pooling,
        dim=32,
        num_batches=20,
        tables=tables,
    )
    group = embstore.TableGroup(embstore_tables(tables, 32, threads=args.threads))
    names = list(group)
    steps: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * args.batches + 10):
        on = i % 2 == 0
        embstore.metrics.enable(on)
        batch = wl.batches[i % len(wl.batches)]
        a = time.perf_counter()
        group.lookup_sum({n: (k, batch.offsets) for n, k in zip(names, batch.keys, strict=True)})
        group.apply_gradients(
            {n: (k, batch.offsets, g) for n, k, g in zip(names, batch.keys, wl.grads, strict=True)}
        )
        if i >= 10:  # warm-up
            steps[on].append(time.perf_counter() - a)
    embstore.metrics.enable(True)
    on, off = float(np.median(steps[True])), float(np.median(steps[False]))
    print(
        f"W1 step D=32 L={args.pooling} threads={args.threads}, {args.batches} batches per arm: "
        f"metrics on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms, cost {100 * (on / off - 1):+.1f}%"
    )


if __name__ == "__main__":
    main()
