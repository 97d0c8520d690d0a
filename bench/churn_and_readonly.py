"""W2 (eviction churn) and W4 (read-only lookup with misses) of bench/README.md.

``python bench/churn_and_readonly.py [--universe U] [--batches N] [--json PATH]``

- W2: as W1 (L=8, D=32) but each table has capacity U/4 and starts empty: every miss
  inserts, and full shards evict by CLOCK. Reports the median step after batch 200, the hit
  rate, evictions/s, and RSS after batch 200 and at the end (it must not grow). The W1
  step it is held to (target: W2 <= 1.5x W1) is measured in the same run, on warm tables
  of capacity U over the same batches, once before W2 and once after (the machine drifts).
- W4: W1 with L=1, forward only with ``insert=False``; 10% of the ids (chosen by hash) were
  never inserted and read as zeros. Reports P50/P99 per batch, ids/s and the miss rate, and,
  when torch is installed, torch's dense ``embedding_bag`` forward over the same batches
  (at 1 and ``--threads`` threads, the faster counts; target: W4 ids/s >= torch's). The
  peers take turns: each round times one pass over the batches for embstore and for torch
  at each thread count, in an order that reverses every round, so that a machine whose
  speed drifts during the run (a shared VM's does, by 30% within a minute) weighs on each
  alike. The ratio is of medians pooled over the rounds; the per-round ratios' range
  follows it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import embstore
from embstore.bench import (
    Batch,
    TableData,
    TorchEmbeddingBagPeer,
    apply_omp_wait_policy,
    embstore_tables,
    make_tables,
    make_workload,
    splitmix64,
)
from embstore.bench.peer_torch import import_torch, set_torch_threads
from embstore.bench.results_io import workloads_record

#: Batches timed for W1's reference step, each time it is measured, after 5 untimed ones.
W1_REFERENCE_BATCHES = 40


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def counters(group: dict[str, embstore.Table], key: str) -> int:
    return sum(int(t.stats()[key]) for t in group.values())


def train_step(
    g: embstore.TableGroup, names: list[str], b: Batch, grads: list[np.ndarray]
) -> float:
    """One W1/W2 step (pooled lookup, then the Adagrad apply) of batch ``b``; seconds."""
    a = time.perf_counter()
    g.lookup_sum({n: (k, b.offsets) for n, k in zip(names, b.keys, strict=True)})
    g.apply_gradients(
        {n: (k, b.offsets, gr) for n, k, gr in zip(names, b.keys, grads, strict=True)}
    )
    return time.perf_counter() - a


def w1_reference_steps(
    tables: list[TableData], batches: list[Batch], grads: list[np.ndarray], threads: int
) -> list[float]:
    """W1 steps (warm tables of capacity U) over ``batches``, the first 5 untimed."""
    group = embstore_tables(tables, 32, threads=threads)
    g, names = embstore.TableGroup(group), list(group)
    steps = [train_step(g, names, b, grads) for b in batches[: W1_REFERENCE_BATCHES + 5]]
    for t in group.values():
        t.close()
    return steps[5:]


#: W4's timed rounds (after one untimed pass per peer); each times every peer once.
W4_ROUNDS = 5


#: A W4 peer: ``enter`` readies it for a pass (untimed), ``run`` does one forward.
Forward = tuple[Callable[[], None], Callable[[Batch], object]]


def interleaved_rounds(
    peers: dict[str, Forward], batches: list[Batch], rounds: int
) -> dict[str, list[list[float]]]:
    """Seconds per call of each peer over ``batches``, by round: after one untimed pass per
    peer, each round runs every peer over all the batches in turn, the order reversed on
    odd rounds (so no peer always follows the same one)."""
    for enter, run in peers.values():
        enter()
        for b in batches:
            run(b)
    times: dict[str, list[list[float]]] = {name: [] for name in peers}
    for r in range(rounds):
        for name in list(peers) if r % 2 == 0 else reversed(list(peers)):
            (enter, run), lat = peers[name], []
            enter()
            for b in batches:
                a = time.perf_counter()
                run(b)
                lat.append(time.perf_counter() - a)
            times[name].append(lat)
    return times


def torch_forwards(
    tables: list[TableData], threads: int
) -> tuple[dict[str, Forward], Callable[[], None]]:
    """torch's dense ``embedding_bag`` forward at 1 and ``threads`` threads, as named W4
    peers (entering one sets torch's thread count), and a function that frees them; no
    peers without torch."""
    if TorchEmbeddingBagPeer.unavailable() is not None:
        return {}, lambda: None
    peer = TorchEmbeddingBagPeer(threads=None)  # one set of tables; threads set per pass
    peer.setup(tables, 32)
    torch = import_torch()
    saved = int(torch.get_num_threads())

    def close() -> None:
        peer.close()
        set_torch_threads(torch, saved)

    def at(n: int) -> Forward:
        def enter() -> None:
            set_torch_threads(torch, n)

        return enter, peer.forward

    return {f"torch {n}T": at(n) for n in sorted({1, threads})}, close


def run_w2(args: argparse.Namespace, tables: list[TableData]) -> dict[str, Any]:
    """W2 on empty tables of capacity U/4, held to W1 steps timed before and after it in
    this process; prints its line and returns its workloads-file entry."""
    wl = make_workload(
        num_tables=args.tables,
        universe=args.universe,
        batch_size=2048,
        pooling=8,
        dim=32,
        num_batches=args.batches,
        tables=tables,
    )
    w1_steps = w1_reference_steps(tables, wl.batches, wl.grads, args.threads)
    group = embstore_tables(
        tables, 32, capacity=args.universe // 4, threads=args.threads, warm=False
    )
    g, names = embstore.TableGroup(group), list(group)
    steps, rss_200 = [], 0
    start = time.perf_counter()
    for i, b in enumerate(wl.batches):
        steps.append(train_step(g, names, b, wl.grads))
        if i == min(199, args.batches - 1):
            rss_200 = rss_bytes()
    elapsed = time.perf_counter() - start
    hits, misses = counters(group, "hits"), counters(group, "misses")
    evictions, rss_end = counters(group, "evictions"), rss_bytes()
    for t in group.values():
        t.close()
    w1_steps += w1_reference_steps(tables, wl.batches, wl.grads, args.threads)
    w2_ms = float(np.median(steps[200:] or steps)) * 1e3
    w1_ms = float(np.median(w1_steps)) * 1e3
    print(
        f"W2 (capacity U/4, L=8, D=32, {args.threads} threads, {args.batches} batches): "
        f"step median {w2_ms:.2f} ms = {w2_ms / w1_ms:.2f}x the W1 step measured in this run "
        f"({w1_ms:.2f} ms, warm tables of capacity U, before and after W2; target <= 1.5x), "
        f"hit rate {hits / (hits + misses):.3f}, evictions/s {evictions / elapsed:,.0f}, "
        f"RSS after batch {min(200, args.batches)} {rss_200 / 2**20:.0f} MiB, "
        f"at the end {rss_end / 2**20:.0f} MiB"
    )
    rate = evictions / elapsed / 1e6
    return {
        "w2_step_ms": [round(w2_ms, 2)],
        "w1_step_ms": [round(w1_ms, 2)],
        "hit_rate": round(hits / (hits + misses), 3),
        "evictions_m_per_s": [round(rate, 2), round(rate, 2)],
        "rss_mib": sorted([round(rss_200 / 2**20), round(rss_end / 2**20)]),
    }


def run_w4(args: argparse.Namespace, tables: list[TableData]) -> dict[str, Any]:
    """W4, embstore and torch's forward in interleaved rounds; prints its line and returns
    its workloads-file entry."""
    wl4 = make_workload(
        num_tables=args.tables,
        universe=args.universe,
        batch_size=2048,
        pooling=1,
        dim=32,
        num_batches=40,
        tables=tables,
    )

    def never_inserted_left_out(ids: np.ndarray) -> np.ndarray:
        kept: np.ndarray = ids[splitmix64(ids) % np.uint64(10) != 0]  # 10% never inserted
        return kept

    group = embstore_tables(tables, 32, threads=args.threads, warm_filter=never_inserted_left_out)
    g, names = embstore.TableGroup(group), list(group)

    def embstore_forward(b: Batch) -> object:
        return g.lookup_sum(
            {n: (k, b.offsets) for n, k in zip(names, b.keys, strict=True)}, insert=False
        )

    torch_peers, close_torch = torch_forwards(tables, args.threads)
    hits0, misses0 = counters(group, "hits"), counters(group, "misses")
    times = interleaved_rounds(
        {"embstore": (lambda: None, embstore_forward), **torch_peers},
        wl4.batches,
        args.w4_rounds,
    )
    close_torch()
    n_ids = sum(int(k.shape[0]) for k in wl4.batches[0].keys)
    d_miss = counters(group, "misses") - misses0
    d_all = d_miss + counters(group, "hits") - hits0
    for t in group.values():
        t.close()
    ms = np.concatenate(times["embstore"]) * 1e3
    p50, p99 = float(np.median(ms)), float(np.percentile(ms, 99))
    entry: dict[str, Any] = {
        "m_ids_per_s": [round(n_ids / p50 * 1e3 / 1e6, 1)],
        "torch_m_ids_per_s": [],
        "p50_ms": [round(p50, 2), round(p50, 2)],
        "p99_ms": [round(p99, 2), round(p99, 2)],
        "miss_rate": round(d_miss / d_all, 3),
    }
    if not torch_peers:
        versus = "torch not installed: no peer"
    else:
        # torch at its faster thread count over the whole run; per round, the faster too
        torch_ms = min(float(np.median(np.concatenate(times[n]))) * 1e3 for n in torch_peers)
        per_round = [
            min(float(np.median(times[n][r])) for n in torch_peers)
            / float(np.median(times["embstore"][r]))
            for r in range(args.w4_rounds)
        ]
        entry["torch_m_ids_per_s"] = [round(n_ids / torch_ms * 1e3 / 1e6, 1)]
        versus = (
            f"{torch_ms / p50:.2f}x torch's dense embedding_bag forward in this run "
            f"({n_ids / torch_ms * 1e3 / 1e6:.1f} M ids/s, median {torch_ms:.2f} ms; target "
            f">= 1x; per round {min(per_round):.2f}-{max(per_round):.2f}x over "
            f"{args.w4_rounds} interleaved rounds)"
        )
    print(
        f"W4 (read-only, L=1, D=32, {args.threads} threads, 10% of ids never inserted): "
        f"P50 {p50:.2f} ms, P99 {p99:.2f} ms, "
        f"{n_ids / p50 * 1e3 / 1e6:.1f} M ids/s = {versus}, miss rate {d_miss / d_all:.3f}"
    )
    return entry


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--universe", type=int, default=1_000_000)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--w4-rounds",
        type=int,
        default=W4_ROUNDS,
        help=f"W4's interleaved timed rounds (default {W4_ROUNDS})",
    )
    p.add_argument(
        "--omp-wait-policy",
        choices=("torch-default", "active", "passive"),
        default="torch-default",
        help="torch's OpenMP workers' wait (W4's peer), as in the W1 runner (default: "
        "torch's own; 'passive' slows its 2-thread forward on a quiet machine)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write W2's and W4's figures for the results page "
        "(python -m embstore bench --from-json ... --markdown)",
    )
    args = p.parse_args()
    if args.w4_rounds < 1:
        p.error("--w4-rounds must be at least 1")
    apply_omp_wait_policy(args.omp_wait_policy)  # before torch is imported
    tables = make_tables(args.tables, args.universe)
    w2 = run_w2(args, tables)
    w4 = run_w4(args, tables)
    if args.json:
        record = workloads_record(w2=[w2], w4=[w4])
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
