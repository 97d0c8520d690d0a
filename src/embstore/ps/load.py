"""The PS load client (``python -m embstore.ps load``): closed and open loops of W1 batches
against a server, next to two floors measured in the same run: the in-process
``TableGroup`` call on the same batches (the store) and an empty RPC (the transport).

Every loop is bounded in time (``duration``) and in count (``max_steps``); batches are
generated before anything is timed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import embstore
from embstore import _core
from embstore._layers import Timer, split_name
from embstore.bench.workload import EPS, LR, make_workload
from embstore.group import TableGroup
from embstore.ps import _codec, _wire
from embstore.ps.client import Client, window

__all__ = ["LoadConfig", "OpStats", "local_group", "make_batches", "run_load"]

Features = dict[str, tuple[Any, ...]]
Op = Callable[[int, Any], Any]  # (stream, batch)


@dataclass
class LoadConfig:
    """What one load run does (see ``python -m embstore.ps load --help``)."""

    target: str
    streams: list[int]
    duration: float = 10.0
    qps: float | None = None
    batch_size: int = 2048
    pooling: int = 8
    universe: int = 100_003
    num_batches: int = 8
    max_steps: int = 1_000_000
    seed: int = 0


@dataclass
class OpStats:
    """Latencies (ns) and errors of one op in one window."""

    latencies: list[int] = field(default_factory=list)
    errors: int = 0

    def summary(self, seconds: float, ids_per_call: int) -> dict[str, Any]:
        lat = np.asarray(self.latencies, dtype=np.float64) / 1e3
        out: dict[str, Any] = {"count": int(lat.size), "errors": self.errors}
        if lat.size:
            q = np.percentile(lat, [50, 95, 99, 99.9])
            out.update(p50_us=q[0], p95_us=q[1], p99_us=q[2], p999_us=q[3], max_us=lat.max())
        out["rpc_per_s"] = lat.size / seconds
        out["ids_per_s"] = lat.size * ids_per_call / seconds
        return out


def make_batches(dims: dict[str, int], cfg: LoadConfig) -> tuple[list[Features], list[Features]]:
    """W1 lookups and gradient pushes for the server's tables (its i-th table takes W1's
    table i), generated before timing."""
    names = list(dims)
    dim_set = set(dims.values())
    if len(dim_set) != 1:
        msg = f"the W1 load needs tables of one dim, the server has {dims}"
        raise ValueError(msg)
    wl = make_workload(
        num_tables=len(names),
        universe=cfg.universe,
        batch_size=cfg.batch_size,
        pooling=cfg.pooling,
        dim=dim_set.pop(),
        num_batches=cfg.num_batches,
        seed=cfg.seed,
    )
    lookups = [{n: (b.keys[i], b.offsets) for i, n in enumerate(names)} for b in wl.batches]
    pushes = [
        {n: (b.keys[i], b.offsets, wl.grads[i]) for i, n in enumerate(names)} for b in wl.batches
    ]
    return lookups, pushes


def local_group(dims: dict[str, int], universe: int) -> TableGroup:
    """W1's tables, in process: the store floor the server is compared with."""
    return TableGroup(
        {
            n: embstore.Table(
                dim=d, capacity=universe, optimizer=embstore.Adagrad(lr=LR, eps=EPS), name=n
            )
            for n, d in dims.items()
        }
    )


def _closed(
    ops: list[tuple[str, Op, list[Any]]], streams: int, cfg: LoadConfig, duration: float
) -> tuple[dict[str, OpStats], float, float]:
    """``streams`` threads, each running the ops back to back over the batches; returns
    per-op stats, the wall seconds and the process CPU seconds of the window."""
    stats = {name: OpStats() for name, _, _ in ops}
    lock = threading.Lock()
    deadline = time.perf_counter() + duration
    per_stream = max(1, cfg.max_steps // streams)

    def run(s: int) -> None:
        mine = {name: OpStats() for name, _, _ in ops}
        for k in range(per_stream):
            if time.perf_counter() >= deadline:
                break
            for name, fn, args in ops:
                arg = args[(s + k) % len(args)]
                t0 = time.perf_counter_ns()
                try:
                    fn(s, arg)
                except Exception:  # noqa: BLE001 - counted, not fatal: the report says how many
                    mine[name].errors += 1
                    continue
                mine[name].latencies.append(time.perf_counter_ns() - t0)
        with lock:
            for name, st in mine.items():
                stats[name].latencies += st.latencies
                stats[name].errors += st.errors

    cpu0, t0 = time.process_time(), time.perf_counter()
    threads = [threading.Thread(target=run, args=(s,)) for s in range(streams)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=duration + 120)
    return stats, time.perf_counter() - t0, time.process_time() - cpu0


def _open(
    lookup: Op,
    push: Op,
    lookups: list[Any],
    pushes: list[Any],
    rate: float,
    streams: int,
    duration: float,
) -> tuple[dict[str, OpStats], float]:
    """Steps (Lookup then PushGrad) issued at ``rate`` per second by ``streams`` senders;
    latency runs from each step's intended start, so a late send counts against it."""
    stats = {"Lookup": OpStats(), "Step": OpStats()}
    lock = threading.Lock()
    total = max(1, int(rate * duration))
    start = time.perf_counter_ns() + 20_000_000
    interval = 1e9 / rate
    hard_stop = time.perf_counter() + 2 * duration + 30

    def run(s: int) -> None:
        mine = {"Lookup": OpStats(), "Step": OpStats()}
        for slot in range(s, total, streams):
            if time.perf_counter() >= hard_stop:
                break
            intended = start + int(slot * interval)
            wait = intended - time.perf_counter_ns()
            if wait > 0:
                time.sleep(wait / 1e9)
            b = slot % len(lookups)
            try:
                lookup(s, lookups[b])
                mine["Lookup"].latencies.append(time.perf_counter_ns() - intended)
                push(s, pushes[b])
                mine["Step"].latencies.append(time.perf_counter_ns() - intended)
            except Exception:  # noqa: BLE001 - counted, not fatal
                mine["Step"].errors += 1
        with lock:
            for name, st in mine.items():
                stats[name].latencies += st.latencies
                stats[name].errors += st.errors

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(s,)) for s in range(streams)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=2 * duration + 60)
    return stats, time.perf_counter() - t0


