"""Runner of the canonical workload W1 (``python -m embstore bench``).

W1 is the pooled training step on warm tables defined in ``WORKLOADS.md``: ``T`` tables of
``U`` Zipf-distributed hashed ids each, batches of ``B`` examples with exactly ``L`` ids per
table, a pooled-sum forward and an Adagrad backward. The runner

1. generates the key stream and the fixed gradients before anything is timed
   (:func:`make_workload`);
2. for every peer (embstore and the baselines of :data:`PEERS`), builds and warms the
   tables, checks the peer's results against a plain numpy computation, runs a few
   untimed warm-up steps, then times ``forward`` and ``backward`` on every timed batch;
3. prints a header (commit, CPU, versions), one markdown table of medians and the memory
   figures of embstore's tables, and optionally writes the same as JSON.

Only numpy is imported at module import time; embstore's core, pandas and torch are
imported inside the peers that need them, so a missing optional package skips a peer
instead of failing the run.

Adding a peer (FBGEMM's TBE, say) is a matter of writing a :class:`Peer` subclass and
decorating it with :func:`register_peer`; it then appears in ``--peers`` and in the table.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "PEERS",
    "Batch",
    "BenchConfig",
    "Peer",
    "TableData",
    "Workload",
    "main",
    "make_workload",
    "register_peer",
    "run",
    "settle_allocator",
    "splitmix64",
    "zipf_cdf",
]

U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]
F32Array = npt.NDArray[np.float32]

#: Zipf exponent of the key stream (WORKLOADS.md).
ZIPF_ALPHA = 1.05
#: Multiplier of the placement order: rank ``r`` sits at position ``r * 618033 mod U``.
PLACEMENT_MULTIPLIER = 618033
#: W1's optimizer: Adagrad, element-wise, initial accumulator 0.
LR = 0.01
EPS = 1e-8
#: Forward outputs must match the numpy reference within these tolerances (the core is
#: specified to be bit-exact; the tolerance only absorbs peers that sum in another order).
FWD_RTOL, FWD_ATOL = 1e-5, 1e-6
#: Slack on top of :func:`reference_adagrad`'s per-element tolerance (which is a few ulp
#: where the duplicate sum is well conditioned).
UPD_ATOL = 1e-9

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


# --------------------------------------------------------------------------------------
# Workload generation
# --------------------------------------------------------------------------------------


def splitmix64(x: npt.ArrayLike) -> U64Array:
    """Vectorised splitmix64 (all arithmetic mod 2**64).

    Parameters
    ----------
    x : array_like of uint64
        Inputs.

    Returns
    -------
    numpy.ndarray of uint64
        ``splitmix64(x)`` element-wise.
    """
    with np.errstate(over="ignore"):
        z: U64Array = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
        return z ^ (z >> np.uint64(31))


def zipf_cdf(universe: int, alpha: float = ZIPF_ALPHA) -> npt.NDArray[np.float64]:
    """Cumulative distribution of a Zipf law truncated to ``universe`` ranks.

    Rank ``r`` (0 is the hottest) has probability proportional to ``(r + 1) ** -alpha``.
    Sample with ``np.searchsorted(cdf, rng.random(n))``.
    """
    weights = np.arange(1, universe + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    cdf[-1] = 1.0  # rng.random() < 1, so searchsorted never returns ``universe``
    return cdf


def placement(universe: int) -> I64Array:
    """Position of every rank in the warm-up order and dense row: ``r * 618033 mod U``.

    Raises
    ------
    ValueError
        If the map is not a permutation of ``range(U)`` (``U`` shares a factor with 618033).
    """
    if math.gcd(PLACEMENT_MULTIPLIER, universe) != 1:
        msg = (
            f"universe {universe} shares a factor with {PLACEMENT_MULTIPLIER} "
            "(= 3 * 206011): the placement order would not be a permutation"
        )
        raise ValueError(msg)
    return (np.arange(universe, dtype=np.int64) * PLACEMENT_MULTIPLIER) % universe


@dataclass
class TableData:
    """One table of the workload: ids of every rank and the placement order.

    Attributes
    ----------
    index : int
        Table number ``t`` (ids are ``splitmix64(rank + (t << 32))``).
    ids : numpy.ndarray of uint64, [U]
        ``ids[r]`` is the feature id of rank ``r``.
    row : numpy.ndarray of int64, [U]
        ``row[r] = r * 618033 mod U``: the dense row of rank ``r`` and its position in the
        warm-up order.
    warm_ids : numpy.ndarray of uint64, [U]
        The warm-up order: ``warm_ids[i]`` is the id of the rank placed at position ``i``,
        so ``warm_ids[row[r]] == ids[r]``.
    """

    index: int
    ids: U64Array
    row: I64Array
    warm_ids: U64Array

    @property
    def universe(self) -> int:
        """Number of ranks ``U``."""
        return int(self.ids.shape[0])

    @property
    def name(self) -> str:
        """Name of the table in a :class:`embstore.TableGroup`."""
        return f"t{self.index}"

    def initial_rows(self, dim: int, seed: int) -> F32Array:
        """Initial weights of the dense peers, row-indexed, uniform in [-0.01, 0.01).

        Written page by page, so the array is resident before anything is timed.
        """
        rng = np.random.default_rng([seed, self.index, dim, 1])
        out = rng.random((self.universe, dim), dtype=np.float32)
        out *= np.float32(0.02)
        out -= np.float32(0.01)
        return out


@dataclass
class Batch:
    """One batch: ``B`` examples with exactly ``L`` ids in each table, as CSR bags.

    Attributes
    ----------
    keys : list of numpy.ndarray of uint64, each [B * L]
        Hashed feature ids, one array per table.
    rows : list of numpy.ndarray of int64, each [B * L]
        The same ids as dense row numbers (``row[rank]``), precomputed for the dense peers.
    offsets : numpy.ndarray of int64, [B + 1]
        Bag boundaries (``b * L``), shared by all tables.
    """

    batch_size: int
    pooling: int
    keys: list[U64Array]
    rows: list[I64Array]
    offsets: I64Array

    @property
    def num_ids(self) -> int:
        """Ids in the batch over all tables."""
        return sum(int(k.shape[0]) for k in self.keys)


@dataclass
class Workload:
    """Everything a run needs, generated before the timed region."""

    num_tables: int
    universe: int
    batch_size: int
    pooling: int
    dim: int
    seed: int
    tables: list[TableData]
    batches: list[Batch]
    grads: list[F32Array]


def make_tables(num_tables: int, universe: int) -> list[TableData]:
    """Ids and placement of ``num_tables`` tables of ``universe`` ranks (no randomness)."""
    row = placement(universe)
    ranks = np.arange(universe, dtype=np.uint64)
    tables = []
    for t in range(num_tables):
        ids = splitmix64(ranks + np.uint64(t << 32))
        warm = np.empty_like(ids)
        warm[row] = ids
        tables.append(TableData(index=t, ids=ids, row=row, warm_ids=warm))
    return tables


def make_workload(
    *,
    num_tables: int,
    universe: int,
    batch_size: int,
    pooling: int,
    dim: int,
    num_batches: int,
    seed: int = 0,
    alpha: float = ZIPF_ALPHA,
    tables: list[TableData] | None = None,
) -> Workload:
    """Generate W1's key stream and gradients.

    Parameters
    ----------
    num_tables, universe, batch_size, pooling, dim : int
        ``T``, ``U``, ``B``, ``L`` and ``D`` of WORKLOADS.md.
    num_batches : int
        Batches to generate (warm-up plus timed).
    seed : int
        Seed of the key stream and the gradients. Ranks of a batch are drawn, table by
        table, from ``np.random.default_rng([seed, L])``; the gradients, one fixed
        standard-normal ``[B, D]`` array per table, from ``default_rng([seed, D, 2])``.
    alpha : float
        Zipf exponent.
    tables : list of TableData, optional
        Reuse tables made by :func:`make_tables` for the same ``T`` and ``U``.

    Returns
    -------
    Workload
    """
    if tables is None:
        tables = make_tables(num_tables, universe)
    cdf = zipf_cdf(universe, alpha)
    n = batch_size * pooling
    offsets = np.arange(0, n + 1, pooling, dtype=np.int64)
    rng = np.random.default_rng([seed, pooling])
    batches = []
    for _ in range(num_batches):
        keys, rows = [], []
        for tab in tables:
            ranks = np.searchsorted(cdf, rng.random(n))
            keys.append(tab.ids[ranks])
            rows.append(tab.row[ranks])
        batches.append(Batch(batch_size, pooling, keys, rows, offsets))
    grng = np.random.default_rng([seed, dim, 2])
    grads = [grng.standard_normal((batch_size, dim), dtype=np.float32) for _ in tables]
    return Workload(num_tables, universe, batch_size, pooling, dim, seed, tables, batches, grads)


# --------------------------------------------------------------------------------------
# numpy reference (used to verify every peer before timing)
# --------------------------------------------------------------------------------------


def reference_pool(rows: F32Array, pooling: int) -> F32Array:
    """Pooled sums of ``rows`` [B * L, D] per bag of ``L``, added in order from zero."""
    r3 = rows.reshape(-1, pooling, rows.shape[1])
    out = np.zeros((r3.shape[0], r3.shape[2]), dtype=np.float32)
    for j in range(pooling):
        out += r3[:, j]
    return out


def reference_adagrad(
    keys: npt.NDArray[Any],
    before: F32Array,
    acc_before: F32Array | None,
    grads: F32Array,
    pooling: int,
    lr: float = LR,
    eps: float = EPS,
) -> tuple[F32Array, npt.NDArray[np.float64]]:
    """Rows of ``keys`` after one Adagrad step (docs/semantics.md), one row per occurrence.

    Gradients of equal keys are summed in order from zero, then each distinct row is
    updated once: ``acc += g * g; w -= (lr * g) / (sqrt(acc) + eps)`` in float32. That is
    embstore's exact arithmetic; a peer that sums duplicates in another order (torch's
    ``coalesce``) gets another ``g``, and where the sum cancels (``|g|`` near ``eps``) the
    step amplifies that difference: W1 at D=128 had ``|g| = 3e-6`` from 6 terms of size 1
    differing by 1% between orders, and weights 1.5e-6 apart.

    Returns
    -------
    rows : numpy.ndarray of float32, [n, D]
        The updated row of every occurrence.
    tol : numpy.ndarray of float64, [n, D]
        What any summation order may change: the float32 bound on the sum's error,
        ``count * 2**-24 * sum(|g_i|)``, times the largest slope of the step in ``g``
        over that interval, capped at ``2 * lr``; plus 8 ulp of ``|w| + |step|``.
    """
    dim = before.shape[1]
    uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    per_id = np.repeat(grads, pooling, axis=0)
    g = np.zeros((uniq.shape[0], dim), dtype=np.float32)
    np.add.at(g, inv, per_id)  # unbuffered and in order
    acc = np.zeros_like(g) if acc_before is None else acc_before[first].copy()
    a0 = acc.astype(np.float64)
    acc += g * g
    step = (np.float32(lr) * g) / (np.sqrt(acc) + np.float32(eps))
    new = before[first] - step
    # Conditioning of the step f(g) = lr * g / (sqrt(a0 + g^2) + eps):
    # |f'(g)| = lr * (a0 / s + eps) / (s + eps)^2 with s = sqrt(a0 + g^2), decreasing in s.
    abs_sum = np.zeros(g.shape, dtype=np.float64)
    np.add.at(abs_sum, inv, np.abs(per_id).astype(np.float64))
    count = np.bincount(inv, minlength=uniq.shape[0]).astype(np.float64)[:, None]
    dg = count * 2.0**-24 * abs_sum
    g_min = np.maximum(np.abs(g.astype(np.float64)) - dg, 0.0)
    s_min = np.sqrt(a0 + g_min * g_min)
    a0_over_s = np.divide(a0, s_min, out=np.zeros_like(a0), where=s_min > 0)
    slope = lr * (a0_over_s + eps) / (s_min + eps) ** 2
    scale = np.abs(before[first]) + np.abs(step)  # w - step may cancel: ulp of the operands
    tol = np.minimum(slope * dg, 2.0 * lr) + 8.0 * np.spacing(scale).astype(np.float64)
    return new[inv].astype(np.float32, copy=False), tol[inv]


def _max_err(a: npt.ArrayLike, b: npt.ArrayLike) -> float:
    d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    return float(d.max()) if d.size else 0.0


def _as_numpy(x: Any) -> F32Array:
    """numpy view of a peer's output (torch tensors are detached first)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


