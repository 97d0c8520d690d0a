"""Table: one embedding table (uint64 id -> float32 row + optimizer state).

The Python front door of the C++ core. It normalises arguments, raises clear errors before
anything changes, and makes one call into the core per batch with the GIL released.
Exact semantics: ``docs/semantics.md``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from embstore import _arrays, _core, _padding
from embstore._internals import TableInternals
from embstore._persist import exchange as _exchange
from embstore._persist import load as _load
from embstore._persist import save as _save
from embstore.admission import CountFilter
from embstore.initializers import Initializer
from embstore.optimizers import Optimizer, with_learning_rate
from embstore.spec import EvictCallback, TableSpec

if TYPE_CHECKING:  # typing.Self needs Python 3.11; annotations are never evaluated at run time
    from typing_extensions import Self

__all__ = ["EvictCallback", "Table"]

_MAX_STEP = 2**32 - 1


class Table:
    """An embedding table with a fused optimizer, held in a preallocated arena.

    Parameters
    ----------
    dim : int
        Floats per row.
    capacity : int
        Most rows the table ever holds; the arena for them is reserved up front.
    optimizer : SGD, Adagrad, RowWiseAdagrad, Adam or FTRL, optional
        Fused into :meth:`apply_gradients`; its state lives in each row. Default
        ``Adagrad(lr=0.01)``. The learning rate can change later (:meth:`set_lr`).
    initializer : Zeros, Uniform, Normal or TruncatedNormal, optional
        Initial row of a new id, deterministic per ``(seed, id)``.
        Default ``Normal(std=0.01, seed=0)``.
    num_shards : int, optional
        Power of two <= capacity; each shard has its own lock, index and CLOCK ring.
        Default: one per 16,384 rows of capacity, at least two from 16,384 rows,
        at most 16.
    eviction : {"clock", "none"}
        What a full table does on insert: evict by CLOCK (second chance), or raise
        :class:`embstore.CapacityError`.
    num_threads : int, optional
        Worker threads that split each batch (the caller is one of them).
        Default: the machine's hardware threads.
    name : str, optional
        Labels the table in metrics reports and the Prometheus export. Default: its name in
        the first :class:`~embstore.TableGroup` that holds it, else ``"table<k>"``.
    admission : CountFilter, optional
        Give an id a row only once it has been seen ``min_count`` times
        (see :class:`~embstore.CountFilter`). Default: every id is admitted.
    on_evict : callable, optional
        ``on_evict(ids, values)`` receives the rows that CLOCK eviction removed (uint64
        ``[k]``, float32 ``[k, dim]``, fresh arrays the callback may keep). While a batch
        runs, evicted rows are copied aside under their shard's lock; the callback runs after
        the call that evicted them has finished, in the calling thread, holding the GIL and no
        table lock, so it may call back into the table (rows evicted by such a nested call are
        delivered by the same loop, never by a nested callback). If it raises, the exception
        propagates from that call and the rows it was given are not offered again. With
        several threads each call delivers what it finds waiting, so a batch of evictions may
        reach the callback from another thread's call. :meth:`evict` does not call it (it
        returns the rows) and :meth:`erase` removes rows without export.
    padding_id : int, optional
        An id that stands for "no id" (e.g. ``-1``, compared by its 64 bits): it
        contributes nothing to its bag (nor to a mean's count), reads as zeros in
        :meth:`lookup`, gets no row and no update (also through a
        :class:`~embstore.TableGroup`). Default: none, every id is a real id.

    Notes
    -----
    The settings are one :class:`~embstore.TableSpec` (:attr:`spec`);
    ``Table.from_spec(spec)`` builds the same table as ``Table(**kwargs)``.

    Pickling (so ``copy.deepcopy``, ``torch.save(model)`` and multiprocessing work): the
    pickle holds the spec and every row with its optimizer state and last step, the
    current step and the admission counters; unpickling builds an equal table that trains
    on bit for bit like the original (it starts no delta chain, and its statistics start at
    zero). The pickle holds all rows in memory at once: for big tables prefer the streamed
    :meth:`save` / :meth:`load`, which copy one chunk at a time while training goes on. An
    ``on_evict`` callback must be picklable itself (a module-level function, not a lambda).

    Thread safety: every method may be called from any number of threads at once. Writers
    lock each shard once per batch; lookups read without locks (a per-shard seqlock
    validates each row read) unless they must insert; reads are row-consistent (never
    half-updated, never another id's row). Results are bitwise identical for any
    ``num_threads``.
    """

    def __init__(
        self,
        dim: int,
        capacity: int,
        *,
        optimizer: Optimizer | None = None,
        initializer: Initializer | None = None,
        num_shards: int | None = None,
        eviction: str = "clock",
        num_threads: int | None = None,
        name: str | None = None,
        admission: CountFilter | None = None,
        on_evict: EvictCallback | None = None,
        padding_id: int | None = None,
    ) -> None:
        # None means "the spec's default": leave it out rather than repeat the default here.
        chosen: dict[str, Any] = {"optimizer": optimizer, "initializer": initializer}
        spec = TableSpec(
            dim,
            capacity,
            **{k: v for k, v in chosen.items() if v is not None},
            num_shards=num_shards,
            eviction=eviction,
            num_threads=num_threads,
            name=name,
            admission=admission,
            on_evict=on_evict,
            padding_id=padding_id,
        )
        self._state = TableInternals(spec)

    @classmethod
    def from_spec(cls, spec: TableSpec) -> Table:
        """A new, empty table with the settings of ``spec``."""
        if not isinstance(spec, TableSpec):
            msg = f"spec must be an embstore.TableSpec, got {type(spec).__name__}"
            raise TypeError(msg)
        return cls._from_internals(TableInternals(spec))

    @classmethod
    def _from_internals(cls, state: TableInternals) -> Table:
        """The facade of ``state`` (persistence builds tables as internals)."""
        table = cls.__new__(cls)
        table._state = state
        return table

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, (type(self), self._state.spec, _exchange.dump(self._state)))

    def _internals(self) -> TableInternals:
        """The explicitly internal interface (core, spec, checkpoint chain) that
        persistence and :class:`~embstore.TableGroup` work with."""
        return self._state

    # -- properties -------------------------------------------------------------------
    @property
    def spec(self) -> TableSpec:
        """The table's settings (with the current learning rate and, for an unnamed table in
        a group, the group's name for it)."""
        return self._state.spec

    @property
    def name(self) -> str:
        """Labels the table in metrics reports (the given name, the group's, or automatic)."""
        return self._state.name

    @name.setter
    def name(self, value: str) -> None:
        self._state.name = value

    @property
    def dim(self) -> int:
        """Floats per row."""
        return self._state.spec.dim

    @property
    def capacity(self) -> int:
        """Most rows the table holds."""
        return int(self._live().capacity)

    @property
    def num_shards(self) -> int:
        """Number of shards (each with its own lock, index and CLOCK ring)."""
        return int(self._live().num_shards)

    @property
    def num_threads(self) -> int:
        """Worker threads that split a batch."""
        return int(self._live().num_threads)

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer's current settings (with the current learning rate)."""
        return self._state.spec.optimizer

    def set_lr(self, lr: float) -> None:
        """Change the learning rate (``alpha`` for FTRL) for every later call.

        A call already running uses one learning rate for its whole batch.
        """
        impl = self._live()
        lr = _arrays.learning_rate(lr)
        impl.set_lr(lr)
        self._state.set_optimizer(with_learning_rate(self._state.spec.optimizer, lr))

    @property
    def admission(self) -> CountFilter | None:
        """The admission filter, or None when every id is admitted."""
        return self._state.spec.admission

    @property
    def step(self) -> int:
        """The current training step (see :meth:`set_step`)."""
        return int(self._live().step)

    def set_step(self, step: int) -> None:
        """Set the table's current training step, an int in ``[0, 2**32)``.

        Every row records the step at which it was last looked up (with or without
        ``insert``) or updated; :meth:`evict` removes rows by it. Before the first call every
        row's step is 0 (and nothing is recorded, so tables that never use steps pay
        nothing). A call running meanwhile may record the old or the new step.
        """
        impl = self._live()
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            msg = f"step must be an int, got {type(step).__name__}"
            raise TypeError(msg)
        if not 0 <= int(step) <= _MAX_STEP:
            msg = f"step must be in [0, 2**32), got {step}"
            raise ValueError(msg)
        impl.set_step(int(step))

    def evict(self, *, older_than: int, with_state: bool = False) -> dict[str, np.ndarray]:
        """Remove every row whose last step is < ``older_than`` and return them.

        Returns ``{"ids": uint64 [k], "values": float32 [k, dim]}`` and, with
        ``with_state=True``, one entry per optimizer state (named as in
        :meth:`state_names`: e.g. ``"accumulator"`` for Adagrad, ``"m"``, ``"v"``,
        ``"step"`` (uint32) for Adam; one-float states are 1-D), so a PS can spill them.
        Shards are scanned one at a time, each under its lock: calls on other shards go on.
        """
        impl = self._live()
        if isinstance(older_than, bool) or not isinstance(older_than, int | np.integer):
            msg = f"older_than must be an int, got {type(older_than).__name__}"
            raise TypeError(msg)
        bound = int(older_than)
        if bound < 0:
            msg = f"older_than must be >= 0, got {bound}"
            raise ValueError(msg)
        removed = impl.evict_older_than(step=min(bound, 2**63), with_state=bool(with_state))
        return self._state.split_rows(removed["ids"], removed["rows"], with_state=bool(with_state))

    def state_names(self) -> list[str]:
        """Names of the optimizer state entries of :meth:`evict` (and checkpoints)."""
        return [name for name, _, _ in self._state.layout()]

    # -- persistence ------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a full checkpoint of the table to ``path`` (its directory is created if
        needed, as :meth:`TableGroup.save` does).

        The file holds every row (ids, values, optimizer state, last step), the table's
        configuration (dim, capacity, shards, optimizer with its current settings,
        initializer, admission filter and its counters, current step) and a format version
        (see ``docs/checkpoint.md``). It is written atomically (temporary file, fsync,
        rename, directory fsync): a crash at any moment leaves the previous file at
        ``path`` intact. Every section is checksummed.

        Other threads may keep calling every operation meanwhile. The checkpoint is a
        point-in-time snapshot of the whole table: each row is exactly as it was when
        ``save`` began (values and optimizer state of the same moment; calls that returned
        before are in it, calls that start after are not), shards are streamed one chunk
        at a time and rows changed before they are written are copied aside first.
        """
        _save.save(self._state, path, delta=False)

    def save_delta(self, path: str | os.PathLike[str]) -> None:
        """Write an incremental checkpoint: the rows changed since this table's previous
        :meth:`save` or :meth:`save_delta` (or since it was loaded), and the ids removed
        since then (erased, evicted by CLOCK or by :meth:`evict`). It records the id of
        the checkpoint it follows; ``Table.load(base, deltas=[d1, d2, ...])`` applies a
        chain. Same atomicity and point-in-time guarantee as :meth:`save`. Raises
        :class:`~embstore.CheckpointError` if the table has no previous checkpoint.
        """
        _save.save(self._state, path, delta=True)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        deltas: Sequence[str | os.PathLike[str]] = (),
        *,
        keep: str | None = None,
        **overrides: Any,
    ) -> Table:
        """A new table from a full checkpoint and, in order, the deltas that follow it.

        ``overrides``: ``capacity``, ``num_shards``, ``num_threads``, ``name``,
        ``on_evict`` and ``eviction`` may differ from the saved table (rows are re-hashed);
        any other keyword raises TypeError. If the rows do not fit the capacity,
        :class:`~embstore.CapacityError` is raised, unless ``keep="recent"``: then the rows
        with the largest last step are kept (ties in file order), and the table starts no
        delta chain (its next :meth:`save_delta` needs a :meth:`save` first).

        Every file is checked completely (checksums, header, chain order and parents)
        while loading; any problem raises :class:`~embstore.CheckpointError` naming the
        file and no table is returned. The admission counters are restored when the shard
        count is unchanged (else they start empty). The CLOCK ring starts in file order
        with every reference bit set.
        """
        return cls._from_internals(_load.load(path, deltas, dict(overrides), keep))

    def export(self) -> dict[str, np.ndarray]:
        """Every row as numpy arrays: ``ids`` (uint64 ``[n]``), ``values`` (float32
        ``[n, dim]``), one entry per optimizer state (:meth:`state_names`; Adam's ``step``
        is uint32) and ``last_step`` (uint32). A point-in-time copy, as :meth:`save`."""
        return _exchange.export(self._state)

    def import_(self, data: Mapping[str, Any]) -> int:
        """Insert or overwrite rows from a dict shaped like :meth:`export`'s result.

        ``ids`` and ``values`` are required; the optimizer state entries are all given or
        all left out (rows then get fresh state, as a new id does); ``last_step`` defaults
        to the current step. Everything is validated (names, dtypes, shapes, finite
        values, distinct ids) before the table changes. New ids take rows as an insert
        does (CLOCK may evict; ``CapacityError`` with ``eviction="none"`` when full).
        Returns the number of rows written.
        """
        return _exchange.import_(self._state, data)

    @property
    def initializer(self) -> Initializer:
        """The initializer's settings."""
        return self._state.spec.initializer

    @property
    def eviction(self) -> str:
        """``"clock"`` or ``"none"``."""
        return self._state.spec.eviction

    @property
    def padding_id(self) -> int | None:
        """The id that stands for "no id", or None."""
        return self._state.spec.padding_id

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._state.closed

    def __len__(self) -> int:
        return len(self._live())

    def __repr__(self) -> str:
        impl = self._state.core
        if impl is None:
            return "<embstore.Table closed>"
        return (
            f"<embstore.Table dim={self.dim} size={len(impl)} "
            f"capacity={impl.capacity} shards={impl.num_shards} "
            f"optimizer={self.optimizer!r}>"
        )

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Release the table's memory (once no call is still running on it).

        Any later operation raises ValueError. Calling close twice is harmless.
        """
        self._state.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> _core.Table:
        return self._state.live()

    # -- operations -------------------------------------------------------------------
    def lookup(
        self, keys: npt.ArrayLike, *, insert: bool = True, out: np.ndarray | None = None
    ) -> npt.NDArray[np.float32]:
        """Return the rows of ``keys`` as float32 ``[n, dim]``.

        With ``insert=True`` (training) a missing id is inserted with its initial row,
        which is returned; with ``insert=False`` a missing id reads as zeros and nothing is
        inserted. ``out`` (float32 ``[n, dim]``, C-contiguous, writeable) receives the result.
        """
        impl = self._live()
        k = _arrays.as_keys(keys)
        result = _arrays.output(out, k.shape[0], self.dim)
        pad = self._state.padding_key
        keep = None if pad is None else _padding.mask(k, pad)
        if keep is None:
            impl.lookup(keys=k, insert=bool(insert), out=result)
        else:  # padding ids read as zeros and are not looked up
            real = np.ascontiguousarray(k[keep])
            rows = _arrays.new_rows(real.shape[0], self.dim)
            impl.lookup(keys=real, insert=bool(insert), out=rows)
            result[keep] = rows
            result[~keep] = 0.0
        self._state.deliver_evicted()
        return result

    def lookup_sum(
        self,
        keys: npt.ArrayLike,
        offsets: npt.ArrayLike,
        *,
        weights: npt.ArrayLike | None = None,
        mode: str = "sum",
        insert: bool = True,
        out: np.ndarray | None = None,
    ) -> npt.NDArray[np.float32]:
        """Pooled lookup: return ``[len(offsets) - 1, dim]``, the sum (or mean) per bag.

        Bag ``b`` holds ``keys[offsets[b]:offsets[b+1]]``; ``weights`` (float32 ``[n]``)
        scales each id's row. Empty bags give zero rows. Rows are fetched as by
        :meth:`lookup` (same ``insert`` rules) and summed in order.
        """
        impl = self._live()
        k = _arrays.as_keys(keys)
        off = _arrays.as_offsets(offsets)
        w = _arrays.as_weights(weights, k.shape[0])
        code = _arrays.mode_code(mode)
        result = _arrays.output(out, off.shape[0] - 1, self.dim)
        pad = self._state.padding_key
        if pad is not None:
            k, off, w = _padding.drop_from_bags(pad, k, off, w)
        impl.lookup_sum(keys=k, offsets=off, weights=w, mode=code, insert=bool(insert), out=result)
        self._state.deliver_evicted()
        return result

    def apply_gradients(
        self,
        keys: npt.ArrayLike,
        grads: npt.ArrayLike,
        *,
        offsets: npt.ArrayLike | None = None,
        weights: npt.ArrayLike | None = None,
        mode: str = "sum",
    ) -> None:
        """Apply gradients with the table's fused optimizer.

        Without ``offsets``, ``grads`` is ``[n, dim]``, one row per id. With ``offsets``,
        ``grads`` is ``[bags, dim]``: the gradient of :meth:`lookup_sum`'s output for the
        same ``keys``/``offsets``/``weights``/``mode``. Gradients of duplicate ids are summed
        first, then each row gets one optimizer update. A missing id is inserted first.
        NaN or Inf in ``grads`` raises ValueError and nothing is applied.
        """
        impl = self._live()
        k = _arrays.as_keys(keys)
        n = k.shape[0]
        code = _arrays.mode_code(mode)
        if offsets is None:
            if weights is not None or code != 0:
                msg = "weights and mode='mean' need offsets (they describe bags)"
                raise ValueError(msg)
            g = _arrays.as_grads(grads, n, self.dim, "one row per key")
            pad = self._state.padding_key
            if pad is not None:
                k, g = _padding.drop_from_rows(pad, k, g)
            impl.apply_gradients(keys=k, grads=g, offsets=None, weights=None, mode=0)
            self._state.deliver_evicted()
            return
        off = _arrays.as_offsets(offsets)
        w = _arrays.as_weights(weights, n)
        g = _arrays.as_grads(grads, off.shape[0] - 1, self.dim, "one row per bag")
        pad = self._state.padding_key
        if pad is not None:
            k, off, w = _padding.drop_from_bags(pad, k, off, w)
        impl.apply_gradients(keys=k, grads=g, offsets=off, weights=w, mode=code)
        self._state.deliver_evicted()

    def contains(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Return bool ``[n]``: whether each id has a row. Inserts nothing."""
        impl = self._live()
        k = _arrays.as_keys(keys)
        result = np.empty(k.shape[0], dtype=np.bool_)
        impl.contains(keys=k, out=result)
        return result

    def erase(self, keys: npt.ArrayLike) -> int:
        """Remove the rows of ``keys``; return how many rows were removed."""
        impl = self._live()
        return int(impl.erase(keys=_arrays.as_keys(keys)))

    def initial_values(self, keys: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Return the initializer's rows for ``keys`` (the table is not touched)."""
        impl = self._live()
        k = _arrays.as_keys(keys)
        result = np.empty((k.shape[0], self.dim), dtype=np.float32)
        impl.initial_values(keys=k, out=result)
        return result

    def stats(self) -> dict[str, Any]:
        """Return counters: size, capacity, dim, num_shards, hits, misses, inserts,
        evictions (by CLOCK and by :meth:`evict`), erased, admitted and rejected (admission
        filter), lock_waits, lock_wait_us, reused_rows (applied ids whose row the training
        lookup before had resolved), read_retries (lock-free read tasks a concurrent writer
        got in the way of, redone row by row), arena_bytes_in_use, row_stride (floats),
        bytes_per_row, and ``latency``: per
        operation and batch stage, ``{"count", "p50_us", "p95_us", "p99_us", "max_us",
        "mean_us"}`` (see :mod:`embstore.metrics`)."""
        return dict(self._live().stats())

    def reset_metrics(self) -> None:
        """Clear this table's latency histograms (counters are kept)."""
        self._live().reset_timers()


def _unpickle(cls: type[Table], spec: TableSpec, payload: dict[str, Any]) -> Table:
    """A pickled table: a new ``cls`` of ``spec`` holding the pickled rows and counters."""
    table = cls.from_spec(spec)
    _exchange.restore(table._internals(), payload)
    return table
