"""The local backend: every shard a ShardServer in this process.

A step's lookup (and apply) of every shard goes to the core as one group call over all
shards' tables: the core spreads them over its threads with the GIL released, as it does one
TableGroup's tables, instead of running the shards one after the other."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from embstore import _arrays, _core, _sharded
from embstore.group import TableGroup
from embstore.ray.shard import ShardServer
from embstore.spec import TableSpec

__all__ = ["Done", "LocalBackend"]

_SUM = _arrays.mode_code("sum")


class Done:
    """A call already run: its value, or the exception it raised."""

    __slots__ = ("error", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        try:
            self.value = fn()
        except Exception as e:  # noqa: BLE001  (re-raised by result())
            self.error = e

    @classmethod
    def of(cls, value: Any = None, error: BaseException | None = None) -> Done:
        done = cls(lambda: None)
        done.value, done.error = value, error
        return done


class LocalBackend:
    """Shards as in-process ServerShards: deterministic, no Ray (tests and the reference)."""

    name = "local"

    def __init__(
        self,
        specs: Mapping[str, TableSpec],
        num_shards: int,
        source: _sharded.Source | None = None,
    ) -> None:
        self.servers: list[ShardServer] = []
        try:
            for k in range(num_shards):
                self.servers.append(ShardServer.create(specs, k, num_shards, source))
        except BaseException:
            self.close()
            raise

    @property
    def num_shards(self) -> int:
        return len(self.servers)

    def submit(self, shard: int, method: str, *args: Any) -> Done:
        return Done(lambda: getattr(self.servers[shard], method)(*args))

    def submit_all(self, method: str, calls: Sequence[tuple[Any, ...]]) -> list[Done]:
        """``method`` on every shard (``calls[k]``: shard k's arguments); a lookup or an
        apply of all shards is one core call."""
        if method == "lookup":
            return self._lookup_all(calls)
        if method == "apply":
            return self._apply_all(calls)
        return [self.submit(k, method, *args) for k, args in enumerate(calls)]

    def _lookup_all(self, calls: Sequence[tuple[Any, ...]]) -> list[Done]:
        start = time.perf_counter_ns()
        insert = bool(calls[0][2])
        try:
            features = [ShardServer.lookup_features(c[1], c[3]) for c in calls]
            outs = _group_call([s.group for s in self.servers], features, "lookup", insert=insert)
        except Exception as e:  # noqa: BLE001  (every shard's call raises it)
            return [Done.of(error=e) for _ in calls]
        for server, (token, batch, *_) in zip(self.servers, calls, strict=True):
            server.looked_up(token, batch, insert)
        ns = time.perf_counter_ns() - start
        return [Done.of((out, ns)) for out in outs]

    def _apply_all(self, calls: Sequence[tuple[Any, ...]]) -> list[Done]:
        start = time.perf_counter_ns()
        entries: list[dict[str, tuple[Any, ...]]] = []
        errors: list[BaseException | None] = []
        for server, args in zip(self.servers, calls, strict=True):
            try:  # a shard that lost the forward raises; the others still apply
                entries.append(server.apply_entries(*args[:3]))
                errors.append(None)
            except Exception as e:  # noqa: BLE001  (re-raised by result())
                entries.append({})
                errors.append(e)
        try:
            _group_call([s.group for s in self.servers], entries, "apply")
        except Exception as e:  # noqa: BLE001  (every shard's call raises it)
            errors = [err or e for err in errors]
        ns = time.perf_counter_ns() - start
        return [Done.of(ns, err) for err in errors]

    def result(self, shard: int, future: Any, applied: str) -> Any:
        if future.error is not None:
            raise future.error
        return future.value

    def restart(self, specs: Mapping[str, TableSpec], source: _sharded.Source) -> None:
        """The shards of ``source``; the old ones stay if loading it fails."""
        new: list[ShardServer] = []
        try:
            for k in range(len(self.servers)):
                new.append(ShardServer.create(specs, k, len(self.servers), source))
        except BaseException:
            for server in new:
                server.close()
            raise
        old, self.servers = self.servers, new
        for server in old:
            server.close()

    def health(self, last_checkpoint: int | None, step: int) -> list[dict[str, Any]]:
        lost = None if last_checkpoint is None else step - last_checkpoint
        return [
            {
                "alive": True,
                "restarts": 0,
                "last_checkpoint": last_checkpoint,
                "lost_steps": lost,
                **s.health(),
            }
            for s in self.servers
        ]

    def close(self) -> None:
        for server in self.servers:
            server.close()
        self.servers = []


def _group_call(
    groups: Sequence[TableGroup],
    entries: Sequence[Mapping[str, tuple[Any, ...]]],
    what: str,
    *,
    insert: bool = False,
) -> list[dict[str, Any]]:
    """TableGroup.lookup_sum (``what="lookup"``, mode sum) or apply_gradients (mode sum) of
    several groups, each with its own entries, as one core call; each group's outputs."""
    names: list[list[str]] = []
    impls: list[_core.Table] = []
    batches: list[tuple[Any, ...]] = []
    for group, entry in zip(groups, entries, strict=True):
        if not entry:
            names.append([])
            continue
        n, i, b = group.lookup_entries(entry) if what == "lookup" else group.apply_entries(entry)
        names.append(n)
        impls += i
        batches += b
    labels = [n for group_names in names for n in group_names]
    if what == "lookup":
        flat = list(_core.group_lookup_sum(impls, batches, _SUM, insert, labels)) if impls else []
    else:
        if impls:
            _core.group_apply_gradients(impls, batches, _SUM, labels)
        flat = []
    if what == "apply" or insert:  # only inserts evict
        for group, group_names in zip(groups, names, strict=True):
            group._deliver_evicted(group_names)
    outs: list[dict[str, Any]] = []
    at = 0
    for group_names in names if what == "lookup" else []:
        outs.append(dict(zip(group_names, flat[at : at + len(group_names)], strict=True)))
        at += len(group_names)
    return outs