class VerificationError(AssertionError):
    """A peer's result differs from the numpy reference."""


# --------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------


class Peer:
    """A store under test. Subclass, then decorate with :func:`register_peer`.

    Life cycle: ``Peer(threads)``, :meth:`setup` (build and warm ``T`` tables of ``D``
    columns), then any number of :meth:`forward` / :meth:`backward` pairs, then
    :meth:`close`. :meth:`read_rows` is used only by the verification, never timed.

    Class attributes
    ----------------
    name : str
        Key in :data:`PEERS` and the ``--peers`` flag.
    label : str
        Row label in the result table.
    threaded : bool
        Whether the thread count changes the peer's work. Peers that are not threaded are
        measured once per ``(D, L)`` and shown against embstore at every thread count.
    hashed : bool
        Whether the peer maps hashed ids to rows itself (``False``: dense, precomputed rows).
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    threaded: ClassVar[bool] = False
    hashed: ClassVar[bool] = False

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads

    @classmethod
    def unavailable(cls) -> str | None:
        """Why the peer cannot run here (a missing package), or ``None`` if it can."""
        return None

    def setup(self, tables: Sequence[TableData], dim: int) -> None:
        """Build the tables and insert all ``U`` ids of each, in placement order."""
        raise NotImplementedError

    def forward(self, batch: Batch) -> Sequence[Any]:
        """Pooled sums: one ``[B, D]`` float32 array (or tensor) per table."""
        raise NotImplementedError

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        """Apply the bag gradients ``grads[t]`` [B, D] of the last forward with Adagrad."""
        raise NotImplementedError

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        """Current weights (and Adagrad accumulators, if readable) of the batch's ids."""
        raise NotImplementedError

    def close(self) -> None:
        """Free the tables."""

    def extra(self) -> dict[str, Any]:
        """Peer-specific facts for the report (memory, counters)."""
        return {}


