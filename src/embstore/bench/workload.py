"""W1's key stream: ids, placement order, Zipf batches and fixed gradients (bench/README.md).

Everything here runs before anything is timed, and depends on numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]
F32Array = npt.NDArray[np.float32]

#: Zipf exponent of the key stream.
ZIPF_ALPHA = 1.05
#: Multiplier of the placement order: rank ``r`` sits at position ``r * 618033 mod U``.
PLACEMENT_MULTIPLIER = 618033
#: W1's optimizer: Adagrad, element-wise, initial accumulator 0.
LR = 0.01
EPS = 1e-8
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


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
        The dense row of rank ``r`` and its position in the warm-up order: W1's
        ``r * 618033 mod U``, W5's fixed random permutation (:mod:`embstore.bench.w5`).
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
        ``T``, ``U``, ``B``, ``L`` and ``D`` of W1.
    num_batches : int
        Batches to generate (warm-up plus timed).
    seed : int
        Seed of the key stream and the gradients. Ranks of a batch are drawn, table by
        table, from ``np.random.default_rng([seed, L])``; the gradients, one fixed
        standard-normal ``[B, D]`` array per table, from ``default_rng([seed, D, 2])``.
    alpha : float
        Zipf exponent.
    tables : list of TableData, optional
        Reuse tables made by :func:`make_tables` for the same ``T`` and ``U``, or W5's
        (:func:`embstore.bench.w5.make_w5_tables`): each table's ranks are drawn over its
        own universe (``universe`` is then unused).

    Returns
    -------
    Workload
    """
    if tables is None:
        tables = make_tables(num_tables, universe)
    cdfs: dict[int, npt.NDArray[np.float64]] = {}
    for tab in tables:
        if tab.universe not in cdfs:
            cdfs[tab.universe] = zipf_cdf(tab.universe, alpha)
    n = batch_size * pooling
    offsets = np.arange(0, n + 1, pooling, dtype=np.int64)
    rng = np.random.default_rng([seed, pooling])
    batches = []
    for _ in range(num_batches):
        keys, rows = [], []
        for tab in tables:
            ranks = np.searchsorted(cdfs[tab.universe], rng.random(n))
            keys.append(tab.ids[ranks])
            rows.append(tab.row[ranks])
        batches.append(Batch(batch_size, pooling, keys, rows, offsets))
    grng = np.random.default_rng([seed, dim, 2])
    grads = [grng.standard_normal((batch_size, dim), dtype=np.float32) for _ in tables]
    return Workload(num_tables, universe, batch_size, pooling, dim, seed, tables, batches, grads)
