"""W1 through the sharded store: in-process TableGroup vs backend="local" vs Ray actors.

``PYTHONPATH=src python bench/sharded.py [--universe U] [--steps N] [--pooling 8 1] [--json F]``;
``--table F [F ...]`` prints docs/ray.md's table from runs written by ``--json``.

Configurations, in one run, alternating in blocks of steps: (a) the in-process TableGroup
(2 threads per table), (b) ``ShardedTableGroup(backend="local", num_shards=2)`` (same
threads: isolates routing and reduce), (c) 2 Ray actors with 1 thread each. Each is warmed
with the same ids in the same order; rows are verified against (a) (pooled outputs with
``exact=True`` and the updated rows, bit for bit) before timing. Reports step P50/P99, CPU
ms per step summed over every process of the run (the Ray daemons and actors included),
and the sharded store's layers (P50 of each ``stats()["client"]`` histogram). Then, with
(c) closed, (a) alternates with (t): Ray's transport alone, (c)'s messages to two actors
that do no work (``bench/ray_transport.py``), the floor Ray sets under (c).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import embstore
from embstore._sharded import build_shard
from embstore.bench import make_tables, make_workload
from embstore.bench.env import environment
from embstore.ray import ShardedTableGroup, TableSpec

WARM_CHUNK = 1 << 16


def _descendant_cpu_s(root: int) -> float:
    """User + system CPU seconds of ``root`` and every live descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        stats[pid] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


def _specs(w: Any, threads: int) -> dict[str, TableSpec]:
    return {
        f"t{t.index}": TableSpec(
            dim=w.dim,
            capacity=w.universe,
            optimizer=embstore.Adagrad(lr=0.01),
            initializer=embstore.Normal(std=0.01, seed=t.index),
            num_threads=threads,
        )
        for t in w.tables
    }


def _warm(store: Any, w: Any) -> None:
    for t in w.tables:
        ids = t.warm_ids
        for lo in range(0, ids.shape[0], WARM_CHUNK):
            chunk = ids[lo : lo + WARM_CHUNK]
            off = np.arange(chunk.shape[0] + 1, dtype=np.int64)
            store.lookup_sum({f"t{t.index}": (chunk, off)})


def _step(store: Any, w: Any, i: int, exact: bool = False) -> dict[str, Any]:
    b = w.batches[i % len(w.batches)]
    feats = {f"t{t}": (k, b.offsets) for t, k in enumerate(b.keys)}
    kw = {"exact": True} if exact else {}
    out = store.lookup_sum(feats, **kw)
    store.apply_gradients(
        {n: (k, off, w.grads[t]) for t, (n, (k, off)) in enumerate(feats.items())}
    )
    return out


def _verify(stores: dict[str, Any], w: Any) -> None:
    for i in range(3):
        outs = {name: _step(s, w, i, exact=name != "a") for name, s in stores.items()}
        for name, out in outs.items():
            for n in out:
                assert np.array_equal(out[n], outs["a"][n]), f"({name}) pooled {n} step {i}"
    b = w.batches[2]
    for t, keys in enumerate(b.keys):
        off = np.arange(keys.shape[0] + 1, dtype=np.int64)
        want = stores["a"].lookup_sum({f"t{t}": (keys, off)}, insert=False)[f"t{t}"]
        for name, s in stores.items():
            got = s.lookup_sum(
                {f"t{t}": (keys, off)}, insert=False, **({} if name == "a" else {"exact": True})
            )
            assert np.array_equal(got[f"t{t}"], want), f"({name}) rows of t{t}"


def run(pooling: int, args: argparse.Namespace) -> dict[str, Any]:
    """Runs and prints one pooling's configurations; returns them as the JSON records."""
    w = make_workload(
        num_tables=8,
        universe=args.universe,
        batch_size=2048,
        pooling=pooling,
        dim=32,
        num_batches=args.batches,
        tables=make_tables(8, args.universe),
    )
    stores: dict[str, Any] = {}
    sp2 = _specs(w, 2)
    stores["a"] = embstore.TableGroup({n: build_shard(s, 1, n) for n, s in sp2.items()})
    stores["b"] = ShardedTableGroup(sp2, num_shards=2, backend="local")
    if not args.no_ray:
        stores["c"] = ShardedTableGroup(
            _specs(w, 1), num_shards=2, backend="ray", actor_options={"num_cpus": 1}
        )
    for s in stores.values():
        _warm(s, w)
    _verify(stores, w)
    for s in stores.values():  # layer histograms of the timed steps only
        if isinstance(s, ShardedTableGroup):
            s._layers = type(s._layers)()
    load = os.getloadavg()[0]
    print(
        f"W1 D=32 B=2048 T=8 U={args.universe} L={pooling}: {args.steps} steps each, "
        f"blocks of {args.block} alternating; load {load:.1f}"
    )
    steps = {n: functools.partial(_step, s, w) for n, s in stores.items()}
    record: dict[str, Any] = {"pooling": pooling, "load": load, "layers": {}, "transport": None}
    record["configs"] = _report(_alternate(steps, args))
    for name, s in stores.items():
        if isinstance(s, ShardedTableGroup):
            layers = {k: v["p50_us"] / 1e3 for k, v in sorted(s.stats()["client"].items())}
            record["layers"][name] = layers
            text = "  ".join(f"{k} {v:.2f}" for k, v in layers.items())
            print(f"  ({name}) layers P50 ms: {text}")
    for s in stores.values():
        if isinstance(s, ShardedTableGroup):
            s.close()
    if not args.no_ray:
        # After (c) is closed: its actors poll their channels even when idle.
        from ray_transport import Transport

        transport = Transport(w)
        try:
            print("  Ray's transport alone ((t): (c)'s messages, shards that do no work):")
            record["transport"] = _report(_alternate({"a": steps["a"], "t": transport.step}, args))
        finally:
            transport.close()
    return record