PeerT = TypeVar("PeerT", bound=type[Peer])

#: Peer registry: name -> class (the class is the factory: ``cls(threads)``).
PEERS: dict[str, type[Peer]] = {}


def register_peer(cls: PeerT) -> PeerT:
    """Class decorator adding a :class:`Peer` subclass to :data:`PEERS` under ``cls.name``.

    Example (a later FBGEMM TBE peer)::

        @register_peer
        class FbgemmTbePeer(Peer):
            name = "fbgemm"
            label = "FBGEMM CPU TBE, EXACT_ADAGRAD, dense"
            threaded = False

            @classmethod
            def unavailable(cls):
                try:
                    importlib.import_module("fbgemm_gpu")
                except ImportError:
                    return "skipped: fbgemm_gpu not installed"
                return None
            ...
    """
    if not cls.name:
        msg = f"{cls.__name__} has no name"
        raise ValueError(msg)
    PEERS[cls.name] = cls
    return cls


def _resident_bytes() -> int | None:
    """Resident set size of this process, from /proc (``None`` where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


#: Ids inserted per warm-up call (bounds the temporary output buffer).
WARM_CHUNK = 1 << 16


def warm_table(table: Any, ids: U64Array, dim: int) -> None:
    """Insert ``ids`` into an embstore table in order, ``WARM_CHUNK`` at a time."""
    buf = np.empty((min(WARM_CHUNK, max(1, ids.shape[0])), dim), dtype=np.float32)
    for lo in range(0, ids.shape[0], WARM_CHUNK):
        chunk = ids[lo : lo + WARM_CHUNK]
        table.lookup(chunk, insert=True, out=buf[: chunk.shape[0]])


def embstore_tables(
    tables: Sequence[TableData],
    dim: int,
    *,
    optimizer: Any = None,
    capacity: int | None = None,
    threads: int | None = None,
    warm: bool = True,
    warm_filter: Callable[[U64Array], U64Array] | None = None,
    **table_kwargs: Any,
) -> dict[str, Any]:
    """One embstore Table per workload table, by name: W1's initializer (Normal(0.01),
    seeded by the table index), ``optimizer`` (default W1's Adagrad), ``capacity`` (default
    the universe), warmed in placement order unless ``warm`` is false. ``warm_filter`` picks
    which of the ids to insert (W4 leaves some out); ``table_kwargs`` go to ``Table``
    (e.g. ``admission``)."""
    es = importlib.import_module("embstore")
    out: dict[str, Any] = {}
    for tab in tables:
        t = es.Table(
            dim=dim,
            capacity=capacity or tab.universe,
            optimizer=optimizer or es.Adagrad(lr=LR, eps=EPS, initial_accumulator=0.0),
            initializer=es.Normal(std=0.01, seed=tab.index),
            eviction="clock",
            num_threads=threads,
            **table_kwargs,
        )
        if warm:
            ids = tab.warm_ids if warm_filter is None else warm_filter(tab.warm_ids)
            warm_table(t, ids, dim)
        out[tab.name] = t
    return out


def memory_probe(num_tables: int, universe: int, dim: int, threads: int | None) -> dict[str, Any]:
    """Resident memory of ``num_tables`` warm embstore tables, measured in this process.

    Meant to run in a fresh interpreter (see :func:`probe_memory`): the resident set
    before creating the tables, after creating them (shows how much of the arena is
    committed up front) and after inserting all ``universe`` ids of each.
    """
    tables = make_tables(num_tables, universe)
    gc.collect()
    rss0 = _resident_bytes()
    made = list(embstore_tables(tables, dim, threads=threads, warm=False).values())
    rss1 = _resident_bytes()
    for t, tab in zip(made, tables):
        warm_table(t, tab.warm_ids, dim)
    gc.collect()
    rss2 = _resident_bytes()
    rows = sum(len(t) for t in made)
    out: dict[str, Any] = {
        "rows": rows,
        "dim": dim,
        "payload_bytes_per_row": 8 + 2 * 4 * dim,
        "stats_bytes_per_row": made[0].stats().get("bytes_per_row"),
    }
    if rss0 is not None and rss1 is not None and rss2 is not None and rows:
        out.update(
            rss_created_bytes=rss1 - rss0,
            rss_delta_bytes=rss2 - rss0,
            rss_bytes_per_row=(rss2 - rss0) / rows,
        )
    return out


def probe_memory(num_tables: int, universe: int, dim: int, threads: int | None) -> dict[str, Any]:
    """Run :func:`memory_probe` in a fresh interpreter and return its result.

    A fresh process is needed because memory freed by earlier tables (or peers) stays in
    this process's allocator and would hide part of the new tables' footprint.
    """
    es = importlib.import_module("embstore")
    root = str(Path(str(es.__file__)).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    code = (
        "import json; from embstore.bench import memory_probe; "
        f"print(json.dumps(memory_probe({num_tables}, {universe}, {dim}, {threads!r})))"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
            check=True,
        )
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"dim": dim, "error": f"memory probe failed: {exc}"}
    return result


@register_peer
class EmbstorePeer(Peer):
    """embstore: one :class:`embstore.TableGroup` call per batch for all tables."""

    name = "embstore"
    label = "embstore TableGroup"
    threaded = True
    hashed = True

    def __init__(
        self, threads: int | None = None, *, capacity: int | None = None, warm: bool = True
    ) -> None:
        super().__init__(threads)
        self._capacity = capacity
        self._warm = warm
        self._tables: list[Any] = []
        self._names: list[str] = []
        self._group: Any = None
        self._extra: dict[str, Any] = {}

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            importlib.import_module("embstore")
        except ImportError as exc:
            return f"skipped: embstore core not importable ({exc})"
        return None

    def setup(self, tables: Sequence[TableData], dim: int) -> None:
        es = importlib.import_module("embstore")
        by_name = embstore_tables(
            tables, dim, capacity=self._capacity, threads=self.threads, warm=self._warm
        )
        self._names, self._tables = list(by_name), list(by_name.values())
        self._group = es.TableGroup(by_name)
        if not self._warm:
            return
        rows = sum(len(t) for t in self._tables)
        stats = [t.stats() for t in self._tables]
        evictions = sum(int(st.get("evictions", 0)) for st in stats)
        self._extra = {
            "rows": rows,
            "stats_bytes_per_row": stats[0].get("bytes_per_row"),
            "num_shards": stats[0].get("num_shards"),
            "evictions_during_warmup": evictions,
        }
        expected = sum(tab.universe for tab in tables)
        if rows != expected or evictions:
            self._extra["warning"] = (
                f"warm-up left {rows} of {expected} ids resident ({evictions} evictions)"
            )

    def forward(self, batch: Batch) -> Sequence[Any]:
        out = self._group.lookup_sum(
            {n: (k, batch.offsets) for n, k in zip(self._names, batch.keys)}
        )
        return [out[n] for n in self._names]

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        self._group.apply_gradients(
            {n: (k, batch.offsets, g) for n, k, g in zip(self._names, batch.keys, grads)}
        )

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        rows = self._tables[table].lookup(batch.keys[table], insert=False)
        return np.asarray(rows), None

    def initial_values(self, table: int, keys: U64Array) -> F32Array:
        """The initializer's rows of ``keys`` in table ``table``."""
        return np.asarray(self._tables[table].initial_values(keys))

    def extra(self) -> dict[str, Any]:
        return dict(self._extra)

    def close(self) -> None:
        self._group = None
        self._tables.clear()


