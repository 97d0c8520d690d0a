"""Command line of the reference PS: ``serve`` a TableGroup, or ``load`` a server."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

__all__ = ["main"]


def _streams(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        msg = f"--streams must be positive integers separated by commas, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m embstore.ps", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the tables of a config file over gRPC")
    s.add_argument("--config", required=True, help="tables JSON (docs/ps.md)")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--threads", type=int, default=None, help="handler threads (default 4)")
    s.add_argument(
        "--checkpoint-dir",
        default=None,
        help="Save requests write under it; a group checkpoint found in it is loaded at start",
    )
    ld = sub.add_parser("load", help="closed/open-loop W1 load against a server")
    ld.add_argument("--target", default="127.0.0.1:50051")
    ld.add_argument("--streams", type=_streams, default=[1, 2, 4, 8])
    ld.add_argument("--duration", type=float, default=10.0, help="seconds per variant")
    ld.add_argument("--qps", type=float, default=None, help="also run an open loop at this rate")
    ld.add_argument("--workload", choices=["w1"], default="w1")
    ld.add_argument("--batch-size", type=int, default=2048)
    ld.add_argument("--pooling", type=int, default=8)
    ld.add_argument("--universe", type=int, default=100_003, help="W1 ranks per table")
    ld.add_argument("--json", default=None, help="write the results here")
    ld.add_argument("--smoke", action="store_true", help="a few seconds, small batches (CI)")
    return p


def _serve(args: argparse.Namespace) -> int:
    from embstore.group import TableGroup
    from embstore.ps.config import load_config
    from embstore.ps.server import serve

    ckpt = args.checkpoint_dir
    if ckpt and os.path.exists(os.path.join(ckpt, "MANIFEST.json")):
        group = TableGroup.load(ckpt)
    else:
        group = load_config(args.config)
    server = serve(group, args.port, args.threads, host=args.host, checkpoint_dir=ckpt)
    print(f"embstore.ps serving {group.names} on {args.host}:{server.port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
    return 0


def _load(args: argparse.Namespace) -> int:
    from embstore.ps.load import LoadConfig, run_load

    host = args.target.rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]"):
        print(f"--target must be a loopback address, got {args.target}", file=sys.stderr)
        return 2
    cfg = LoadConfig(
        target=args.target,
        streams=args.streams,
        duration=args.duration,
        qps=args.qps,
        batch_size=args.batch_size,
        pooling=args.pooling,
        universe=args.universe,
    )
    if args.smoke:
        cfg.streams, cfg.duration, cfg.batch_size = [1, 2], 1.0, 256
        cfg.num_batches, cfg.universe, cfg.qps = 2, 10_007, args.qps or 20.0
    results = run_load(cfg)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=float)
    errors = sum(h["errors"] for row in results["closed"] for h in row["ops"].values())
    return 1 if errors and args.smoke else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m embstore.ps``."""
    args = _parser().parse_args(argv)
    from embstore.ps._malloc import keep_freed_memory

    keep_freed_memory()  # MiB-sized messages: no page faults per call
    if args.command == "serve":
        return _serve(args)
    return _load(args)
