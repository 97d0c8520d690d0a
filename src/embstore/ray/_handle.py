"""ApplyHandle: an apply sent to every shard with ``wait=False``, waited for later."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from embstore.ray._stats import Layers

__all__ = ["ApplyHandle"]


class ApplyHandle:
    """An apply submitted with ``wait=False``; :meth:`wait` returns once every shard applied
    it (and raises what the apply raised). Later calls on the store see the update anyway;
    the next call on the store waits for it if :meth:`wait` was not called, and raises its
    error then."""

    def __init__(
        self,
        results: Callable[[list[tuple[int, Any]], str], list[Any]],
        layers: Layers,
        futures: list[tuple[int, Any]],
    ) -> None:
        self._results = results  # the store's: every shard's answer, a lost shard recorded
        self._layers = layers
        self._futures = futures
        self._submitted = time.perf_counter_ns()

    def wait(self) -> None:
        futures, self._futures = self._futures, []
        if not futures:
            return
        shard_ns = self._results(futures, "unknown")
        self._layers.record("client.rpc.apply", time.perf_counter_ns() - self._submitted)
        for ns in shard_ns:
            self._layers.record("shard.apply", ns)
