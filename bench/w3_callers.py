"""W3 of bench/README.md: K Python threads call one TableGroup at once (a PS server's view).

``python bench/w3_callers.py [--universe U] [--seconds S] [--rounds R] [--threads 1,2,4,8]
[--json PATH]``

As W1 (L=8, D=32, 8 warm tables), but K caller threads run for a fixed time each with its
own batches: even-numbered threads do forward lookups, odd ones apply gradients. Prints the
aggregate ids/s and each call type's P50/P99 latency per K. Targets: throughput
does not fall as K grows past the core count; P99 <= 3x P50.

Each K runs ``--rounds`` times for ``--seconds / --rounds`` each, the K values interleaved
(in reverse order on odd rounds), so that a machine that slows down or speeds up during the
run does not favour the K values measured first. The aggregate ids/s of a K is the median
of its rounds (the range follows); latencies pool every call of that K.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import embstore
from embstore.bench import embstore_tables, make_tables, make_workload
from embstore.bench.results_io import workloads_record


def row(k_threads: int, rounds: list[dict[str, Any]]) -> str:
    """One table row: K, the median ids/s of its rounds, each call type's P50 / P99 (ms), and
    the contention counters."""
    rates = [r["ids_per_s"] / 1e6 for r in rounds]
    spread = f" ({min(rates):.2f}-{max(rates):.2f})" if len(rates) > 1 else ""
    line = f"| {k_threads} | {np.median(rates):.2f} M{spread} |"
    calls = 0
    for kind in ("fwd", "apply"):
        v = np.array([x for r in rounds for x in r["latencies"][kind]]) * 1e3
        calls += v.size
        line += f" {np.median(v):.1f} / {np.percentile(v, 99):.1f} |" if v.size else " - |"
    retries, waits, wait_ms = (sum(r["contention"][i] for r in rounds) for i in range(3))
    return line + f" {calls} | {retries} | {waits} ({wait_ms:.0f} ms) |"


def w3_entry(results: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The results page's W3 figures (K=8 against K=2, the worst P99 / P50 of any K and call
    type), or None when the run lacks K=2 or K=8."""
    if 2 not in results or 8 not in results:
        return None
    worst = 0.0
    for rounds in results.values():
        for kind in ("fwd", "apply"):
            v = np.array([x for r in rounds for x in r["latencies"][kind]])
            if v.size:
                worst = max(worst, float(np.percentile(v, 99) / np.median(v)))

    def rate(k: int) -> float:
        return round(float(np.median([r["ids_per_s"] for r in results[k]])) / 1e6, 2)

    return {
        "k8_m_ids_per_s": rate(8),
        "k2_m_ids_per_s": rate(2),
        "worst_p99_over_p50": round(worst, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--universe", type=int, default=1_000_000)
    p.add_argument("--seconds", type=float, default=6.0, help="per K, over all rounds")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per K")
    p.add_argument("--threads", default="1,2,4,8", help="caller counts K")
    p.add_argument("--core-threads", type=int, default=2, help="each table's num_threads")
    p.add_argument("--json", metavar="PATH", help="also write K=8 / K=2 for the results page")
    args = p.parse_args()
    tables = make_tables(args.tables, args.universe)
    wl = make_workload(
        num_tables=args.tables,
        universe=args.universe,
        batch_size=2048,
        pooling=8,
        dim=32,
        num_batches=16,
        tables=tables,
    )
    group = embstore_tables(tables, 32, threads=args.core_threads)
    g = embstore.TableGroup(group)
    names = list(group)

    def contention() -> tuple[int, int, float]:
        """Raced read tasks redone, lock acquisitions that waited, and their total wait (ms),
        summed over the tables."""
        stats = [t.stats() for t in group.values()]
        return (
            sum(int(s["read_retries"]) for s in stats),
            sum(int(s["lock_waits"]) for s in stats),
            sum(float(s["lock_wait_us"]) for s in stats) / 1e3,
        )

    def run(k_threads: int, seconds: float) -> dict[str, Any]:
        """K callers for ``seconds``: ids/s, every call's latency, the contention counters."""
        latencies: dict[str, list[float]] = {"fwd": [], "apply": []}
        before = contention()
        ids = [0]
        lock = threading.Lock()
        stop = time.perf_counter() + seconds

        def caller(k: int) -> None:
            kind = "fwd" if k % 2 == 0 else "apply"
            mine, n, i = [], 0, k
            while time.perf_counter() < stop:
                b = wl.batches[i % len(wl.batches)]
                i += 1
                a = time.perf_counter()
                if kind == "fwd":
                    g.lookup_sum(
                        {nm: (kk, b.offsets) for nm, kk in zip(names, b.keys, strict=True)}
                    )
                else:
                    g.apply_gradients(
                        {
                            nm: (kk, b.offsets, gr)
                            for nm, kk, gr in zip(names, b.keys, wl.grads, strict=True)
                        }
                    )
                mine.append(time.perf_counter() - a)
                n += sum(int(x.shape[0]) for x in b.keys)
            with lock:
                latencies[kind].extend(mine)
                ids[0] += n

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(k_threads)]
        start = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - start
        after = contention()
        return {
            "ids_per_s": ids[0] / elapsed,
            "latencies": latencies,
            "contention": [a - b for a, b in zip(after, before, strict=True)],
        }

    print(
        f"W3: T={args.tables} U={args.universe:,} L=8 D=32, tables num_threads="
        f"{args.core_threads}, {args.seconds:g} s per K in {args.rounds} interleaved rounds\n"
    )
    print(
        "| K | aggregate ids/s | forward P50 / P99 ms | apply P50 / P99 ms | calls "
        "| read tasks redone | lock waits (total wait) |"
    )
    print("|---|---|---|---|---|---|---|")
    ks = [int(x) for x in args.threads.split(",")]
    results: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
    for rnd in range(args.rounds):
        for k in ks if rnd % 2 == 0 else ks[::-1]:
            results[k].append(run(k, args.seconds / args.rounds))
    for k in ks:
        print(row(k, results[k]), flush=True)
    entry = w3_entry(results)
    if args.json and entry is not None:
        Path(args.json).write_text(json.dumps(workloads_record(w3=[entry]), indent=1) + "\n")


if __name__ == "__main__":
    main()
