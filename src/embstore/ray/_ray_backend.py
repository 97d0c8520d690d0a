"""The Ray backend: one sequential actor per shard, each holding a ShardServer.

Imported only for ``backend="ray"``. Actors are sequential (one call at a time, in
submission order), so an apply sent with ``wait=False`` is applied before any later call
from the same client on that shard. Applies are never retried (``max_task_retries=0``);
with ``restore="checkpoint"`` Ray restarts a dead actor (``max_restarts=-1``) and it reloads
its part of the last committed checkpoint; the client retries lookups on it.

With ``restore="fail"`` a store's training calls go through a compiled graph
(``_compiled``) over the actors it spawned; when that graph fails, it is torn down, the
actors are probed, and the dead ones are the lost shards (a live shard's lookup is sent
again as an ordinary call). The graph is compiled again on the next training call.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray
import ray.exceptions

from embstore import _sharded, metrics
from embstore.errors import ShardLostError
from embstore.ray import _compiled
from embstore.ray.shard import ShardServer
from embstore.spec import TableSpec

__all__ = ["RayBackend"]

NAMESPACE = "embstore"
#: Retries of a lookup on a shard that is restarting (restore="checkpoint").
LOOKUP_RETRIES = 3
#: Before reading a compiled call's answers the client sleeps this share of the time the
#: last such call's slowest shard took to finish, unless under MIN_SLEEP_NS is left:
#: reading polls a core, and on a machine the shards share that core is theirs.
SLEEP_SHARE = 0.9
MIN_SLEEP_NS = 50_000


class ShardActor:
    """The actor: a ShardServer; every reply carries the actor's incarnation. Ordinary
    calls and compiled-graph steps run on different threads: a lock serialises them."""

    def __init__(
        self,
        meta: dict[str, Any],
        shard: int,
        source: _sharded.Source | None,
    ) -> None:
        self.meta = meta
        ckpt = meta.get("checkpoint_dir")
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.lock = threading.Lock()
        self.error: Exception | None = None  # why the shard could not be built (ready())
        self.server: ShardServer | None = None
        try:
            if restarted and ckpt and os.path.exists(os.path.join(ckpt, _sharded.MANIFEST)):
                source = _sharded.open_source(ckpt)
            self.server = ShardServer.create(meta["specs"], shard, meta["num_shards"], source)
        except Exception as e:  # noqa: BLE001  (raised by every call, first by ready())
            self.error = e
        _report_per_shard(shard)

    def _server(self) -> ShardServer:
        if self.server is None:
            raise self.error or RuntimeError("shard not built")
        return self.server

    def ready(self) -> str:
        """The shard's incarnation once built; raises what building it raised."""
        return self._server().incarnation

    def call(self, method: str, *args: Any) -> tuple[str, Any]:
        with self.lock:
            server = self._server()
            return server.incarnation, getattr(server, method)(*args)

    def step(self, request: tuple[str, tuple[Any, ...]]) -> tuple[str, Any, Exception | None, int]:
        """A compiled-graph call: (incarnation, value, error, done), the error as a value so
        that the graph keeps running; done: ``time.monotonic_ns()`` as the call ended (the
        client's clock too when it runs on this machine: see ``_sleep_until_done``)."""
        method, args = request
        if method == "lookup":  # the shard keeps the routed keys until the apply
            args = _owned(args)
        try:
            incarnation, value = self.call(method, *args)
        except Exception as e:  # noqa: BLE001  (raised by the client)
            known = self.server.incarnation if self.server is not None else ""
            return known, None, e, time.monotonic_ns()
        return incarnation, value, None, time.monotonic_ns()

    def get_meta(self) -> dict[str, Any]:
        return self.meta