def _dense_adagrad(
    w: F32Array, acc: F32Array, rows: I64Array, grads: F32Array, pooling: int
) -> None:
    """Adagrad on the distinct ``rows`` of a dense table, duplicates summed first.

    ``np.unique`` gives the distinct rows and the inverse map; the per-occurrence
    gradients (``grads[b]`` for every id of bag ``b``) are summed with the fast 1-D
    ``np.add.at`` over flattened ``[row, column]`` indices.
    """
    dim = w.shape[1]
    uniq, inv = np.unique(rows, return_inverse=True)
    g = np.zeros(uniq.shape[0] * dim, dtype=np.float32)
    idx = (inv.reshape(-1, 1) * dim + np.arange(dim)).reshape(-1)
    per_id = grads if pooling == 1 else np.repeat(grads, pooling, axis=0)
    np.add.at(g, idx, per_id.reshape(-1))
    g2 = g.reshape(-1, dim)
    a = np.take(acc, uniq, axis=0)
    a += g2 * g2
    acc[uniq] = a
    wu = np.take(w, uniq, axis=0)
    wu -= (np.float32(LR) * g2) / (np.sqrt(a) + np.float32(EPS))
    w[uniq] = wu


def _resident_zeros(shape: tuple[int, int]) -> F32Array:
    """A zero array whose pages are all written (np.zeros' pages fault on first touch)."""
    out = np.empty(shape, dtype=np.float32)
    out.fill(0.0)
    return out


@register_peer
class NumpyDensePeer(Peer):
    """The floor: dense numpy tables indexed by precomputed rows, no hashing at all."""

    name = "numpy"
    label = "numpy dense gather, precomputed rows"
    threaded = False
    hashed = False

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(threads)
        self._w: list[F32Array] = []
        self._acc: list[F32Array] = []

    def setup(self, tables: Sequence[TableData], dim: int) -> None:
        for tab in tables:
            self._w.append(tab.initial_rows(dim, seed=0))
            self._acc.append(_resident_zeros((tab.universe, dim)))

    def forward(self, batch: Batch) -> Sequence[Any]:
        # table[rows].reshape(B, L, D).sum(1); np.take is the same gather, 2-3x faster.
        b, lp = batch.batch_size, batch.pooling
        return [
            np.take(w, r, axis=0).reshape(b, lp, w.shape[1]).sum(1)
            for w, r in zip(self._w, batch.rows)
        ]

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        for w, a, r, g in zip(self._w, self._acc, batch.rows, grads):
            _dense_adagrad(w, a, r, g, batch.pooling)

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        r = batch.rows[table]
        return self._w[table][r], self._acc[table][r]

    def close(self) -> None:
        self._w.clear()
        self._acc.clear()


@register_peer
class PandasIndexPeer(Peer):
    """A hand-rolled hashed store: ``pd.Index(ids).get_indexer(keys)`` + numpy arrays."""

    name = "pandas"
    label = "pandas Index + numpy, hashed"
    threaded = False
    hashed = True

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(threads)
        self._index: list[Any] = []
        self._w: list[F32Array] = []
        self._acc: list[F32Array] = []

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            importlib.import_module("pandas")
        except ImportError:
            return "skipped: pandas not installed"
        return None

    def setup(self, tables: Sequence[TableData], dim: int) -> None:
        pd = importlib.import_module("pandas")
        for tab in tables:
            # Position i of the index holds warm_ids[i], the id whose dense row is i, so
            # the values are laid out exactly as the dense peers'.
            index = pd.Index(tab.warm_ids)
            index.get_indexer(tab.warm_ids[:1])  # builds the hash table now, not timed
            self._index.append(index)
            self._w.append(tab.initial_rows(dim, seed=0))
            self._acc.append(_resident_zeros((tab.universe, dim)))

    def _rows(self, table: int, keys: U64Array) -> I64Array:
        rows: I64Array = self._index[table].get_indexer(keys)
        if rows.shape[0] and rows.min() < 0:
            msg = "pandas peer: a key is missing (inserting is not implemented)"
            raise KeyError(msg)
        return rows

    def forward(self, batch: Batch) -> Sequence[Any]:
        b, lp = batch.batch_size, batch.pooling
        out = []
        for t, keys in enumerate(batch.keys):
            w = self._w[t]
            rows = np.take(w, self._rows(t, keys), axis=0)
            out.append(rows.reshape(b, lp, w.shape[1]).sum(1))
        return out

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        for t, (keys, g) in enumerate(zip(batch.keys, grads)):
            _dense_adagrad(self._w[t], self._acc[t], self._rows(t, keys), g, batch.pooling)

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        r = self._rows(table, batch.keys[table])
        return self._w[table][r], self._acc[table][r]

    def close(self) -> None:
        self._index.clear()
        self._w.clear()
        self._acc.clear()


def _import_torch() -> Any:
    """Import torch (lazily: it is an optional peer)."""
    return importlib.import_module("torch")


