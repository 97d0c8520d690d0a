"""Table: one embedding table (uint64 id -> float32 row + optimizer state).

The Python front door of the C++ core. It normalises arguments, raises clear errors before
anything changes, and makes one call into the core per batch with the GIL released.
Exact semantics: ``docs/semantics.md``.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from embstore import _arrays, _core, _persist, checkpoint, metrics
from embstore.admission import CountFilter
from embstore.initializers import Initializer, Normal, TruncatedNormal, Uniform, Zeros
from embstore.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Optimizer,
    RowWiseAdagrad,
    learning_rate,
    state_layout,
    with_learning_rate,
)

if TYPE_CHECKING:  # typing.Self needs Python 3.11; annotations are never evaluated at run time
    from typing_extensions import Self

__all__ = ["Table"]

_EVICTION = {"none": 0, "clock": 1}
_OPTIMIZER = {SGD: 0, Adagrad: 1, RowWiseAdagrad: 2, Adam: 3, FTRL: 4}
_INITIALIZER = {Zeros: 0, Uniform: 1, Normal: 2, TruncatedNormal: 3}
_MAX_STEP = 2**32 - 1

#: ``on_evict(ids, values)``: uint64 ``[k]`` and float32 ``[k, dim]`` of rows CLOCK evicted.
EvictCallback = Callable[[npt.NDArray[np.uint64], npt.NDArray[np.float32]], object]


def _initializer_args(init: Initializer) -> tuple[int, float, float, int]:
    if isinstance(init, Zeros):
        return 0, 0.0, 0.0, 0
    if isinstance(init, Uniform):
        return 1, init.low, init.high, init.seed
    return _INITIALIZER[type(init)], init.mean, init.std, init.seed


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
        Default: one per ~2048 rows of capacity, at most 64.
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

    Notes
    -----
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
    ) -> None:
        dim = _arrays.positive_int("dim", dim)
        capacity = _arrays.positive_int("capacity", capacity)
        if optimizer is None:
            optimizer = Adagrad(lr=0.01)
        if type(optimizer) not in _OPTIMIZER:
            msg = (
                "optimizer must be embstore.SGD, Adagrad, RowWiseAdagrad, Adam or FTRL, "
                f"got {optimizer!r}"
            )
            raise TypeError(msg)
        if initializer is None:
            initializer = Normal(std=0.01, seed=0)
        if type(initializer) not in _INITIALIZER:
            msg = f"initializer must be an embstore initializer, got {initializer!r}"
            raise TypeError(msg)
        if eviction not in _EVICTION:
            msg = f"eviction must be 'clock' or 'none', got {eviction!r}"
            raise ValueError(msg)
        shards = 0
        if num_shards is not None:
            shards = _arrays.positive_int("num_shards", num_shards)
            if shards & (shards - 1):
                msg = f"num_shards must be a power of two, got {shards}"
                raise ValueError(msg)
            if shards > capacity:
                msg = f"num_shards ({shards}) must not exceed capacity ({capacity})"
                raise ValueError(msg)
        threads = 0 if num_threads is None else _arrays.positive_int("num_threads", num_threads)
        if admission is not None and not isinstance(admission, CountFilter):
            msg = f"admission must be an embstore.CountFilter or None, got {admission!r}"
            raise TypeError(msg)
        if on_evict is not None and not callable(on_evict):
            msg = f"on_evict must be callable or None, got {on_evict!r}"
            raise TypeError(msg)
        filtered = admission is not None and admission.min_count > 1
        kind, a, b, seed = _initializer_args(initializer)
        self._optimizer: Optimizer = optimizer
        self._initializer: Initializer = initializer
        self._eviction = eviction
        config = _core.TableConfig(
            dim=dim,
            capacity=capacity,
            num_shards=shards,
            num_threads=threads,
            eviction=_EVICTION[eviction],
            optimizer=_OPTIMIZER[type(optimizer)],
            lr=learning_rate(optimizer),
            eps=getattr(optimizer, "eps", 1e-8),
            initial_accumulator=getattr(optimizer, "initial_accumulator", 0.0),
            momentum=getattr(optimizer, "momentum", 0.0),
            beta1=getattr(optimizer, "beta1", 0.9),
            beta2=getattr(optimizer, "beta2", 0.999),
            weight_decay=getattr(optimizer, "weight_decay", 0.0),
            ftrl_beta=optimizer.beta if isinstance(optimizer, FTRL) else 1.0,
            l1=getattr(optimizer, "l1", 0.0),
            l2=getattr(optimizer, "l2", 0.0),
            initializer=kind,
            init_a=a,
            init_b=b,
            seed=seed,
            admission_min_count=admission.min_count if filtered and admission else 0,
            admission_width=admission.width if filtered and admission else 0,
            admission_depth=admission.depth if filtered and admission else 0,
            stage_evicted=on_evict is not None,
        )
        self._impl: _core.Table | None = _core.Table(config)
        self._admission = admission
        self._num_threads_arg = num_threads if num_threads is None else threads
        # The id of this table's last committed checkpoint (or of the one it was loaded
        # from): the parent of the next save_delta. Guarded by _checkpoint_lock.
        self._checkpoint_id: str | None = None
        self._checkpoint_lock = threading.Lock()
        self._on_evict = on_evict
        self._delivering = threading.local()
        self._dim = dim
        self._name_given = name is not None
        self.name: str = name if name is not None else metrics.register(self)
        if name is not None:
            metrics.register(self)

    # -- properties -------------------------------------------------------------------
    @property
    def dim(self) -> int:
        """Floats per row."""
        return self._dim

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
        return self._optimizer

    def set_lr(self, lr: float) -> None:
        """Change the learning rate (``alpha`` for FTRL) for every later call.

        A call already running uses one learning rate for its whole batch.
        """
        impl = self._live()
        lr = float(lr)
        if not math.isfinite(lr) or lr <= 0.0:
            msg = f"lr must be a positive finite number, got {lr!r}"
            raise ValueError(msg)
        impl.set_lr(lr)
        self._optimizer = with_learning_rate(self._optimizer, lr)

    @property
    def admission(self) -> CountFilter | None:
        """The admission filter, or None when every id is admitted."""
        return self._admission

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
        return self._split_rows(removed["ids"], removed["rows"], with_state=bool(with_state))

    def state_names(self) -> list[str]:
        """Names of the optimizer state entries of :meth:`evict` (and checkpoints)."""
        return [name for name, _, _ in state_layout(self._optimizer, self._dim)]

    def _split_rows(
        self, ids: npt.NDArray[np.uint64], rows: npt.NDArray[np.float32], *, with_state: bool
    ) -> dict[str, np.ndarray]:
        if not with_state:
            return {"ids": ids, "values": np.ascontiguousarray(rows[:, : self._dim])}
        layout = state_layout(self._optimizer, self._dim)
        return {"ids": ids, **checkpoint.split_rows(rows, self._dim, layout)}

    def _deliver_evicted(self) -> None:
        """Hand rows CLOCK evicted to ``on_evict`` (after a call that may insert)."""
        impl = self._impl
        if self._on_evict is None or impl is None or impl.evicted_pending == 0:
            return
        if getattr(self._delivering, "active", False):
            return  # a nested call from the callback: the outer loop delivers its rows
        self._delivering.active = True
        try:
            while impl.evicted_pending:
                batch = impl.drain_evicted()
                if batch["ids"].shape[0]:
                    self._on_evict(batch["ids"], batch["rows"])
        finally:
            self._delivering.active = False

    # -- persistence ------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a full checkpoint of the table to ``path``.

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
        _persist.save(self, path, delta=False)

    def save_delta(self, path: str | os.PathLike[str]) -> None:
        """Write an incremental checkpoint: the rows changed since this table's previous
        :meth:`save` or :meth:`save_delta` (or since it was loaded), and the ids removed
        since then (erased, evicted by CLOCK or by :meth:`evict`). It records the id of
        the checkpoint it follows; ``Table.load(base, deltas=[d1, d2, ...])`` applies a
        chain. Same atomicity and point-in-time guarantee as :meth:`save`. Raises
        :class:`~embstore.CheckpointError` if the table has no previous checkpoint.
        """
        _persist.save(self, path, delta=True)

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
        return _persist.load(path, deltas, dict(overrides), keep)

    def export(self) -> dict[str, np.ndarray]:
        """Every row as numpy arrays: ``ids`` (uint64 ``[n]``), ``values`` (float32
        ``[n, dim]``), one entry per optimizer state (:meth:`state_names`; Adam's ``step``
        is uint32) and ``last_step`` (uint32). A point-in-time copy, as :meth:`save`."""
        return _persist.export(self)

    def import_(self, data: Mapping[str, Any]) -> int:
        """Insert or overwrite rows from a dict shaped like :meth:`export`'s result.

        ``ids`` and ``values`` are required; the optimizer state entries are all given or
        all left out (rows then get fresh state, as a new id does); ``last_step`` defaults
        to the current step. Everything is validated (names, dtypes, shapes, finite
        values, distinct ids) before the table changes. New ids take rows as an insert
        does (CLOCK may evict; ``CapacityError`` with ``eviction="none"`` when full).
        Returns the number of rows written.
        """
        return _persist.import_(self, data)

    @property
    def initializer(self) -> Initializer:
        """The initializer's settings."""
        return self._initializer

    @property
    def eviction(self) -> str:
        """``"clock"`` or ``"none"``."""
        return self._eviction

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._impl is None

    def __len__(self) -> int:
        return len(self._live())

    def __repr__(self) -> str:
        if self._impl is None:
            return "<embstore.Table closed>"
        return (
            f"<embstore.Table dim={self._dim} size={len(self._impl)} "
            f"capacity={self._impl.capacity} shards={self._impl.num_shards} "
            f"optimizer={self._optimizer!r}>"
        )

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Release the table's memory (once no call is still running on it).

        Any later operation raises ValueError. Calling close twice is harmless.
        """
        self._impl = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> Any:
        msg = "embstore.Table cannot be pickled"
        raise TypeError(msg)

    def _live(self) -> _core.Table:
        impl = self._impl
        if impl is None:
            msg = "operation on a closed embstore.Table"
            raise ValueError(msg)
        return impl

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
        result = _arrays.output(out, k.shape[0], self._dim)
        impl.lookup(keys=k, insert=bool(insert), out=result)
        self._deliver_evicted()
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
        result = _arrays.output(out, off.shape[0] - 1, self._dim)
        impl.lookup_sum(keys=k, offsets=off, weights=w, mode=code, insert=bool(insert), out=result)
        self._deliver_evicted()
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
            g = _arrays.as_grads(grads, n, self._dim, "one row per key")
            impl.apply_gradients(keys=k, grads=g, offsets=None, weights=None, mode=0)
            self._deliver_evicted()
            return
        off = _arrays.as_offsets(offsets)
        w = _arrays.as_weights(weights, n)
        g = _arrays.as_grads(grads, off.shape[0] - 1, self._dim, "one row per bag")
        impl.apply_gradients(keys=k, grads=g, offsets=off, weights=w, mode=code)
        self._deliver_evicted()

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
        result = np.empty((k.shape[0], self._dim), dtype=np.float32)
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