def _layer_window(before: dict[Any, Any], after: dict[Any, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, now in sorted(after.items()):
        h = window(before.get(key), now)
        if h["count"]:
            layer, table, name = key
            rows.append({"layer": layer, "table": table, "name": name, **h})
    return rows


def _local_layers() -> dict[tuple[str, str, str], Any]:
    from embstore.ps.client import ServerHistogram

    out = {}
    for full, snap in _core.named_histograms():
        layer, rest = split_name(full)
        out[(layer, "-", rest)] = ServerHistogram(layer, "-", rest, snap)
    return out


def run_load(cfg: LoadConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the whole load (see the module docstring); returns the JSON-ready results."""
    # One connection per stream (gRPC would otherwise share one between channels).
    own = [("grpc.use_local_subchannel_pool", 1)]
    clients = [Client(cfg.target, options=own) for _ in range(max(cfg.streams))]
    try:
        return _run(cfg, clients, log)
    finally:
        for c in clients:
            c.close()


def _op_sizes(
    lookup: Features, push: Features, dims: dict[str, int]
) -> dict[str, tuple[bytes, int]]:
    """Ping arguments that move an op's bytes: its request's size up, its reply's down."""
    tables, bags = _codec.encode_lookup(lookup, dims)
    up = _wire.encode_lookup_request(tables, insert=True, mode=0, client_send_ns=1)
    down = len(
        _wire.encode_lookup_response(
            [np.zeros((n, dims[t.table]), np.float32) for t, n in zip(tables, bags, strict=True)]
        )
    )
    push_up = _wire.encode_push_request(_codec.encode_grads(push, dims), mode=0, client_send_ns=1)
    return {"Lookup": (bytes(len(up)), down), "PushGrad": (bytes(len(push_up)), 0)}


def _run(cfg: LoadConfig, clients: list[Client], log: Callable[[str], None]) -> dict[str, Any]:
    dims = clients[0].dims
    lookups, pushes = make_batches(dims, cfg)
    ids_per_batch = sum(int(f[0].shape[0]) for f in lookups[0].values())
    local = local_group(dims, cfg.universe)
    for f in lookups:  # warm both stores with the same ids (insert on first sight)
        clients[0].lookup_sum(f)
        local.lookup_sum(f)
    sizes = _op_sizes(lookups[0], pushes[0], dims)
    trainer_lookup = Timer("trainer.Lookup.Total")
    trainer_push = Timer("trainer.PushGrad.Total")
    results: dict[str, Any] = {
        "config": {k: v for k, v in vars(cfg).items()},
        "tables": dims,
        "ids_per_batch": ids_per_batch,
        "bytes": {op: {"up": len(p), "down": n} for op, (p, n) in sizes.items()},
        "closed": [],
        "open": [],
    }
    for streams in cfg.streams:
        # Alternate the variants at every stream count: the machine's load drifts.
        def remote_lookup(s: int, f: Features) -> Any:
            with trainer_lookup:
                return clients[s].lookup_sum(f)

        def remote_push(s: int, g: Features) -> Any:
            with trainer_push:
                return clients[s].apply_gradients(g)

        server_before = {h.key: h for h in clients[0].histograms()}
        local_before = _local_layers()
        remote, secs, cpu = _closed(
            [("Lookup", remote_lookup, lookups), ("PushGrad", remote_push, pushes)],
            streams,
            cfg,
            cfg.duration,
        )
        server_after = {h.key: h for h in clients[0].histograms()}
        layers = _layer_window(server_before, server_after)
        # A server in this process shares the registry: its window already holds ours.
        seen = {(h["layer"], h["table"], h["name"]) for h in layers}
        layers += [
            h
            for h in _layer_window(local_before, _local_layers())
            if (h["layer"], h["table"], h["name"]) not in seen
        ]
        inproc, isecs, _ = _closed(
            [
                ("Lookup", lambda _s, f: local.lookup_sum(f), lookups),
                ("PushGrad", lambda _s, g: local.apply_gradients(g), pushes),
            ],
            streams,
            cfg,
            cfg.duration,
        )
        ping, psecs, _ = _closed(
            [("Ping", lambda s, _: clients[s].ping(), [None])], streams, cfg, min(cfg.duration, 2.0)
        )
        moved, msecs, _ = _closed(
            [
                ("Lookup", lambda s, p: clients[s].ping(*p), [sizes["Lookup"]]),
                ("PushGrad", lambda s, p: clients[s].ping(*p), [sizes["PushGrad"]]),
            ],
            streams,
            cfg,
            min(cfg.duration, 2.0),
        )
        steps = min(len(remote["Lookup"].latencies), len(remote["PushGrad"].latencies))
        isteps = min(len(inproc["Lookup"].latencies), len(inproc["PushGrad"].latencies))
        row = {
            "streams": streams,
            "seconds": secs,
            "client_cpu_s": cpu,
            "examples_per_s": steps * cfg.batch_size / secs,
            "inproc_examples_per_s": isteps * cfg.batch_size / isecs,
            "ops": {k: v.summary(secs, ids_per_batch) for k, v in remote.items()},
            "inproc": {k: v.summary(isecs, ids_per_batch) for k, v in inproc.items()},
            "empty_rpc": ping["Ping"].summary(psecs, 0),
            "bytes_rpc": {k: v.summary(msecs, 0) for k, v in moved.items()},
            "layers": layers,
        }
        results["closed"].append(row)
        log(_closed_line(row))
        if cfg.qps:
            ostats, osecs = _open(
                remote_lookup, remote_push, lookups, pushes, cfg.qps, streams, cfg.duration
            )
            orow = {
                "streams": streams,
                "qps": cfg.qps,
                "ops": {k: v.summary(osecs, ids_per_batch) for k, v in ostats.items()},
            }
            results["open"].append(orow)
            log(_open_line(orow))
    for name in list(local):
        local[name].close()
    return results


def _fmt(h: dict[str, Any]) -> str:
    if not h.get("count"):
        return f"count=0 errors={h.get('errors', 0)}"
    return (
        f"count={h['count']} errors={h['errors']} p50_us={h['p50_us']:.0f} "
        f"p95_us={h['p95_us']:.0f} p99_us={h['p99_us']:.0f} p999_us={h['p999_us']:.0f} "
        f"max_us={h['max_us']:.0f} rpc_per_s={h['rpc_per_s']:.1f}"
    )


def _closed_line(row: dict[str, Any]) -> str:
    s = row["streams"]
    head = (
        f"closed streams={s} examples_per_s={row['examples_per_s']:.0f} "
        f"inproc_examples_per_s={row['inproc_examples_per_s']:.0f} "
        f"client_cpu_s={row['client_cpu_s']:.2f} seconds={row['seconds']:.2f}"
    )
    lines = [head]
    for op, h in row["ops"].items():
        lines.append(f"closed streams={s} variant=rpc op={op} {_fmt(h)}")
    for op, h in row["inproc"].items():
        lines.append(f"closed streams={s} variant=inproc op={op} {_fmt(h)}")
    lines.append(f"closed streams={s} variant=empty_rpc op=Ping {_fmt(row['empty_rpc'])}")
    for op, h in row["bytes_rpc"].items():
        lines.append(f"closed streams={s} variant=bytes_rpc op={op} {_fmt(h)}")
    first = next((h["table"] for h in row["layers"] if h["layer"] == "kv"), None)
    for h in row["layers"]:
        if h["layer"] == "kv" and h["table"] != first:
            continue  # a group call records into every table: one table says it (JSON: all)
        lines.append(
            f"window streams={s} layer={h['layer']} table={h['table']} name={h['name']} "
            f"count={h['count']} p50_us={h['p50_us']:.1f} p95_us={h['p95_us']:.1f} "
            f"p99_us={h['p99_us']:.1f} max_us={h['max_us']:.1f}"
        )
    return "\n".join(lines)


def _open_line(row: dict[str, Any]) -> str:
    return "\n".join(
        f"open streams={row['streams']} qps={row['qps']} op={op} {_fmt(h)}"
        for op, h in row["ops"].items()
    )
