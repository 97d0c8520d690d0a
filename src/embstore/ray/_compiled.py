"""A sharded store's training calls over a Ray compiled graph.

An ordinary actor call costs a task submission and, for any argument or result over
100 KB, an object in the shared object store with its reference counting; a W1 step (a
lookup with the routed ids and partial sums of ~1-2 MB per shard, an apply with the bag
gradients) spent ~9 ms of such overhead per direction on two cores. A compiled graph
(``ray.dag``) keeps one long-running task per actor reading shared-memory channels: an
execution writes every shard's request at once and reads every shard's answer.

Only the training calls (lookup, apply) go through it; management calls stay ordinary actor
calls (the actor runs them on another thread, under the same lock). Set
``EMBSTORE_RAY_COMPILED=0`` to send everything as ordinary calls.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from ray.dag import InputNode, MultiOutputNode

__all__ = ["TIMEOUT_S", "CompiledSteps", "enabled"]

#: Seconds an execution may wait to be submitted, or for its answers, before it counts as
#: failed (Ray's default of 10 s is shorter than a large batch or a loaded machine).
TIMEOUT_S = 300.0


def enabled() -> bool:
    """Whether training calls may use a compiled graph (``EMBSTORE_RAY_COMPILED``)."""
    return os.environ.get("EMBSTORE_RAY_COMPILED", "1") != "0"


class CompiledSteps:
    """One compiled graph over every shard actor's ``step`` method."""

    def __init__(self, actors: Sequence[Any]) -> None:
        with InputNode() as inp:
            dag = MultiOutputNode([a.step.bind(inp[k]) for k, a in enumerate(actors)])
        self._dag = dag.experimental_compile(_submit_timeout=TIMEOUT_S)

    def execute(self, requests: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Sends shard k ``requests[k]`` (method, args); one result reference per shard."""
        refs = self._dag.execute(*requests)
        return list(refs) if isinstance(refs, list) else [refs]

    @staticmethod
    def get(ref: Any) -> Any:
        return ref.get(timeout=TIMEOUT_S)

    def teardown(self) -> None:
        with contextlib.suppress(Exception):  # an actor of it may be dead already
            self._dag.teardown()
