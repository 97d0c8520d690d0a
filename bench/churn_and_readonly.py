"""WORKLOADS.md W2 (eviction churn) and W4 (read-only lookup with misses), embstore alone.

``PYTHONPATH=src python bench/churn_and_readonly.py [--universe U] [--batches N]``

- W2: as W1 (L=8, D=32) but each table has capacity U/4 and starts empty: every miss
  inserts, and full shards evict by CLOCK. Reports the median step after batch 200, the hit
  rate, evictions/s, and RSS after batch 200 and at the end (it must not grow).
- W4: W1 with L=1, forward only with ``insert=False``; 10% of the ids (chosen by hash) were
  never inserted and read as zeros. Reports P50/P99 per batch, ids/s and the miss rate.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import embstore
from embstore.bench import embstore_tables, make_tables, make_workload, splitmix64


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def counters(group: dict[str, embstore.Table], key: str) -> int:
    return sum(int(t.stats()[key]) for t in group.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--universe", type=int, default=1_000_000)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    T, U = args.tables, args.universe
    tables = make_tables(T, U)

    wl = make_workload(
        num_tables=T,
        universe=U,
        batch_size=2048,
        pooling=8,
        dim=32,
        num_batches=args.batches,
        tables=tables,
    )
    group = embstore_tables(tables, 32, capacity=U // 4, threads=args.threads, warm=False)
    g, names = embstore.TableGroup(group), list(group)
    steps, rss_200 = [], 0
    start = time.perf_counter()
    for i, b in enumerate(wl.batches):
        a = time.perf_counter()
        g.lookup_sum({n: (k, b.offsets) for n, k in zip(names, b.keys)})
        g.apply_gradients({n: (k, b.offsets, gr) for n, k, gr in zip(names, b.keys, wl.grads)})
        steps.append(time.perf_counter() - a)
        if i == min(199, args.batches - 1):
            rss_200 = rss_bytes()
    elapsed = time.perf_counter() - start
    hits, misses = counters(group, "hits"), counters(group, "misses")
    print(
        f"W2 (capacity U/4, L=8, D=32, {args.threads} threads, {args.batches} batches): "
        f"step median {np.median(steps[200:] or steps) * 1e3:.2f} ms, hit rate "
        f"{hits / (hits + misses):.3f}, evictions/s {counters(group, 'evictions') / elapsed:,.0f}, "
        f"RSS after batch 200 {rss_200 / 2**20:.0f} MiB, at the end {rss_bytes() / 2**20:.0f} MiB"
    )
    for t in group.values():
        t.close()

    wl4 = make_workload(
        num_tables=T,
        universe=U,
        batch_size=2048,
        pooling=1,
        dim=32,
        num_batches=40,
        tables=tables,
    )

    def never_inserted_left_out(ids: np.ndarray) -> np.ndarray:
        return ids[splitmix64(ids) % np.uint64(10) != 0]  # 10% never inserted

    group = embstore_tables(tables, 32, threads=args.threads, warm_filter=never_inserted_left_out)
    g, names = embstore.TableGroup(group), list(group)
    hits0, misses0 = counters(group, "hits"), counters(group, "misses")
    lat = []
    for _ in range(3):
        for b in wl4.batches:
            a = time.perf_counter()
            g.lookup_sum({n: (k, b.offsets) for n, k in zip(names, b.keys)}, insert=False)
            lat.append(time.perf_counter() - a)
    ms = np.array(lat[10:]) * 1e3
    n_ids = sum(int(k.shape[0]) for k in wl4.batches[0].keys)
    d_miss = counters(group, "misses") - misses0
    d_all = d_miss + counters(group, "hits") - hits0
    print(
        f"W4 (read-only, L=1, D=32, {args.threads} threads, 10% of ids never inserted): "
        f"P50 {np.median(ms):.2f} ms, P99 {np.percentile(ms, 99):.2f} ms, "
        f"{n_ids / np.median(ms) * 1e3 / 1e6:.1f} M ids/s, miss rate {d_miss / d_all:.3f}"
    )


if __name__ == "__main__":
    main()