def _owned(value: Any) -> Any:
    """``value`` with every array copied out of the channel's buffer: a shard keeps a
    forward's keys until its apply, and arrays still viewing the buffer would hold it."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, tuple):
        return tuple(_owned(v) for v in value)
    if isinstance(value, dict):
        return {k: _owned(v) for k, v in value.items()}
    return value


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
    __slots__ = ("args", "compiled", "method", "ref", "submitted")

    def __init__(
        self, ref: Any, method: str, args: tuple[Any, ...], compiled: bool = False
    ) -> None:
        self.ref = ref
        self.method = method
        self.args = args
        self.compiled = compiled
        self.submitted = time.monotonic_ns()


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
        # A compiled graph needs actors no other client drives through one (not attached).
        self._use_compiled = restore == "fail" and actors is None and _compiled.enabled()
        self._compiled: _compiled.CompiledSteps | None = None
        self._compiled_dead: set[int] = set()  # shards found dead when the graph failed
        # By method: how long after submission the slowest shard ended, for the call being
        # read (_took) and the last two (_done_ns); 0 where a shard's clock was not ours.
        self._took: dict[str, int] = {}
        self._done_ns: dict[str, tuple[int, int]] = {}
        if actors is None:
            actors = self._spawn(source)
            self._confirm(actors)
        self.actors = actors

    @staticmethod
    def _confirm(actors: list[Any]) -> None:
        """Waits until every new actor has built its shard; if one could not (a checkpoint
        that does not load, say), kills them all and raises its error, as the local backend
        raises it."""
        try:
            ray.get([a.ready.remote() for a in actors])
        except ray.exceptions.RayError as e:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

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
        """``method`` on every shard (``calls[k]``: shard k's arguments). Lookups and applies
        go through the compiled graph when there is one; otherwise an apply's bag gradients
        (``calls[k][1]``) are put in the object store once when every shard takes the same."""
        steps = self._steps() if method in ("lookup", "apply") else None
        if steps is not None:
            try:
                refs = steps.execute([(method, args) for args in calls])
            except ray.exceptions.RayError:  # a dead actor: ordinary calls tell which
                self._compiled_failed()
            else:
                return [
                    _Call(ref, method, args, compiled=True)
                    for ref, args in zip(refs, calls, strict=True)
                ]
        if method == "apply" and calls:
            first = calls[0][1]
            if all(all(a[1][n] is g for n, g in first.items()) for a in calls):
                ref = ray.put(first)
                calls = [(args[0], ref, *args[2:]) for args in calls]
        return [self.submit(k, method, *args) for k, args in enumerate(calls)]

    def _steps(self) -> _compiled.CompiledSteps | None:
        if self._compiled is None and self._use_compiled:
            try:
                self._compiled = _compiled.CompiledSteps(self.actors)
            except Exception:  # noqa: BLE001  (e.g. a dead actor: ordinary calls instead)
                return None
            self._compiled_dead = set()
            self._took, self._done_ns = {}, {}  # new actors or a new graph: times anew
        return self._compiled

    def _compiled_failed(self) -> None:
        """Tears the failed graph down and finds which actors are dead."""
        if self._compiled is None:
            return
        steps, self._compiled = self._compiled, None
        steps.teardown()
        self._compiled_dead = set()
        for k, actor in enumerate(self.actors):
            try:
                ray.get(actor.call.remote("health"), timeout=60)
            except _LOST:
                self._compiled_dead.add(k)
            except ray.exceptions.GetTimeoutError:
                pass

    def _compiled_result(self, shard: int, future: _Call, applied: str) -> Any:
        if shard == 0:
            self._sleep_until_done(future)
        try:
            incarnation, value, error, done = _compiled.CompiledSteps.get(future.ref)
        except ray.exceptions.RayError as e:  # the graph failed (application errors are values)
            self._compiled_failed()
            if shard in self._compiled_dead:
                self.dead[shard] = True
                raise ShardLostError(shard, applied, e) from e
            if future.method == "lookup":  # lookups may be sent again
                return self.result(shard, self.submit(shard, "lookup", *future.args), applied)
            if self._compiled_dead:  # another shard is lost: the store stops anyway
                return 0
            raise ShardLostError(shard, "unknown", e) from e
        self._note_done(shard, future, done)
        if error is not None:
            raise error
        self._seen(shard, incarnation)
        return value

    def _sleep_until_done(self, future: _Call) -> None:
        """Sleeps through most of the time the shards are expected to take. A compiled
        graph's reader polls a core; on a machine the client shares with the shards (Ray
        runs them at niceness 15) the polling took that core from one of them, and the two
        shards of a step ran one after the other."""
        wait = SLEEP_SHARE * min(self._done_ns.get(future.method, (0, 0))) - (
            time.monotonic_ns() - future.submitted
        )
        if wait > MIN_SLEEP_NS:
            time.sleep(wait / 1e9)

    def _note_done(self, shard: int, future: _Call, done: int) -> None:
        """Keeps how long after submission the slowest shard of this call ended, and after
        the last shard the last two calls' times: the client sleeps on the smaller, so one
        slow call (the graph's first execution, a save holding a shard) does not make the
        next one sleep long. ``done`` is the shard's clock: it counts only when it falls
        between submission and now (a shard on another machine has another clock; then
        the client does not sleep)."""
        now = time.monotonic_ns()
        took = done - future.submitted if future.submitted <= done <= now else 0
        method = future.method
        slowest = self._took.get(method, 0)
        self._took[method] = took if shard == 0 else (max(took, slowest) if took and slowest else 0)
        if shard == len(self.actors) - 1:
            self._done_ns[method] = (self._done_ns.get(method, (0, 0))[1], self._took[method])

    def result(self, shard: int, future: _Call, applied: str) -> Any:
        if future.compiled:
            return self._compiled_result(shard, future, applied)
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
            entry["last_checkpoint"] = last_checkpoint
            entry["lost_steps"] = (
                None if last_checkpoint is None else max(0, step - last_checkpoint)
            )
            out.append(entry)
        return out

    def _drop_compiled(self) -> None:
        if self._compiled is not None:
            self._compiled.teardown()
            self._compiled = None

    def restart(self, specs: Mapping[str, TableSpec], source: _sharded.Source) -> None:
        self._drop_compiled()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.meta["name"] is not None:  # new actors take the names once they are free
            for k in range(len(self.actors)):
                _wait_name_free(f"{self.meta['name']}.shard{k}")
        self.incarnations = [None] * len(self.actors)
        self.dead = [False] * len(self.actors)
        self.actors = self._spawn(source)
        self._confirm(self.actors)  # (on failure: no live shard until a restart succeeds)

    def close(self) -> None:
        self._drop_compiled()
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        if self.meta["name"] is not None:  # the names are free once close returns
            for k in range(len(self.actors)):
                _wait_name_free(f"{self.meta['name']}.shard{k}")
        self.actors = []
