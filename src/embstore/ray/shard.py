"""ShardServer: one shard of a sharded store, a TableGroup holding its slice of every table.

The same object serves the local backend (in the trainer's process) and the Ray backend
(inside an actor). It keeps the routed keys of each training forward under its step token,
so the backward ships only the bag gradients and applies exactly the forward's keys (which
also lets the core reuse the rows the lookup resolved).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _sharded
from embstore.errors import StaleStepError
from embstore.group import TableGroup
from embstore.ray import _stats
from embstore.spec import TableSpec

__all__ = ["MAX_PENDING", "MAX_PENDING_ALL", "TOKEN_BITS", "ShardServer"]

#: Training forwards a shard keeps for their backward, per client (older ones are dropped: a
#: trainer that never applies cannot grow the buffer). The client mirrors this count.
MAX_PENDING = 8
#: Step tokens are ``client << TOKEN_BITS | step``: each client's forwards are counted apart.
TOKEN_BITS = 40
#: Forwards kept over all clients (those of clients that left are dropped first, oldest first).
MAX_PENDING_ALL = 16 * MAX_PENDING

#: One table's part of a routed batch on one shard: keys, CSR offsets over the shard's
#: bags, per-id weights (or None) and the apply's per-id factor in mean mode (or None).
Routed = tuple[Any, ...]


class ShardServer:
    """Shard ``shard`` of ``num_shards``: built from specs, or loaded (see :meth:`create`)."""

    def __init__(self, group: TableGroup, shard: int, num_shards: int) -> None:
        self.group = group
        self.shard = shard
        self.num_shards = num_shards
        self.incarnation = uuid.uuid4().hex
        self.restored_from: int | None = None
        # The tables' step (None if they differ). Only a change calls set_step: it turns on
        # per-row step tracking, which a store that never sets steps should not pay for.
        steps = {t.step for t in group.values()}
        self.step: int | None = steps.pop() if len(steps) == 1 else None
        self._lrs: dict[str, float] = {}  # set_lr calls this shard has had
        self._pending: OrderedDict[int, Mapping[str, Routed]] = OrderedDict()

    @classmethod
    def create(
        cls,
        specs: Mapping[str, TableSpec],
        shard: int,
        num_shards: int,
        source: _sharded.Source | None = None,
    ) -> ShardServer:
        """A shard with fresh tables, or with its rows of the checkpoint ``source``."""
        if source is None:
            group = TableGroup(
                {n: _sharded.build_shard(s, num_shards, n) for n, s in specs.items()}
            )
        else:
            group = TableGroup(_sharded.load_shard(source, specs, shard, num_shards))
        server = cls(group, shard, num_shards)
        if source is not None:
            server.restored_from = source.step
        return server

    # -- training ------------------------------------------------------------------------
    def lookup(
        self,
        token: int,
        batch: Mapping[str, Routed],
        insert: bool,
        exact: bool,
        step: int | None = None,
        lrs: Mapping[str, float] | None = None,
    ) -> tuple[dict[str, npt.NDArray[np.float32]], int]:
        """Partial pooled sums of the bags this shard touches (or, ``exact``, each id's row),
        per table; and the time taken (ns). ``step``, ``lrs``: the client's (see
        :meth:`at_step`)."""
        start = time.perf_counter_ns()
        self.at_step(step, lrs)
        features = self.lookup_features(batch, exact)
        outs = self.group.lookup_sum(features, mode="sum", insert=insert) if features else {}
        self.looked_up(token, batch, insert)
        return outs, time.perf_counter_ns() - start

    @staticmethod
    def lookup_features(batch: Mapping[str, Routed], exact: bool) -> dict[str, tuple[Any, ...]]:
        """The group lookup_sum features of a routed ``batch`` (``exact``: one bag per id)."""
        features: dict[str, tuple[Any, ...]] = {}
        for name, (keys, offsets, weights, _coef) in batch.items():
            if exact:
                features[name] = (keys, np.arange(keys.shape[0] + 1, dtype=np.int64))
            elif weights is None:
                features[name] = (keys, offsets)
            else:
                features[name] = (keys, offsets, weights)
        return features

    def looked_up(self, token: int, batch: Mapping[str, Routed], insert: bool) -> None:
        """Keeps a training forward's ``batch`` under ``token`` for its apply: at most
        MAX_PENDING of its client's (the oldest goes first), MAX_PENDING_ALL in all."""
        if not insert or not batch:
            return
        pending = self._pending
        pending[token] = batch
        client = token >> TOKEN_BITS
        mine = [t for t in pending if t >> TOKEN_BITS == client]
        for old in mine[: max(0, len(mine) - MAX_PENDING)]:
            del pending[old]
        while len(pending) > MAX_PENDING_ALL:
            pending.popitem(last=False)

    def forget(self, token: int) -> None:
        """Drops the forward ``token`` (its lookup failed on another shard)."""
        self._pending.pop(token, None)

    def apply(
        self,
        token: int | None,
        grads: Mapping[str, npt.NDArray[np.float32]],
        routed: Mapping[str, Routed],
        step: int | None = None,
        lrs: Mapping[str, float] | None = None,
    ) -> int:
        """Applies the bag gradients ``grads`` (per table, a row for each bag of this shard's
        split) to the keys of the forward ``token`` (tables in ``routed`` bring their own
        routed keys instead). ``step``, ``lrs``: the client's (see :meth:`at_step`).
        Returns the time taken (ns)."""
        start = time.perf_counter_ns()
        self.at_step(step, lrs)
        entries = self.apply_entries(token, grads, routed)
        if entries:
            self.group.apply_gradients(entries, mode="sum")
        return time.perf_counter_ns() - start

    def apply_entries(
        self,
        token: int | None,
        grads: Mapping[str, npt.NDArray[np.float32]],
        routed: Mapping[str, Routed],
    ) -> dict[str, tuple[Any, ...]]:
        """The group apply_gradients entries of an apply (see :meth:`apply`); the forward
        ``token``'s tables it covers are consumed (each table's keys apply once)."""
        forward = self._pending.get(token) if token is not None else None
        entries: dict[str, tuple[Any, ...]] = {}
        for name, g in grads.items():
            part = routed.get(name)
            if part is None:
                if forward is None or name not in forward:
                    msg = (
                        f"shard {self.shard}: no pending forward for step token {token} "
                        f"(table {name!r}); it restarted or dropped it"
                    )
                    raise StaleStepError(msg)
                part = forward[name]
            keys, offsets, weights, coef = part
            factor = coef if coef is not None else weights
            if g.shape[0] != offsets.shape[0] - 1:  # the client sends one row per bag held here
                msg = f"shard {self.shard}: {g.shape[0]} gradient rows for {offsets.shape[0] - 1} bags"
                raise ValueError(msg)
            entries[name] = (keys, offsets, g) if factor is None else (keys, offsets, g, factor)
        if forward is not None and token is not None:
            rest = {n: v for n, v in forward.items() if n not in grads or n in routed}
            if rest:
                self._pending[token] = rest
            else:
                del self._pending[token]
        return entries

    # -- management ----------------------------------------------------------------------
    def save(self, directory: str) -> None:
        """This shard's tables as a TableGroup checkpoint in ``directory``."""
        self.group.save(directory)

    def save_delta(self, directory: str) -> None:
        """Each table's rows changed since its last checkpoint, into ``directory``."""
        _sharded.save_delta_files(self.group, directory)

    def set_step(self, step: int) -> None:
        self.group.set_step(step)
        self.step = step

    def at_step(self, step: int | None, lrs: Mapping[str, float] | None = None) -> None:
        """Takes the client's step and learning rates (those set since the store was built
        or restored) before a training call, where this shard's differ: a shard restarted
        from a checkpoint runs at the checkpoint's until told otherwise."""
        if step is not None and step != self.step:
            self.set_step(step)
        for name, lr in (lrs or {}).items():
            if self._lrs.get(name) != lr:
                self.set_lr(name, lr)

    def set_lr(self, name: str, lr: float) -> None:
        self.group[name].set_lr(lr)
        self._lrs[name] = lr

    def evict(self, older_than: int) -> dict[str, dict[str, np.ndarray]]:
        return {n: t.evict(older_than=older_than) for n, t in self.group.items()}

    def stats(self) -> dict[str, Any]:
        """Each table's stats and raw histogram snapshots (picklable; merged by the client)."""
        return {"tables": self.group.stats(), "raw": _stats.raw_buckets(dict(self.group))}

    def health(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "restored_from": self.restored_from,
            "rows": {n: len(t) for n, t in self.group.items()},
        }

    def export(self, name: str) -> dict[str, np.ndarray]:
        return self.group[name].export()

    def close(self) -> None:
        for table in self.group.values():
            table.close()
        self._pending.clear()
