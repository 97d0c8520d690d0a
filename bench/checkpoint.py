"""Checkpoint throughput and memory on W1's tables (8 x 1M rows, D=32, Adagrad).

``PYTHONPATH=src python bench/checkpoint.py [--dir /dev/shm] [--universe 1000000]``

For each repeat, every warm W1 table is saved to its own new file in ``--dir`` (the page
cache: /dev/shm is tmpfs, where fsync is free; pass a disk directory to include the
writeback) and loaded back; reported: GB/s (file bytes / wall time), the peak extra
resident memory during each save (``VmHWM`` after minus ``VmRSS`` before, with the
high-water mark reset through ``/proc/self/clear_refs``) as a share of the table, and the
same save while another thread runs W1 training steps on the tables (copy-on-write at
work), with the steps' median time with and without a save running. Then a delta after
some steps. Method and results: bench/README.md ("Checkpoints").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import embstore
from embstore.bench import embstore_tables, make_tables, make_workload


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def timed_save(table: embstore.Table, path: Path, *, delta: bool = False) -> dict[str, Any]:
    """Save (or save_delta) into a new file; time, bytes and peak extra RSS."""
    if path.exists():
        path.unlink()  # the old file's deletion is not part of the save
    rss0 = _status_kb("VmRSS")
    peak_ok = _reset_peak()
    t0 = time.perf_counter()
    (table.save_delta if delta else table.save)(path)
    dt = time.perf_counter() - t0
    hwm = _status_kb("VmHWM")
    out: dict[str, Any] = {"seconds": dt, "bytes": path.stat().st_size}
    if peak_ok and rss0 is not None and hwm is not None:
        out["peak_extra_bytes"] = max(0, hwm - rss0) * 1024
    return out


class Trainer(threading.Thread):
    """Runs W1 training steps (TableGroup lookup_sum + apply_gradients) in a loop."""

    def __init__(self, group: embstore.TableGroup, workload: Any) -> None:
        super().__init__(daemon=True)
        self.group, self.workload = group, workload
        self.stop = threading.Event()
        self.step_times: list[tuple[float, float]] = []  # (start, seconds)

    def run(self) -> None:
        names = self.group.names
        k = 0
        while not self.stop.is_set():
            batch = self.workload.batches[k % len(self.workload.batches)]
            feats = {n: (batch.keys[i], batch.offsets) for i, n in enumerate(names)}
            grads = {
                n: (batch.keys[i], batch.offsets, self.workload.grads[i])
                for i, n in enumerate(names)
            }
            t0 = time.perf_counter()
            self.group.lookup_sum(feats)
            self.group.apply_gradients(grads)
            self.step_times.append((t0, time.perf_counter() - t0))
            k += 1


def _peak_share(saves: list[dict[str, Any]], names: list[str], sizes: dict[str, int]) -> float:
    """The largest extra RSS of one table's save, as a share of that table's arena."""
    return max(s.get("peak_extra_bytes", 0) / sizes[n] for s, n in zip(saves, names, strict=True))


def _round_trips(
    args: argparse.Namespace, group: Any, files: dict[str, Path], sizes: dict[str, int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``args.repeats`` saves of every table, each followed by loading them back."""
    saves_out: list[dict[str, Any]] = []
    loads_out: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        saves = [timed_save(group[n], files[n]) for n in group.names]
        total = sum(s["bytes"] for s in saves)
        secs = sum(s["seconds"] for s in saves)
        peak = _peak_share(saves, group.names, sizes)
        saves_out.append(
            {
                "gb_per_s": total / secs / 1e9,
                "seconds": secs,
                "bytes": total,
                "peak_extra_share": peak,
            }
        )
        t0 = time.perf_counter()
        for n in group.names:
            embstore.Table.load(files[n], num_threads=args.threads).close()
        secs = time.perf_counter() - t0
        loads_out.append({"gb_per_s": total / secs / 1e9, "seconds": secs})
        print(
            f"repeat {rep}: save {saves_out[-1]['gb_per_s']:.2f} GB/s "
            f"(peak extra RSS {100 * peak:.2f}% of a table), "
            f"load {loads_out[-1]['gb_per_s']:.2f} GB/s",
            flush=True,
        )
    return saves_out, loads_out


