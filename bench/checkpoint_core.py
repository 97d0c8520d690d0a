"""Checkpoint save and load throughput: the C++ core's writer/reader against the Python
package's, on W1's tables (8 x 1M rows, D=32, Adagrad), in the same run.

``PYTHONPATH=src python bench/checkpoint_core.py [--dir /dev/shm] [--dir /var/tmp] ...``

For each directory and repeat, every warm table is saved into a new file and loaded back
by both paths, the order of the two alternating per table and repeat: Python =
``Table.save`` / ``Table.load`` (the core's writer and reader behind the facade's checks);
C++ = ``_core.checkpoint_save`` / ``_core.checkpoint_load`` (embstore/checkpoint.hpp: one
call with the GIL released, so the same code a C++ program runs). Both write a temporary
file, fsync it, rename it and fsync the directory; on tmpfs (/dev/shm) fsync is free, so
that is the page-cache figure, and a disk directory adds the writeback. Reported: GB/s
(file bytes / wall time) medians per path and their ratio. A file is deleted before it is
written again (the deletion is not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import embstore
from embstore import _core
from embstore.bench import embstore_tables, make_tables


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def save_load(table: embstore.Table, path: Path, variant: str, threads: int) -> tuple[float, float]:
    """Seconds to save ``table`` into a new file at ``path`` and to load it back."""
    if path.exists():
        path.unlink()
    if variant == "python":
        save = _time(lambda: table.save(path))
        load = _time(lambda: embstore.Table.load(path, num_threads=threads).close())
    else:
        save = _time(lambda: _core.checkpoint_save(table._internals().live(), str(path)))
        load = _time(lambda: _core.checkpoint_load(str(path), num_threads=threads))
    return save, load


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    built = embstore_tables(make_tables(args.tables, args.universe), args.dim, threads=args.threads)
    tables = list(built.values())
    print(f"built {args.tables} warm tables in {time.perf_counter() - t0:.1f} s", flush=True)
    result: dict[str, Any] = {
        "tables": args.tables,
        "rows_per_table": args.universe,
        "dim": args.dim,
    }
    for d in args.dir:
        directory = Path(d) / f"embstore-ckpt-core-bench-{os.getpid()}"
        directory.mkdir(parents=True, exist_ok=True)
        gbps: dict[str, dict[str, list[float]]] = {
            v: {"save": [], "load": []} for v in ("python", "cpp")
        }
        try:
            for rep in range(args.repeats):
                for k, table in enumerate(tables):
                    order = ("python", "cpp") if (rep + k) % 2 == 0 else ("cpp", "python")
                    for variant in order:
                        path = directory / f"t{k}.{variant}.ckpt"
                        save, load = save_load(table, path, variant, args.threads)
                        size = path.stat().st_size
                        gbps[variant]["save"].append(size / save / 1e9)
                        gbps[variant]["load"].append(size / load / 1e9)
                        path.unlink()
                print(
                    f"{d} repeat {rep}: "
                    + ", ".join(
                        f"{v} save {statistics.median(g['save']):.2f} load "
                        f"{statistics.median(g['load']):.2f} GB/s"
                        for v, g in gbps.items()
                    ),
                    flush=True,
                )
        finally:
            for p in directory.iterdir():
                p.unlink()
            directory.rmdir()
        summary = {v: {op: statistics.median(x) for op, x in g.items()} for v, g in gbps.items()}
        summary["ratio_cpp_to_python"] = {
            op: summary["cpp"][op] / summary["python"][op] for op in ("save", "load")
        }
        result[d] = {"median_gb_per_s": summary, "samples": gbps}
        print(f"{d}: {json.dumps(summary)}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--universe", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", action="append", help="directory (repeatable; default /dev/shm)")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args()
    args.dir = args.dir or ["/dev/shm"]
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
