"""The local backend: every shard a ShardServer in this process, called in turn."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from embstore import _sharded
from embstore.ray.shard import ShardServer
from embstore.spec import TableSpec

__all__ = ["Done", "LocalBackend"]


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

    def put(self, value: Any) -> Any:
        return value

    def result(self, shard: int, future: Any, applied: str) -> Any:
        if future.error is not None:
            raise future.error
        return future.value

    def restart(self, specs: Mapping[str, TableSpec], source: _sharded.Source) -> None:
        old, self.servers = self.servers, []
        for server in old:
            server.close()
        for k in range(len(old)):
            self.servers.append(ShardServer.create(specs, k, len(old), source))

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