def apply_omp_wait_policy(policy: str) -> str:
    """Set ``OMP_WAIT_POLICY`` for torch's OpenMP workers before torch is imported.

    ``policy`` is ``"torch-default"`` (leave the environment alone), ``"active"`` or
    ``"passive"``. Measured on the 2-core development VM, W1 at U=1e6, torch with 2
    threads: on a quiet machine the active wait (libgomp's default) is faster (L=1 step
    6.7-8.3 ms against 13.7-16.9 ms passive); when another process holds a core, an
    actively waiting worker spins through the other thread's time slice and every parallel
    region costs a scheduler tick (L=1 backward 130 ms active against 11 ms passive).

    Returns
    -------
    str
        The policy in effect, as reported in the header.
    """
    if policy in ("active", "passive"):
        if "torch" in sys.modules:
            return f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} (torch already imported)"
        os.environ["OMP_WAIT_POLICY"] = policy.upper()
    return os.environ.get("OMP_WAIT_POLICY", "unset (libgomp default: active)")


@register_peer
class TorchEmbeddingBagPeer(Peer):
    """torch ``embedding_bag(mode="sum", sparse=True)`` + ``torch.optim.Adagrad``, dense."""

    name = "torch"
    label = "torch embedding_bag + sparse Adagrad, dense"
    threaded = True
    hashed = False

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(threads)
        self._torch: Any = None
        self._weights: list[Any] = []
        self._opt: Any = None
        self._outs: list[Any] = []
        self._saved_threads: int | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            _import_torch()
        except ImportError:
            return "skipped: torch not installed"
        return None

    def setup(self, tables: Sequence[TableData], dim: int) -> None:
        torch = _import_torch()
        self._torch = torch
        # The default (no checks) made explicit, which also silences the warning
        # torch.optim.Adagrad would print on its first sparse step.
        torch.sparse.check_sparse_tensor_invariants.disable()
        self._saved_threads = int(torch.get_num_threads())
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        for tab in tables:
            w = torch.from_numpy(tab.initial_rows(dim, seed=0))
            self._weights.append(torch.nn.Parameter(w))
        self._opt = torch.optim.Adagrad(
            self._weights, lr=LR, eps=EPS, initial_accumulator_value=0.0
        )

    def forward(self, batch: Batch) -> Sequence[Any]:
        torch = self._torch
        fn = torch.nn.functional.embedding_bag
        offsets = torch.from_numpy(batch.offsets)
        self._outs = [
            fn(torch.from_numpy(r), w, offsets, mode="sum", sparse=True, include_last_offset=True)
            for w, r in zip(self._weights, batch.rows)
        ]
        return self._outs

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        torch = self._torch
        torch.autograd.backward(self._outs, [torch.from_numpy(g) for g in grads])
        self._opt.step()
        self._opt.zero_grad(set_to_none=True)
        self._outs = []

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        r = batch.rows[table]
        w = self._weights[table]
        state = self._opt.state.get(w, {})
        acc = state.get("sum")
        return (
            w.detach().numpy()[r].copy(),
            None if acc is None else acc.numpy()[r].copy(),
        )

    def close(self) -> None:
        self._outs = []
        self._opt = None
        self._weights.clear()
        if self._torch is not None and self._saved_threads is not None:
            self._torch.set_num_threads(self._saved_threads)


# --------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------


def verify_peer(
    peer: Peer, batch: Batch, grads: Sequence[F32Array], *, check_update: bool = True
) -> dict[str, float]:
    """Check a peer's forward (and one Adagrad step) against the numpy reference.

    The forward must equal the in-order sum of the rows the peer holds for the batch's
    ids; after ``backward`` the rows must equal :func:`reference_adagrad` applied to the
    rows (and accumulators, zero when unreadable) read before the step.

    Returns
    -------
    dict
        ``forward_max_abs_err`` and, with ``check_update``, ``update_max_abs_err``.

    Raises
    ------
    VerificationError
        On a mismatch beyond the tolerances.
    """
    outs = [_as_numpy(o) for o in peer.forward(batch)]
    before = [peer.read_rows(t, batch) for t in range(len(batch.keys))]
    fwd_err = 0.0
    for t, (out, (rows, _)) in enumerate(zip(outs, before)):
        ref = reference_pool(rows, batch.pooling)
        fwd_err = max(fwd_err, _max_err(out, ref))
        if out.shape != ref.shape or not np.allclose(out, ref, rtol=FWD_RTOL, atol=FWD_ATOL):
            msg = (
                f"{peer.name}: forward of table {t} differs from the numpy gather+sum "
                f"(max abs err {_max_err(out, ref):.3g})"
            )
            raise VerificationError(msg)
    result = {"forward_max_abs_err": fwd_err}
    if not check_update:
        return result
    peer.backward(batch, grads)
    upd_err = 0.0
    for t, (rows, acc) in enumerate(before):
        after, _ = peer.read_rows(t, batch)
        key = batch.keys[t] if peer.hashed else batch.rows[t]
        ref, tol = reference_adagrad(key, rows, acc, grads[t], batch.pooling)
        err = _max_err(after, ref)
        upd_err = max(upd_err, err)
        if not np.all(np.abs(after.astype(np.float64) - ref) <= tol + UPD_ATOL):
            msg = (
                f"{peer.name}: Adagrad step of table {t} differs from numpy (max abs err {err:.3g})"
            )
            raise VerificationError(msg)
    result["update_max_abs_err"] = upd_err
    return result


def verify_embstore(
    peer: EmbstorePeer, wl: Workload, batch: Batch, threads: int | None
) -> dict[str, float]:
    """Verify embstore: forward on the warm tables, and one Adagrad step on a copy.

    The warm tables' accumulators are not readable, so the update is checked on fresh
    tables of the same configuration (a copy holding only the batch's ids, inserted by
    the forward with their initializer rows, accumulators at 0), through the same
    :class:`embstore.TableGroup` path and thread count. The copy's inserted rows must
    also equal ``Table.initial_values``.
    """
    result = verify_peer(peer, batch, wl.grads, check_update=False)
    copy = EmbstorePeer(threads, capacity=batch.batch_size * batch.pooling, warm=False)
    copy.setup(wl.tables, wl.dim)
    try:
        # Insert the batch's ids first so that read_rows sees them.
        copy.forward(batch)
        init_err = 0.0
        for t, keys in enumerate(batch.keys):
            rows, _ = copy.read_rows(t, batch)
            init = copy.initial_values(t, keys)
            init_err = max(init_err, _max_err(rows, init))
            if not np.array_equal(rows, init):
                msg = f"embstore: inserted rows of table {t} differ from initial_values"
                raise VerificationError(msg)
        res2 = verify_peer(copy, batch, wl.grads, check_update=True)
    finally:
        copy.close()
    result["update_max_abs_err"] = res2["update_max_abs_err"]
    result["copy_forward_max_abs_err"] = res2["forward_max_abs_err"]
    return result


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