def _while_training(
    args: argparse.Namespace,
    group: Any,
    data: Any,
    files: dict[str, Path],
    sizes: dict[str, int],
) -> dict[str, Any]:
    """Every table saved once while a trainer thread runs W1 steps; step times during the
    saves against the others."""
    workload = make_workload(
        num_tables=args.tables,
        universe=args.universe,
        batch_size=2048,
        pooling=8,
        dim=args.dim,
        num_batches=20,
        tables=data,
    )
    trainer = Trainer(group, workload)
    trainer.start()
    time.sleep(2.0)
    windows = []
    saves = []
    for n in group.names:
        a = time.perf_counter()
        saves.append(timed_save(group[n], files[n]))
        windows.append((a, time.perf_counter()))
        time.sleep(0.3)
    time.sleep(1.0)
    trainer.stop.set()
    trainer.join()
    during = [d for s, d in trainer.step_times if any(a <= s <= b for a, b in windows)]
    quiet = [d for s, d in trainer.step_times[5:] if not any(a <= s <= b for a, b in windows)]
    total = sum(s["bytes"] for s in saves)
    return {
        "save_gb_per_s": total / sum(s["seconds"] for s in saves) / 1e9,
        "peak_extra_share": _peak_share(saves, group.names, sizes),
        "steps_during_saves": len(during),
        "step_ms_during_save": 1e3 * statistics.median(during) if during else None,
        "step_ms_otherwise": 1e3 * statistics.median(quiet) if quiet else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = make_tables(args.tables, args.universe)
    t0 = time.perf_counter()
    tables = embstore_tables(data, args.dim, threads=args.threads)
    print(f"built {args.tables} warm tables in {time.perf_counter() - t0:.1f} s", flush=True)
    group = embstore.TableGroup(tables)
    directory = Path(args.dir) / f"embstore-ckpt-bench-{os.getpid()}"
    directory.mkdir(parents=True, exist_ok=True)
    files = {name: directory / f"{name}.ckpt" for name in group.names}
    sizes = {n: t.stats()["arena_bytes_in_use"] for n, t in group.items()}
    result: dict[str, Any] = {
        "tables": args.tables,
        "rows_per_table": args.universe,
        "dim": args.dim,
        "dir": str(args.dir),
    }
    try:
        result["saves"], result["loads"] = _round_trips(args, group, files, sizes)
        result["with_training"] = _while_training(args, group, data, files, sizes)
        print("while training:", json.dumps(result["with_training"]), flush=True)
        # A delta after those steps.
        deltas = [timed_save(group[n], directory / f"{n}.delta", delta=True) for n in group.names]
        result["delta"] = {
            "bytes": sum(d["bytes"] for d in deltas),
            "seconds": sum(d["seconds"] for d in deltas),
            "rows": sum(
                embstore.checkpoint.read_header(directory / f"{n}.delta")["rows"]
                for n in group.names
            ),
        }
        print("delta:", json.dumps(result["delta"]), flush=True)
    finally:
        for p in directory.iterdir():
            p.unlink()
        directory.rmdir()
    best_save = max(s["gb_per_s"] for s in result["saves"])
    best_load = max(s["gb_per_s"] for s in result["loads"])
    print(
        f"\nsave: median {statistics.median(s['gb_per_s'] for s in result['saves']):.2f} GB/s, "
        f"best {best_save:.2f} GB/s; load: median "
        f"{statistics.median(s['gb_per_s'] for s in result['loads']):.2f} GB/s, best "
        f"{best_load:.2f} GB/s; peak extra RSS during a save: "
        f"{100 * max(s['peak_extra_share'] for s in result['saves']):.2f}% of a table"
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--universe", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args()
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
