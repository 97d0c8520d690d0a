"""ShardedTableGroup: the TableGroup API over N shards, each holding a slice of every table.

Ids are routed by a salted hash mod N (``docs/ray.md``). A step is one call per shard per
direction for all tables: the forward sends each shard its ids and gets back partial pooled
sums of its bags; the backward sends each shard only the gradients of its bags with the
forward's step token, and each shard applies the keys it kept.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from embstore import _arrays, _padding, _sharded, metrics
from embstore.checkpoint import CheckpointError
from embstore.errors import ShardLostError
from embstore.ray import _pool, _stats
from embstore.ray._forwards import Forwards
from embstore.ray._handle import ApplyHandle
from embstore.ray.shard import TOKEN_BITS
from embstore.spec import TableSpec

if TYPE_CHECKING:  # typing.Self needs Python 3.11; annotations are never evaluated at run time
    from typing_extensions import Self

__all__ = ["ShardedTableGroup"]

_BACKENDS = ("local", "ray")
_RESTORE = ("fail", "checkpoint")


class ShardedTableGroup(Mapping[str, TableSpec]):
    """Named tables sharded over ``num_shards`` stores, with TableGroup's batched calls.

    Parameters
    ----------
    tables : Mapping[str, TableSpec]
        The tables by name; ``capacity`` is each table's total over all shards.
    num_shards : int
        Shards (Ray actors with ``backend="ray"``).
    backend : {"local", "ray"}
        ``"local"``: the shards are TableGroups in this process (no Ray); ``"ray"``: one
        sequential actor per shard.
    actor_options : dict, optional
        Passed to Ray's ``.options()`` for every actor (num_cpus, scheduling strategy, ...).
    name : str, optional
        Names the actors and makes them detached (they outlive this process);
        :meth:`attach` finds them. :meth:`close` kills them.
    restore : {"fail", "checkpoint"}
        What a lost shard does: ``"fail"`` (the store raises :class:`~embstore.ShardLostError`
        until :meth:`restore`), or ``"checkpoint"`` (Ray restarts the actor and it reloads its
        part of the last checkpoint committed in ``checkpoint_dir``).
    checkpoint_dir : str, optional
        Where ``restore="checkpoint"`` finds the last committed checkpoint.
    """

    def __init__(
        self,
        tables: Mapping[str, TableSpec],
        *,
        num_shards: int,
        backend: str = "ray",
        actor_options: Mapping[str, Any] | None = None,
        name: str | None = None,
        restore: str = "fail",
        checkpoint_dir: str | os.PathLike[str] | None = None,
        _source: _sharded.Source | None = None,
        _backend: Any = None,
    ) -> None:
        num_shards = _checked_options(tables, num_shards, backend, restore, checkpoint_dir)
        self._specs: dict[str, TableSpec] = dict(tables)
        self._names = list(self._specs)
        self._dims = {n: s.dim for n, s in self._specs.items()}
        # Tables with a padding id: the client drops it before routing, as TableGroup does
        # before its core call (it counts in no bag's size, and its weight is never read).
        self._padding = {
            n: s.padding_key for n, s in self._specs.items() if s.padding_key is not None
        }
        self._num_shards = num_shards
        self._checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        # Step tokens unique to this client (several clients may share the shards), and the
        # forwards the shards still hold for it: token -> tables not applied yet, as each
        # shard keeps them (see ShardServer.looked_up).
        client = uuid.uuid4().int >> 64
        self._tokens = itertools.count((client << TOKEN_BITS) + 1)
        self._forwards = Forwards()
        self._lost: ShardLostError | None = None
        self._fail_stop = restore == "fail"  # a lost shard stops the store until restore()
        self._unwaited: list[ApplyHandle] = []
        self._step = 0 if _source is None or _source.step is None else _source.step
        # Whether the shards' step is this client's: not after loading a plain TableGroup
        # checkpoint (its tables keep their own step) until set_step.
        self._step_known = _source is None or _source.step is not None
        self._lrs: dict[str, float] = {}  # set_lr since the store was built or restored
        self._last_checkpoint_step: int | None = None if _source is None else _source.step
        # restore="checkpoint": the step of the checkpoint committed in checkpoint_dir, the
        # one a restarted shard reloads.
        self._restart_step = _sharded.committed_step(self._checkpoint_dir)
        self._closed = False
        self._layers = _stats.Layers()
        # The directory of the last checkpoint committed by or loaded into this store with
        # its shard count unchanged, and that checkpoint's manifest (its shard and delta
        # directories): where save_delta continues the chain, if nothing replaced it since.
        self._chain_dir: str | None = None
        self._chain_manifest: tuple[Any, ...] | None = None
        if _source is not None and _source.num_shards == num_shards:
            self._chain_from(_source.directory)
        if _backend is not None:
            self._backend = _backend
        elif backend == "local":
            if actor_options is not None or name is not None:
                msg = "actor_options and name need backend='ray'"
                raise ValueError(msg)
            from embstore.ray._local import LocalBackend

            self._backend = LocalBackend(self._specs, num_shards, _source)
        else:
            from embstore.ray._ray_backend import RayBackend

            self._backend = RayBackend(
                self._specs,
                num_shards,
                _source,
                dict(actor_options or {}),
                name,
                restore,
                self._checkpoint_dir,
            )

    # -- mapping --------------------------------------------------------------------------
    def __getitem__(self, name: str) -> TableSpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    @property
    def names(self) -> list[str]:
        """The table names, in order."""
        return list(self._names)

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return self._num_shards

    @property
    def backend(self) -> str:
        """``"local"`` or ``"ray"``."""
        return str(self._backend.name)

    def __repr__(self) -> str:
        return f"<embstore.ray.ShardedTableGroup {self._names} shards={self._num_shards}>"

    def _dim(self, name: str) -> int:
        try:
            return self._dims[name]
        except KeyError:
            raise _arrays.unknown_table(name, self._names) from None

    def _usable(self) -> None:
        """Raises if the store is closed or lost a shard; first waits for applies sent with
        ``wait=False`` (a shard runs them before any later call anyway), so their errors
        surface here at the latest."""
        if self._closed:
            msg = "operation on a closed ShardedTableGroup"
            raise ValueError(msg)
        if self._lost is not None:
            raise ShardLostError(self._lost.shard, "no", self._lost)
        while self._unwaited:
            self._unwaited.pop().wait()

    def _results(self, futures: list[tuple[int, Any]], applied: str) -> list[Any]:
        """Every shard's answer, in shard order; a lost shard marks the store lost."""
        out = []
        error: BaseException | None = None
        for shard, future in futures:
            try:
                out.append(self._backend.result(shard, future, applied))
            except ShardLostError as e:
                if self._lost is None and self._fail_stop:
                    self._lost = e
                error = error or e
            except BaseException as e:  # noqa: BLE001  (the first one is raised below)
                error = error or e
        if error is not None:
            raise error
        return out

    # -- training -------------------------------------------------------------------------
    def _checked(
        self, entries: Mapping[str, Any], arg: str, convert: Callable[[Any, int], tuple[Any, ...]]
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """The names of ``entries`` and each entry checked (errors name the table) with
        ``convert``, keys as uint64; as TableGroup checks them."""
        names = _arrays.entry_names(entries, arg)
        checked = [
            _uint64_keys(_arrays.named_entry(n, entries[n], self._dim(n), arg, convert))
            for n in names
        ]
        for i, name in enumerate(names):
            pad = self._padding.get(name)
            if pad is not None:
                checked[i] = _padding.drop_from_entry(pad, checked[i], arg == "grads")
        return names, checked

    def lookup_sum(
        self,
        features: Mapping[str, tuple[Any, ...]],
        *,
        mode: str = "sum",
        insert: bool = True,
        exact: bool = False,
    ) -> dict[str, npt.NDArray[np.float32]]:
        """Pooled lookups of several tables, as :meth:`TableGroup.lookup_sum` (one call per
        shard). Pooled sums agree with the in-process group's within float tolerance (the
        shards' partial sums are added in another order); ``exact=True`` returns them bit for
        bit (shards send each id's row; the client pools them in order)."""
        code = _arrays.mode_code(mode)
        insert, exact = bool(insert), bool(exact)
        names, checked = self._checked(features, "features", _arrays.lookup_entry)
        self._usable()
        t0 = time.perf_counter_ns()
        batches = [(c[0], c[1], c[2] if len(c) == 3 else None, None) for c in checked]
        plans = _pool.route(
            names, batches, self._num_shards, mean=code == 1, order=exact, keep=insert
        )
        token = next(self._tokens)
        t1 = time.perf_counter_ns()
        calls = [
            (
                token,
                {n: p.part(shard) for n, p in zip(names, plans, strict=True)},
                insert,
                exact,
                self._shard_step(),
                self._lrs or None,
            )
            for shard in range(self._num_shards)
        ]
        futures = list(enumerate(self._backend.submit_all("lookup", calls)))
        try:
            answers = self._results(futures, "no")
        except BaseException:
            if insert:  # shards that ran it keep the forward: make them drop it
                self._forget(token)
            raise
        t2 = time.perf_counter_ns()
        outs = _pool.pooled(names, plans, checked, answers, self._dims, mean=code == 1, exact=exact)
        if insert:
            self._forwards.keep(token, names, code, plans)
        layers = self._layers
        layers.record("client.route", t1 - t0)
        layers.record("client.rpc.lookup_sum", t2 - t1)
        layers.record("client.reduce", time.perf_counter_ns() - t2)
        for _, shard_ns in answers:
            layers.record("shard.lookup_sum", shard_ns)
        return outs

    def apply_gradients(
        self, grads: Mapping[str, tuple[Any, ...]], *, mode: str = "sum", wait: bool = True
    ) -> ApplyHandle | None:
        """Apply the backward of :meth:`lookup_sum`, as :meth:`TableGroup.apply_gradients`.

        A table whose keys, offsets, weights and mode are those of the last training lookup
        ships only its bag gradients (each shard applies the keys it kept); any other is
        routed afresh. With ``wait=False`` returns an :class:`ApplyHandle` at once (later
        calls on this store still see the update: each shard runs calls in order).
        """
        code = _arrays.mode_code(mode)
        names, checked = self._checked(grads, "grads", _arrays.apply_entry)
        batches = [(c[0], c[1], c[3] if len(c) == 4 else None, c[2]) for c in checked]
        t0 = time.perf_counter_ns()
        _pool.check(names, batches, mean=code == 1)
        self._usable()
        token, held = self._forwards.take(names, checked, code)
        self._layers.record("client.validate", time.perf_counter_ns() - t0)
        reroute = [k for k, name in enumerate(names) if name not in held]
        plans = {}
        if reroute:
            sub = _pool.route(
                [names[k] for k in reroute],
                [batches[k] for k in reroute],
                self._num_shards,
                mean=code == 1,
                order=False,
            )
            plans = {names[k]: p for k, p in zip(reroute, sub, strict=True)}
        split = {**plans, **held}  # each table's split: its forward's, or the one just made
        full = {n: c[2] for n, c in zip(names, checked, strict=True)}
        calls = [
            (
                token,
                _pool.shard_grads(full, split, shard),
                {n: p.part(shard) for n, p in plans.items()},
                self._shard_step(),
                self._lrs or None,
            )
            for shard in range(self._num_shards)
        ]
        futures = list(enumerate(self._backend.submit_all("apply", calls)))
        handle = ApplyHandle(self._results, self._layers, futures)
        if not wait:
            self._unwaited.append(handle)
            return handle
        handle.wait()
        return None

    def _forget(self, token: int) -> None:
        """Best effort: every shard still alive drops the forward ``token`` (it failed
        somewhere, so this client never applies it and must not count it as held)."""
        if self._lost is not None:
            return
        futures = [(k, self._backend.submit(k, "forget", token)) for k in range(self._num_shards)]
        with contextlib.suppress(Exception):
            self._results(futures, "no")

    # -- management -----------------------------------------------------------------------
    def _broadcast(self, method: str, *args: Any) -> list[Any]:
        self._usable()
        futures = [(k, self._backend.submit(k, method, *args)) for k in range(self._num_shards)]
        return self._results(futures, "unknown")

    def set_step(self, step: int) -> None:
        """``set_step(step)`` on every table of every shard."""
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            msg = f"step must be an int, got {type(step).__name__}"
            raise TypeError(msg)
        if not 0 <= int(step) < 2**32:
            msg = f"step must be in [0, 2**32), got {step}"
            raise ValueError(msg)
        self._broadcast("set_step", int(step))
        self._step = int(step)
        self._step_known = True

    def _shard_step(self) -> int | None:
        """The step each training call carries (a restarted shard takes it), if known."""
        return self._step if self._step_known else None

    def set_lr(self, name: str, lr: float) -> None:
        """``Table.set_lr(lr)`` of table ``name`` on every shard: the learning rate
        (``alpha`` for FTRL) of every later call. ``store[name]`` stays the spec the store
        was built with. A shard Ray restarts takes it again at its next training call;
        :meth:`restore` rolls the rates back to the checkpoint's (call this again after)."""
        self._dim(name)
        lr = _arrays.learning_rate(lr)
        self._broadcast("set_lr", name, lr)
        self._lrs[name] = lr  # each training call carries them (a restarted shard takes them)

    def evict(self, *, older_than: int) -> dict[str, dict[str, np.ndarray]]:
        """``Table.evict(older_than=)`` on every shard; the removed rows per table (ids and
        values, shards concatenated in order)."""
        if isinstance(older_than, bool) or not isinstance(older_than, int | np.integer):
            msg = f"older_than must be an int, got {type(older_than).__name__}"
            raise TypeError(msg)
        if int(older_than) < 0:
            msg = f"older_than must be >= 0, got {older_than}"
            raise ValueError(msg)
        parts = self._broadcast("evict", int(older_than))
        return {
            n: {
                "ids": np.concatenate([p[n]["ids"] for p in parts]),
                "values": np.concatenate([p[n]["values"] for p in parts]),
            }
            for n in self._names
        }

    def export(self, name: str) -> dict[str, np.ndarray]:
        """``Table.export()`` of table ``name``, every shard's rows concatenated in order."""
        self._dim(name)
        parts = self._broadcast("export", name)
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    def stats(self) -> dict[str, Any]:
        """``tables``: per table, the shards' counters summed and their latency histograms
        added bucket by bucket (then summarised as ``Table.stats()["latency"]``); ``client``:
        this client's layers (``client.route``, ``client.rpc.lookup_sum``,
        ``client.rpc.apply``, ``client.reduce``, and the shards' own ``shard.lookup_sum``
        and ``shard.apply`` times); ``shards``: each shard's ``Table.stats()`` per table;
        ``raw``: the merged histograms themselves (``raw["tables"][name][timer]``,
        ``raw["client"][layer]``: picklable ``HistogramSnapshot``s, to merge further with
        ``embstore.metrics.merge_histograms``)."""
        return _stats.merge(self._broadcast("stats"), self._layers)

    def prometheus_text(self) -> str:
        """Every shard's tables in the Prometheus text format (as
        :func:`embstore.metrics.prometheus_text`), each sample labelled ``shard`` and
        ``table``."""
        entries = [
            (f'shard="{k}",table="{metrics._label(name)}"', st)
            for k, shard_stats in enumerate(self._broadcast("stats"))
            for name, st in shard_stats["tables"].items()
        ]
        return metrics.format_prometheus(entries)

    def health(self) -> list[dict[str, Any]]:
        """Per shard: ``{alive, restarts, last_checkpoint, lost_steps, rows}`` (and ``pid``)."""
        base = self._last_checkpoint_step if self._fail_stop else self._restart_step
        return list(self._backend.health(base, self._step))

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> None:
        """Checkpoint every shard into ``directory``: one TableGroup checkpoint per shard in
        a new subdirectory, then the top-level ``MANIFEST.json`` written atomically (the
        commit point, recording the route). A crash or a lost shard before the manifest
        leaves the previous checkpoint in ``directory`` the committed one."""
        directory = os.path.abspath(os.fspath(directory))
        os.makedirs(directory, exist_ok=True)
        dirs = self._new_dirs()
        self._chain_dir = None  # until committed: a failed save starts no chain
        self._usable()
        futures = [
            (k, self._backend.submit(k, "save", os.path.join(directory, d)))
            for k, d in enumerate(dirs)
        ]
        self._results(futures, "no")
        caps = {n: s.capacity for n, s in self._specs.items()}
        _sharded.write_manifest(directory, dirs, caps, self._step)
        self._committed(directory, self._step)

    def save_delta(self, directory: str | os.PathLike[str]) -> None:
        """Checkpoint only what changed since the last :meth:`save` or :meth:`save_delta`
        into ``directory`` (the directory of that checkpoint): one delta per table and shard
        in new subdirectories, then the manifest, extended by them, written atomically.
        Raises :class:`~embstore.CheckpointError` if the last checkpoint of this store was
        not committed in ``directory`` (a failed save or save_delta needs a full save)."""
        directory = os.path.abspath(os.fspath(directory))
        body = _sharded.read_body(directory)
        if self._chain_dir != directory or body is None:
            msg = (
                f"{directory}: save_delta needs the last checkpoint of this store committed "
                "there (call save(directory) first)"
            )
            raise CheckpointError(msg)
        if _sharded.manifest_key(body) != self._chain_manifest:
            msg = (
                f"{directory}: the checkpoint committed there is no longer this store's last "
                "(another store saved there since): call save(directory)"
            )
            raise CheckpointError(msg)
        dirs = self._new_dirs()
        self._chain_dir = None
        self._usable()
        futures = [
            (k, self._backend.submit(k, "save_delta", os.path.join(directory, d)))
            for k, d in enumerate(dirs)
        ]
        self._results(futures, "no")
        deltas = [list(save) for save in body["deltas"]] + [dirs]
        caps = {n: s.capacity for n, s in self._specs.items()}
        _sharded.write_manifest(directory, body["shards"], caps, self._step, deltas)
        self._committed(directory, self._step)

    def _committed(self, directory: str, step: int | None) -> None:
        """A checkpoint at ``step`` committed in (or restored from) ``directory``."""
        self._last_checkpoint_step = step
        self._chain_from(directory)
        if self._checkpoint_dir is not None and self._chain_dir == os.path.abspath(
            self._checkpoint_dir
        ):
            self._restart_step = step

    def _chain_from(self, directory: str) -> None:
        """save_delta continues from the checkpoint committed in ``directory`` now."""
        self._chain_dir = os.path.abspath(directory)
        body = _sharded.read_body(self._chain_dir)
        self._chain_manifest = None if body is None else _sharded.manifest_key(body)

    def _new_dirs(self) -> list[str]:
        save_id = uuid.uuid4().hex
        return [
            _sharded.shard_dir_name(k, self._num_shards, save_id) for k in range(self._num_shards)
        ]

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        *,
        num_shards: int | None = None,
        backend: str = "ray",
        **options: Any,
    ) -> ShardedTableGroup:
        """The store committed in ``directory`` (by :meth:`save`, or a plain
        :meth:`TableGroup.save`), over ``num_shards`` shards (default: as saved). With another
        shard count every shard streams every saved file and keeps the rows routed to it."""
        source = _sharded.open_source(directory)
        m = (
            source.num_shards
            if num_shards is None
            else _arrays.positive_int("num_shards", num_shards)
        )
        specs = _sharded.specs_of(source)
        return cls(specs, num_shards=m, backend=backend, _source=source, **options)

    def restore(self, directory: str | os.PathLike[str]) -> None:
        """Roll every shard back to the checkpoint committed in ``directory`` (after a lost
        shard, or at any time); the store then takes calls again. Applies sent with
        ``wait=False`` are waited for first (their errors dropped: the rollback undoes them).
        A checkpoint that cannot be loaded raises as :meth:`load` does; the local backend
        then keeps its shards, Ray's has none left (calls raise ShardLostError until a
        restore succeeds)."""
        source = _sharded.open_source(directory)
        errors: list[BaseException] = []
        for handle in self._unwaited:  # before the restart discards what they applied
            try:
                handle.wait()
            except Exception as e:  # noqa: BLE001  (reported below if nothing is rolled back)
                errors.append(e)
        self._unwaited.clear()
        try:
            self._backend.restart(self._specs, source)  # raises what loading it raised
        except BaseException as e:
            for err in errors:  # the shards kept those applies' effects (local backend)
                e.add_note(f"an apply sent with wait=False before restore() failed: {err!r}")
            raise
        self._forwards.clear()
        self._lrs.clear()
        self._lost = None
        self._committed(source.directory, source.step)
        if source.num_shards != self._num_shards:
            self._chain_dir = None
        if source.step is not None:
            self._step = source.step
        self._step_known = source.step is not None

    @classmethod
    def attach(cls, name: str) -> ShardedTableGroup:
        """The store whose detached actors were created with ``name=name`` (Ray only)."""
        from embstore.ray._ray_backend import RayBackend

        backend, specs, restore, ckpt = RayBackend.attach(name)
        return cls(
            specs,
            num_shards=backend.num_shards,
            backend="ray",
            restore=restore,
            checkpoint_dir=ckpt,
            _backend=backend,
        )

    def close(self) -> None:
        """Release every shard (kills the actors, detached ones included)."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked_options(
    tables: Any, num_shards: Any, backend: Any, restore: Any, checkpoint_dir: Any
) -> int:
    """The constructor's arguments checked (errors name them); the shard count."""
    _arrays.check_tables(tables, TableSpec, repr)
    shards = _arrays.positive_int("num_shards", num_shards)
    if backend not in _BACKENDS:
        msg = f"backend must be 'local' or 'ray', got {backend!r}"
        raise ValueError(msg)
    if restore not in _RESTORE:
        msg = f"restore must be 'fail' or 'checkpoint', got {restore!r}"
        raise ValueError(msg)
    if restore == "checkpoint" and (checkpoint_dir is None or backend != "ray"):
        msg = "restore='checkpoint' needs backend='ray' and a checkpoint_dir"
        raise ValueError(msg)
    return shards


def _uint64_keys(entry: tuple[Any, ...]) -> tuple[Any, ...]:
    """A checked entry with its keys as uint64 (int64 keys are reinterpreted, not copied),
    as the route takes them."""
    k = entry[0]
    return entry if k.dtype == np.uint64 else (k.view(np.uint64), *entry[1:])