@dataclass
class Timing:
    """Per-batch wall times (seconds) of one peer on one ``(D, L, threads)`` case."""

    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    #: Cores other processes used, on average, while the batches were timed.
    others_cores: float | None = None

    @property
    def step(self) -> list[float]:
        """Forward plus backward of the same batch."""
        return [f + b for f, b in zip(self.forward, self.backward)]


def time_peer(
    peer: Peer,
    wl: Workload,
    warmup: int,
    progress: Callable[[str], None] | None = None,
) -> Timing:
    """Run ``warmup`` untimed steps, then time every remaining batch of the workload.

    The garbage collector is off inside the timed region. Forward and backward of one
    batch are timed separately with ``time.perf_counter``; nothing else runs in between.
    """
    for i, batch in enumerate(wl.batches[:warmup]):
        if progress:
            progress(f"(warm-up {i + 1}/{warmup})")
        peer.forward(batch)
        peer.backward(batch, wl.grads)
    timed = wl.batches[warmup:]
    timing = Timing()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    clock = time.perf_counter
    cpu0 = _cpu_clock()
    try:
        for i, batch in enumerate(timed):
            if progress:
                progress(f"{i + 1}/{len(timed)}")
            t0 = clock()
            peer.forward(batch)
            t1 = clock()
            peer.backward(batch, wl.grads)
            t2 = clock()
            timing.forward.append(t1 - t0)
            timing.backward.append(t2 - t1)
    finally:
        if was_enabled:
            gc.enable()
    timing.others_cores = _others_cores(cpu0)
    return timing


# --------------------------------------------------------------------------------------
# Configuration, report
# --------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """Sizes of a run. The defaults are the quick run (about a minute on 2 cores)."""

    num_tables: int = 8
    universe: int = 100_000
    batch_size: int = 2048
    dims: tuple[int, ...] = (32,)
    poolings: tuple[int, ...] = (1, 8)
    threads: tuple[int, ...] = (1, 2)
    batches: int = 30
    warmup: int = 5
    peers: tuple[str, ...] = ("embstore", "numpy", "torch", "pandas")
    seed: int = 0
    json_path: str | None = None
    progress: bool = True
    omp_wait_policy: str = "torch-default"

    @classmethod
    def full(cls) -> BenchConfig:
        """WORKLOADS.md W1 at full size: T=8, U=1e6, B=2048, D=32, L 1 and 8."""
        return cls(universe=1_000_000, batches=20, warmup=5)


@dataclass
class ResultRow:
    """One line of the result table."""

    peer: str
    label: str
    dim: int
    pooling: int
    threads: int
    measured_threads: int | None
    forward_ms: float
    backward_ms: float
    step_ms: float
    ids_per_s: float
    examples_per_s: float
    forward_gb_per_s: float
    timed_batches: int
    forward_ratio: float | None = None
    step_ratio: float | None = None
    others_cores: float | None = None
    forward_ms_all: list[float] = field(default_factory=list)
    backward_ms_all: list[float] = field(default_factory=list)


def _median_ms(xs: Sequence[float]) -> float:
    return float(np.median(np.asarray(xs))) * 1e3 if xs else float("nan")


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git checkout)"
    return rev + ("-dirty" if dirty else "") if rev else "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    if dist == "embstore":  # run from a source tree (PYTHONPATH=src): no dist metadata
        mod = sys.modules.get("embstore")
        version = getattr(mod, "__version__", None)
        if version is not None:
            return f"{version} (source tree)"
    return "not installed"


def settle_allocator() -> None:
    """Let glibc's malloc reach its steady state before anything is timed.

    glibc serves blocks above ``M_MMAP_THRESHOLD`` (128 KiB at start) with fresh ``mmap``
    pages, and raises that threshold only after such a block is freed. Until then every
    large temporary (a [B, D] output, a gathered [B * L, D] array) page-faults on first
    touch, which made whichever peer ran first up to 2x slower. Freeing one 24 MiB block
    raises the threshold (and the trim threshold) once for all peers, as a long-running
    trainer would have it.
    """
    block = np.ones(6 << 20, dtype=np.float32)  # 24 MiB: below glibc's 32 MiB cap
    del block


