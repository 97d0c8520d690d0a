"""The Ray backend: one sequential actor per shard, each holding a ShardServer.

Imported only for ``backend="ray"``. Actors are sequential (one call at a time, in
submission order), so an apply sent with ``wait=False`` is applied before any later call
from the same client on that shard. Applies are never retried (``max_task_retries=0``);
with ``restore="checkpoint"`` Ray restarts a dead actor (``max_restarts=-1``) and it reloads
its part of the last committed checkpoint; the client retries lookups on it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

import ray
import ray.exceptions

from embstore import _sharded, metrics
from embstore.errors import ShardLostError
from embstore.ray.shard import ShardServer
from embstore.spec import TableSpec

__all__ = ["RayBackend"]

NAMESPACE = "embstore"
#: Retries of a lookup on a shard that is restarting (restore="checkpoint").
LOOKUP_RETRIES = 3


class ShardActor:
    """The actor: a ShardServer; every reply carries the actor's incarnation."""

    def __init__(
        self,
        meta: dict[str, Any],
        shard: int,
        source: _sharded.Source | None,
    ) -> None:
        self.meta = meta
        ckpt = meta.get("checkpoint_dir")
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted and ckpt and os.path.exists(os.path.join(ckpt, _sharded.MANIFEST)):
            source = _sharded.open_source(ckpt)
        self.server = ShardServer.create(meta["specs"], shard, meta["num_shards"], source)
        _report_per_shard(shard)

    def call(self, method: str, *args: Any) -> tuple[str, Any]:
        return self.server.incarnation, getattr(self.server, method)(*args)

    def get_meta(self) -> dict[str, Any]:
        return self.meta


def _report_per_shard(shard: int) -> None:
    """With EMBSTORE_PERF_REPORT_PATH set, this actor's periodic report goes to
    ``<path>.shard-<k>`` (one file per shard) instead of the shared path."""
    path = os.environ.get("EMBSTORE_PERF_REPORT_PATH")
    if not path:
        return
    if metrics._reporter is not None:
        metrics._reporter.stop()
    interval = float(os.environ.get("EMBSTORE_PERF_INTERVAL_MS", "5000"))
    metrics._reporter = metrics.PerfReporter(f"{path}.shard-{shard}", interval).start()
    atexit.register(metrics._reporter.stop)


def _wait_name_free(name: str, timeout_s: float = 60.0) -> None:
    """Waits until no live actor holds ``name`` (ray.kill releases it asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    msg = f"actor name {name!r} still taken {timeout_s:.0f} s after its actor was killed"
    raise RuntimeError(msg)


class _Call:
    __slots__ = ("args", "method", "ref")

    def __init__(self, ref: Any, method: str, args: tuple[Any, ...]) -> None:
        self.ref = ref
        self.method = method
        self.args = args


_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def _pass_report_env(opts: dict[str, Any]) -> None:
    """Gives the actors this process's EMBSTORE_PERF_* settings (through runtime_env)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("EMBSTORE_PERF_")}
    if env:
        runtime_env = dict(opts.get("runtime_env") or {})
        runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
        opts["runtime_env"] = runtime_env