def _alternate(
    steps: dict[str, Callable[[int], Any]], args: argparse.Namespace
) -> dict[str, tuple[list[float], float]]:
    """Each of ``steps`` in blocks of ``args.block`` steps in turn, ``args.steps`` steps
    each: per name, every step's time (s) and the CPU seconds of its blocks over every
    process of the run."""
    times: dict[str, list[float]] = {n: [] for n in steps}
    cpu: dict[str, float] = dict.fromkeys(steps, 0.0)
    i = 3
    for _ in range(args.steps // args.block):
        for name, step in steps.items():
            c0 = _descendant_cpu_s(os.getpid())
            for _ in range(args.block):
                t0 = time.perf_counter()
                step(i)
                times[name].append(time.perf_counter() - t0)
                i += 1
            cpu[name] += _descendant_cpu_s(os.getpid()) - c0
    return {n: (times[n], cpu[n]) for n in steps}


def _report(measured: dict[str, tuple[list[float], float]]) -> dict[str, dict[str, float]]:
    """Prints each configuration's step P50/P99, ratio to (a) and CPU per step; returns them
    by name (milliseconds)."""
    out = {}
    for name, (ts, cpu) in measured.items():
        ms = sorted(t * 1e3 for t in ts)
        out[name] = {
            "p50_ms": statistics.median(ms),
            "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "cpu_ms": cpu / len(ts) * 1e3,
        }
    for name, r in out.items():
        r["ratio"] = r["p50_ms"] / out["a"]["p50_ms"]
        print(
            f"  ({name}) step P50 {r['p50_ms']:6.2f} ms  P99 {r['p99_ms']:6.2f} ms"
            f"  x{r['ratio']:4.2f} of (a)  CPU {r['cpu_ms']:6.2f} ms/step"
        )
    return out


#: The table's rows: (config, label), in order; (t)'s ratio is to the (a) it alternated with.
ROWS = [
    ("a", "(a) in-process TableGroup, 2 threads"),
    ("b", '(b) `backend="local"`, 2 shards'),
    ("c", "(c) 2 Ray actors x 1 thread"),
    ("t", "(t) Ray's transport alone"),
]


def table(paths: list[str]) -> str:
    """The markdown table of docs/ray.md from runs written by ``--json``: per pooling and
    configuration, each run's step P50, ratio to (a) and CPU per step (ms for (a), else
    the ratio to (a)'s), runs separated by commas."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append({r["pooling"]: r for r in json.load(f)["runs"]})
    lines = [
        "| L | config | step P50 (ms) | ratio to (a) | CPU per step, ratio to (a) |",
        "|---|---|---|---|---|",
    ]
    for pooling in sorted({p for r in runs for p in r}, reverse=True):
        for name, label in ROWS:
            cells: list[list[str]] = [[], [], []]
            for run_ in runs:
                rec = run_.get(pooling)
                conf = None if rec is None else rec["transport" if name == "t" else "configs"]
                if not conf or name not in conf:
                    continue
                r, a = conf[name], conf["a"]
                cells[0].append(f"{r['p50_ms']:.2f}")
                cells[1].append(f"{r['ratio']:.2f}")
                if name != "t":
                    cpu = r["cpu_ms"] if name == "a" else r["cpu_ms"] / a["cpu_ms"]
                    cells[2].append(f"{cpu:.1f}" if name == "a" else f"{cpu:.2f}")
            if cells[0]:
                cpu_text = ", ".join(cells[2]) + (" ms" if name == "a" else "")
                lines.append(
                    f"| {pooling} | {label} | {', '.join(cells[0])} | {', '.join(cells[1])} "
                    f"| {cpu_text if cells[2] else ''} |"
                )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--universe", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--pooling", type=int, nargs="+", default=[8, 1])
    p.add_argument("--no-ray", action="store_true")
    p.add_argument("--json", metavar="PATH", help="also write the measurements here")
    p.add_argument(
        "--table", metavar="JSON", nargs="+", help="print docs/ray.md's table from these runs"
    )
    args = p.parse_args()
    if args.table:
        print(table(args.table))
        return
    if not args.no_ray:
        import ray

        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        src = os.path.dirname(os.path.dirname(os.path.abspath(embstore.__file__)))
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": src}},
        )
    try:
        runs = [run(pooling, args) for pooling in args.pooling]
    finally:
        if not args.no_ray:
            ray.shutdown()
    if args.json:
        report = {"environment": environment(), "args": vars(args), "runs": runs}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
