"""Ray's transport alone for (c) in bench/sharded.py: a W1 step's messages, no work.

Two actors on the same kind of compiled graph as a ``backend="ray"`` store receive each
step's real requests (the routed ids of every table, then the bag gradients each shard
needs), copy them out of the channel as a shard does, and answer with partial sums of
the sizes a shard returns, without any lookup or apply. The step of (c) cannot be shorter
than this step plus the shards' own work: it is the floor Ray sets under (c).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray
from ray.dag import InputNode, MultiOutputNode

from embstore.ray import _pool
from embstore.ray._compiled import TIMEOUT_S
from embstore.ray._ray_backend import _owned

#: Untimed steps after compiling.
WARMUP = 5


@ray.remote(num_cpus=1)
class _Echo:
    """A shard that does no work: it answers a lookup with zeros of its partial sums'
    sizes (kept from call to call, as a shard's output pool) and an apply with nothing."""

    def __init__(self, dim: int) -> None:
        self._dim = dim
        self._sums: dict[tuple[str, int], np.ndarray] = {}

    def step(self, request: tuple[str, tuple[Any, ...]]) -> tuple[str, Any, None, int]:
        method, args = request
        if method != "lookup":
            return "echo", None, None, time.monotonic_ns()
        outs = {}
        for name, (_, offsets, _, _) in _owned(args)[1].items():
            key = (name, offsets.shape[0] - 1)
            if key not in self._sums:
                self._sums[key] = np.zeros((key[1], self._dim), dtype=np.float32)
            outs[name] = self._sums[key]
        return "echo", (outs, 0), None, time.monotonic_ns()


class Transport:
    """The echo actors, their compiled graph and every batch's requests (made before
    timing, from the same route a store uses). ``step(i)`` sends batch ``i``'s lookup and
    apply and waits for their answers. ``close()`` tears it all down."""

    def __init__(self, w: Any, num_shards: int = 2) -> None:
        names = [f"t{t.index}" for t in w.tables]
        self._requests = []
        for b in w.batches:
            batches = [(k, b.offsets, None, None) for k in b.keys]
            plans = dict(
                zip(names, _pool.route(names, batches, num_shards, mean=False), strict=True)
            )
            grads = {n: w.grads[t] for t, n in enumerate(names)}
            lookups = [
                ("lookup", (1, {n: p.part(s) for n, p in plans.items()}, True, False, 0, None))
                for s in range(num_shards)
            ]
            applies = [
                ("apply", (1, _pool.shard_grads(grads, plans, s), {}, 0, None))
                for s in range(num_shards)
            ]
            self._requests.append((lookups, applies))
        self._actors = [_Echo.remote(w.dim) for _ in range(num_shards)]
        with InputNode() as inp:
            dag = MultiOutputNode([a.step.bind(inp[k]) for k, a in enumerate(self._actors)])
        self._dag = dag.experimental_compile(_submit_timeout=TIMEOUT_S)
        for i in range(WARMUP):  # a graph's first executions take seconds
            self.step(i)

    def step(self, i: int) -> list[dict[str, tuple[int, ...]]]:
        """Batch ``i``'s lookup, then its apply; per shard, the shape of each table's partial
        sums it answered (shapes only: an answer views the channel's buffer until dropped)."""
        lookups, applies = self._requests[i % len(self._requests)]
        shapes = [{n: a.shape for n, a in v[1][0].items()} for v in self._execute(lookups)]
        self._execute(applies)
        return shapes

    def requests(self, i: int) -> tuple[list[Any], list[Any]]:
        """Batch ``i``'s requests, one per shard: (lookups, applies)."""
        return self._requests[i % len(self._requests)]

    def _execute(self, requests: list[Any]) -> list[Any]:
        refs = self._dag.execute(*requests)
        return [ref.get(timeout=TIMEOUT_S) for ref in (refs if isinstance(refs, list) else [refs])]

    def close(self) -> None:
        self._dag.teardown()
        for a in self._actors:
            ray.kill(a)