class RayBackend:
    """Shards as Ray actors (see the module docstring)."""

    name = "ray"

    def __init__(
        self,
        specs: Mapping[str, TableSpec],
        num_shards: int,
        source: _sharded.Source | None,
        actor_options: dict[str, Any],
        name: str | None,
        restore: str,
        checkpoint_dir: str | None,
        actors: list[Any] | None = None,
    ) -> None:
        self.meta: dict[str, Any] = {
            "specs": dict(specs),
            "num_shards": num_shards,
            "restore": restore,
            "checkpoint_dir": checkpoint_dir,
            "name": name,
        }
        self.restore_mode = restore
        self._options = actor_options
        self.incarnations: list[str | None] = [None] * num_shards
        self.restarts = [0] * num_shards
        self.dead = [False] * num_shards
        self.actors = actors if actors is not None else self._spawn(source)

    def _spawn(self, source: _sharded.Source | None) -> list[Any]:
        if not ray.is_initialized():
            ray.init()
        cls = ray.remote(ShardActor)
        actors = []
        for k in range(int(self.meta["num_shards"])):
            opts: dict[str, Any] = {"max_concurrency": 1, "max_task_retries": 0}
            opts["max_restarts"] = -1 if self.restore_mode == "checkpoint" else 0
            if self.meta["name"] is not None:
                opts.update(
                    name=f"{self.meta['name']}.shard{k}", namespace=NAMESPACE, lifetime="detached"
                )
            opts.update(self._options)
            _pass_report_env(opts)
            actors.append(cls.options(**opts).remote(self.meta, k, source))
        return actors

    @classmethod
    def attach(cls, name: str) -> tuple[RayBackend, dict[str, TableSpec], str, str | None]:
        if not ray.is_initialized():
            ray.init()
        first = ray.get_actor(f"{name}.shard0", namespace=NAMESPACE)
        raw: Any = ray.get(first.get_meta.remote())
        meta: dict[str, Any] = raw
        actors = [first] + [
            ray.get_actor(f"{name}.shard{k}", namespace=NAMESPACE)
            for k in range(1, int(meta["num_shards"]))
        ]
        backend = cls(
            meta["specs"],
            int(meta["num_shards"]),
            None,
            {},
            name,
            meta["restore"],
            meta["checkpoint_dir"],
            actors,
        )
        return backend, meta["specs"], meta["restore"], meta["checkpoint_dir"]

    @property
    def num_shards(self) -> int:
        return len(self.actors)

    def submit(self, shard: int, method: str, *args: Any) -> _Call:
        return _Call(self.actors[shard].call.remote(method, *args), method, args)

    def submit_all(self, method: str, calls: list[tuple[Any, ...]]) -> list[_Call]:
        """``method`` on every shard (``calls[k]``: shard k's arguments)."""
        return [self.submit(k, method, *args) for k, args in enumerate(calls)]

    def put(self, value: Any) -> Any:
        return ray.put(value)

    def result(self, shard: int, future: _Call, applied: str) -> Any:
        tries = (
            LOOKUP_RETRIES if self.restore_mode == "checkpoint" and future.method == "lookup" else 0
        )
        while True:
            try:
                incarnation, value = ray.get(future.ref)
            except _LOST as e:
                if tries <= 0:
                    if self.restore_mode == "fail":
                        self.dead[shard] = True
                    raise ShardLostError(shard, applied, e) from e
                tries -= 1
                future = self.submit(shard, future.method, *future.args)
                continue
            self._seen(shard, incarnation)
            return value

    def _seen(self, shard: int, incarnation: str) -> None:
        known = self.incarnations[shard]
        if known is not None and known != incarnation:
            self.restarts[shard] += 1
        self.incarnations[shard] = incarnation

    def health(self, last_checkpoint: int | None, step: int) -> list[dict[str, Any]]:
        refs = [a.call.remote("health") for a in self.actors]
        out = []
        for k, ref in enumerate(refs):
            entry: dict[str, Any] = {"alive": False, "restarts": self.restarts[k], "rows": None}
            try:
                incarnation, info = ray.get(ref, timeout=60)
            except (*_LOST, ray.exceptions.GetTimeoutError):
                info = None
            if info is not None:
                self._seen(k, incarnation)
                entry.update(info, alive=True, restarts=self.restarts[k])
            restored = entry.get("restored_from")
            base = restored if restored is not None and self.restarts[k] else last_checkpoint
            entry["last_checkpoint"] = base
            entry["lost_steps"] = None if base is None else max(0, step - base)
            out.append(entry)
        return out

    def restart(self, specs: Mapping[str, TableSpec], source: _sharded.Source) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.meta["name"] is not None:  # new actors take the names once they are free
            for k in range(len(self.actors)):
                _wait_name_free(f"{self.meta['name']}.shard{k}")
        self.incarnations = [None] * len(self.actors)
        self.dead = [False] * len(self.actors)
        self.actors = self._spawn(source)

    def close(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        if self.meta["name"] is not None:  # the names are free once close returns
            for k in range(len(self.actors)):
                _wait_name_free(f"{self.meta['name']}.shard{k}")
        self.actors = []