def _cpu_clock() -> tuple[float, float, float] | None:
    """(wall s, busy CPU-s of the whole machine, CPU-s of this process and its children)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return time.perf_counter(), busy, t.user + t.system + t.children_user + t.children_system


def _others_cores(start: tuple[float, float, float] | None) -> float | None:
    """Cores used by other processes since ``start``, on average (from /proc/stat)."""
    end = _cpu_clock()
    if start is None or end is None or end[0] <= start[0]:
        return None
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0]))


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def environment() -> dict[str, Any]:
    """Commit, CPU, cores and package versions for the report header."""
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "commit": _git_commit(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "pandas": _version("pandas"),
        "embstore": _version("embstore"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}f}"


def _fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def _fmt_rate(x: float) -> str:
    if not math.isfinite(x):
        return "n/a"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    return f"{x / 1e3:.1f} k"


def format_table(rows: Sequence[ResultRow]) -> str:
    """The markdown result table."""
    head = (
        "| peer | D | L | threads | fwd ms | bwd+upd ms | step ms | step ids/s "
        "| step examples/s | fwd vs embstore | step vs embstore | others |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        thr = f"{r.threads}" if r.measured_threads is not None else f"{r.threads}*"
        lines.append(
            f"| {r.label} | {r.dim} | {r.pooling} | {thr} | {_fmt(r.forward_ms)} "
            f"| {_fmt(r.backward_ms)} | {_fmt(r.step_ms)} | {_fmt_rate(r.ids_per_s)} "
            f"| {_fmt_rate(r.examples_per_s)} | {_fmt_ratio(r.forward_ratio)} "
            f"| {_fmt_ratio(r.step_ratio)} | {_fmt(r.others_cores)} |"
        )
    return "\n".join(lines)


class _Progress:
    """One self-overwriting status line on stderr (plain lines when not a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.prefix = ""
        self._width = 0

    def stage(self, prefix: str) -> None:
        self.prefix = prefix
        if self.enabled and not self.tty:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {prefix}", file=sys.stderr)
        self.update("")

    def update(self, msg: str) -> None:
        if not (self.enabled and self.tty):
            return
        line = f"[{time.perf_counter() - self.t0:6.1f}s] {self.prefix} {msg}".rstrip()
        pad = max(0, self._width - len(line))
        self._width = len(line)
        sys.stderr.write("\r" + line + " " * pad)
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.tty and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0


def _peer_plan(names: Sequence[str]) -> tuple[list[type[Peer]], dict[str, str]]:
    plan, skipped = [], {}
    for name in names:
        cls = PEERS.get(name)
        if cls is None:
            skipped[name] = f"skipped: unknown peer (known: {', '.join(PEERS)})"
            continue
        why = cls.unavailable()
        if why is not None:
            skipped[name] = why
            continue
        plan.append(cls)
    return plan, skipped


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Run the comparison described by ``cfg`` and return the report as a dict.

    Loop order: for each ``D``, each peer and each thread count (once for peers that are
    not threaded), the peer's tables are built and warmed once; then for each ``L`` the
    peer is verified on the first batch, warmed up and timed. Only one peer holds its
    tables at a time.
    """
    prog = _Progress(cfg.progress)
    settle_allocator()
    omp_policy = apply_omp_wait_policy(cfg.omp_wait_policy)
    plan, skipped = _peer_plan(cfg.peers)
    prog.stage(f"generating workload (T={cfg.num_tables}, U={cfg.universe})")
    tables = make_tables(cfg.num_tables, cfg.universe)
    n_batches = cfg.warmup + cfg.batches
    measured: dict[tuple[str, int, int, int | None], Timing] = {}
    verification: list[dict[str, Any]] = []
    extras: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    load_start = _loadavg()
    cpu_start = _cpu_clock()
    for dim in cfg.dims:
        if any(cls.name == "embstore" for cls in plan):
            prog.stage(f"embstore D={dim}: measuring memory in a fresh process")
            memory.append(probe_memory(cfg.num_tables, cfg.universe, dim, max(cfg.threads)))
        workloads = {
            lp: make_workload(
                num_tables=cfg.num_tables,
                universe=cfg.universe,
                batch_size=cfg.batch_size,
                pooling=lp,
                dim=dim,
                num_batches=n_batches,
                seed=cfg.seed,
                tables=tables,
            )
            for lp in cfg.poolings
        }
        for cls in plan:
            for threads in cfg.threads if cls.threaded else (None,):
                where = f"{cls.name} D={dim} threads={threads if threads else '-'}"
                prog.stage(f"{where}: building and warming {cfg.num_tables} tables")
                peer = cls(threads)
                try:
                    t_setup = time.perf_counter()
                    peer.setup(tables, dim)
                    info = peer.extra()
                    info.update(
                        peer=cls.name,
                        dim=dim,
                        threads=threads,
                        setup_s=time.perf_counter() - t_setup,
                    )
                    extras.append(info)
                    for lp, wl in workloads.items():
                        prog.stage(f"{where} L={lp}: verifying")
                        if isinstance(peer, EmbstorePeer):
                            res = verify_embstore(peer, wl, wl.batches[0], threads)
                        else:
                            res = verify_peer(peer, wl.batches[0], wl.grads)
                        verification.append(
                            {"peer": cls.name, "dim": dim, "pooling": lp, "threads": threads, **res}
                        )
                        prog.stage(f"{where} L={lp}: timing")
                        measured[(cls.name, dim, lp, threads)] = time_peer(
                            peer, wl, cfg.warmup, prog.update
                        )
                finally:
                    peer.close()
                    del peer
                    gc.collect()
        del workloads
    prog.done()
    rows = _result_rows(cfg, plan, measured)
    env = environment()
    env["loadavg_start"], env["loadavg_end"] = load_start, _loadavg()
    others = _others_cores(cpu_start)
    env["other_processes_cores"] = None if others is None else round(others, 2)
    env["omp_wait_policy"] = omp_policy
    return {
        "environment": env,
        "config": asdict(cfg),
        "results": [asdict(r) for r in rows],
        "table": format_table(rows),
        "memory": memory,
        "setup": extras,
        "verification": verification,
        "skipped": skipped,
    }


def _result_rows(
    cfg: BenchConfig,
    plan: Sequence[type[Peer]],
    measured: dict[tuple[str, int, int, int | None], Timing],
) -> list[ResultRow]:
    rows = []
    for dim in cfg.dims:
        for lp in cfg.poolings:
            for threads in cfg.threads:
                base = measured.get(("embstore", dim, lp, threads))
                base_f = _median_ms(base.forward) if base else None
                base_s = _median_ms(base.step) if base else None
                for cls in plan:
                    key_thr = threads if cls.threaded else None
                    tm = measured.get((cls.name, dim, lp, key_thr))
                    if tm is None:
                        continue
                    f, b, s = _median_ms(tm.forward), _median_ms(tm.backward), _median_ms(tm.step)
                    n_ids = cfg.num_tables * cfg.batch_size * lp
                    rows.append(
                        ResultRow(
                            peer=cls.name,
                            label=cls.label,
                            dim=dim,
                            pooling=lp,
                            threads=threads,
                            measured_threads=key_thr,
                            forward_ms=f,
                            backward_ms=b,
                            step_ms=s,
                            ids_per_s=n_ids / (s * 1e-3),
                            examples_per_s=cfg.batch_size / (s * 1e-3),
                            forward_gb_per_s=n_ids * dim * 4 / (f * 1e-3) / 1e9,
                            timed_batches=len(tm.forward),
                            forward_ratio=f / base_f if base_f else None,
                            step_ratio=s / base_s if base_s else None,
                            others_cores=tm.others_cores,
                            forward_ms_all=[x * 1e3 for x in tm.forward],
                            backward_ms_all=[x * 1e3 for x in tm.backward],
                        )
                    )
    return rows


def format_report(report: dict[str, Any]) -> str:
    """Header, result table, memory and verification lines as markdown."""
    env, cfg = report["environment"], report["config"]
    out = [
        "## embstore bench: WORKLOADS.md W1 (pooled training step, warm tables)",
        "",
        (
            f"- commit {env['commit']}, embstore {env['embstore']}, {env['date']}; other "
            f"processes used {_fmt(env.get('other_processes_cores'))} cores on average during "
            f"the run (load average {env.get('loadavg_start')} at start)"
        ),
        (
            f"- CPU {env['cpu']}, {env['cores']} cores ({env['cores_usable']} usable), "
            f"Python {env['python']}, numpy {env['numpy']}, torch {env['torch']} "
            f"(OMP_WAIT_POLICY={env.get('omp_wait_policy')}), pandas {env['pandas']}"
        ),
        (
            f"- T={cfg['num_tables']} tables, U={cfg['universe']:,} ids each (all inserted "
            f"before timing, in placement order), B={cfg['batch_size']}, Zipf alpha "
            f"{ZIPF_ALPHA}, Adagrad lr {LR} eps {EPS}, seed {cfg['seed']}"
        ),
        (
            f"- medians over {cfg['batches']} timed batches after {cfg['warmup']} untimed "
            "warm-up batch(es); step = forward + backward of the same batch; ratios are "
            "peer / embstore (> 1: embstore is faster); others = cores used by other "
            "processes while the row was timed (rows above ~0.2 are unreliable)"
        ),
        "",
        report["table"],
        "",
    ]
    if any(r["measured_threads"] is None for r in report["results"]):
        out.append(
            "\\* single-threaded peer (numpy/pandas ignore the thread setting): measured "
            "once per D and L, repeated in each thread group for the ratio."
        )
        out.append("")
    others = env.get("other_processes_cores")
    if others is not None and others > 0.2:
        out.append(
            f"- WARNING: other processes used {others:.2f} of the {env.get('cores')} cores on "
            "average during this run: figures are noisy, 2-thread figures most of all."
        )
        if "PASSIVE" not in str(env.get("omp_wait_policy")) and any(
            r["peer"] == "torch" and (r["threads"] or 1) > 1 for r in report["results"]
        ):
            out.append(
                "  torch's multi-threaded rows are unreliable under contention (its OpenMP "
                "workers wait actively); rerun on a quiet machine, or with "
                "--omp-wait-policy passive (slower for torch on a quiet machine)."
            )
    for name, why in report["skipped"].items():
        out.append(f"- {name}: {why}")
    for m in report["memory"]:
        if "error" in m:
            out.append(f"- embstore memory, D={m['dim']}: {m['error']}")
            continue
        rss = m.get("rss_bytes_per_row")
        payload = m["payload_bytes_per_row"]
        overhead = f"{(rss / payload - 1) * 100:+.0f}%" if rss else "n/a"
        created = m.get("rss_created_bytes")
        out.append(
            f"- embstore memory, D={m['dim']} (fresh process): {m['rows']:,} rows, RSS "
            f"+{_fmt((m.get('rss_delta_bytes') or 0) / 2**20, 1)} MiB = {_fmt(rss, 1)} "
            f"bytes/row (of which {_fmt((created or 0) / 2**20, 1)} MiB at creation); "
            f"stats()['bytes_per_row'] = {_fmt(m.get('stats_bytes_per_row'), 1)}; "
            f"id + weights + accumulators = {payload} bytes/row, RSS overhead {overhead}"
        )
    for m in report["setup"]:
        if m.get("peer") == "embstore":
            out.append(
                f"- embstore build + warm-up, D={m['dim']} threads={m['threads']}: "
                f"{m['setup_s']:.1f} s for {m.get('rows', 0):,} rows"
                f" ({m.get('num_shards')} shards per table)"
            )
            if "warning" in m:
                out.append(f"  - WARNING: {m['warning']}")
    errs = report["verification"]
    if errs:
        fe = max(v["forward_max_abs_err"] for v in errs)
        ue = max(v.get("update_max_abs_err", 0.0) for v in errs)
        out.append(
            f"- verified before timing: {len(errs)} (peer, D, L, threads) cases, forward "
            f"max abs err {fe:.2g}, Adagrad step max abs err {ue:.2g} vs numpy"
        )
        exact = [v for v in errs if v["peer"] == "embstore"]
        if exact:
            out.append(
                "- embstore vs numpy: forward max abs err "
                f"{max(v['forward_max_abs_err'] for v in exact):.2g}, Adagrad step max abs err "
                f"{max(v['update_max_abs_err'] for v in exact):.2g}"
            )
    return "\n".join(out)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not vals or min(vals) <= 0:
        msg = f"expected positive integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return vals


def _positive_int(text: str) -> int:
    return _int_list(text)[0]


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser(prog: str = "python -m embstore bench") -> argparse.ArgumentParser:
    """The ``bench`` argument parser."""
    quick, full = BenchConfig(), BenchConfig.full()
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Run WORKLOADS.md W1 (pooled training step on warm tables) for embstore and its "
            "peers, verify every peer against numpy, and print one markdown table. The "
            f"default is a quick run (U={quick.universe:,}, {quick.batches} timed batches); "
            f"--full is the canonical size (U={full.universe:,}, {full.batches} timed batches)."
        ),
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="canonical W1 sizes (T=8, U=1,000,000, B=2048, D=32, L=1,8, "
        "threads 1,2, 20 timed batches); other flags override",
    )
    p.add_argument("--tables", type=_positive_int, metavar="T", help="tables (default 8)")
    p.add_argument(
        "--universe",
        type=_positive_int,
        metavar="U",
        help=f"ids per table, all inserted before timing (default {quick.universe:,})",
    )
    p.add_argument("--batch", type=_positive_int, metavar="B", help="examples per batch (2048)")
    p.add_argument("--dim", type=_int_list, metavar="D[,D...]", help="embedding dims (32)")
    p.add_argument(
        "--pooling", type=_int_list, metavar="L[,L...]", help="ids per example per table (1,8)"
    )
    p.add_argument(
        "--threads",
        type=_int_list,
        metavar="N[,N...]",
        help="thread counts of embstore and torch (1,2)",
    )
    p.add_argument(
        "--batches",
        type=_positive_int,
        metavar="N",
        help=f"timed batches per case (default {quick.batches}, --full {full.batches})",
    )
    p.add_argument(
        "--warmup",
        type=int,
        metavar="N",
        help=f"untimed steps before timing (default {quick.warmup})",
    )
    p.add_argument(
        "--peers",
        type=_str_list,
        metavar="NAME[,NAME...]",
        help=f"peers to run, from: {', '.join(PEERS)} (default: all)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    p.add_argument("--seed", type=int, help="seed of the key stream and gradients (0)")
    p.add_argument(
        "--omp-wait-policy",
        choices=("torch-default", "active", "passive"),
        help="OMP_WAIT_POLICY for torch's workers (default: leave it to torch; 'passive' "
        "keeps torch's 2-thread figures sane when other processes load the machine)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A :class:`BenchConfig` from parsed flags (``--full`` first, then explicit flags)."""
    cfg = BenchConfig.full() if args.full else BenchConfig()
    overrides: dict[str, Any] = {
        "num_tables": args.tables,
        "universe": args.universe,
        "batch_size": args.batch,
        "dims": args.dim,
        "poolings": args.pooling,
        "threads": args.threads,
        "batches": args.batches,
        "warmup": args.warmup,
        "peers": args.peers,
        "seed": args.seed,
        "json_path": args.json,
        "omp_wait_policy": args.omp_wait_policy,
    }
    for k, v in overrides.items():
        if v is not None:
            setattr(cfg, k, v)
    cfg.progress = not args.no_progress
    if cfg.warmup < 0:
        msg = "--warmup must be >= 0"
        raise ValueError(msg)
    placement(cfg.universe)  # fail early on a universe that breaks the placement order
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m embstore bench`` and ``bench/run.py``.

    Returns
    -------
    int
        0 on success, 1 if a peer failed verification, 2 on bad arguments.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        report = run(cfg)
    except VerificationError as exc:
        print(f"verification failed: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"\nJSON report written to {cfg.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
