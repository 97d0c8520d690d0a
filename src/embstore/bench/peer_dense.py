"""Hand-rolled numpy stores: the dense floor (precomputed rows) and a pandas-hashed store."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from embstore.bench.peers import Peer, register_peer
from embstore.bench.workload import EPS, LR, Batch, F32Array, I64Array, TableData, U64Array


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
            for w, r in zip(self._w, batch.rows, strict=True)
        ]

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        for w, a, r, g in zip(self._w, self._acc, batch.rows, grads, strict=True):
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

    @classmethod
    def memory_bytes(cls, tables: Sequence[TableData], dim: int) -> int:
        # Dense rows, plus the index's values and its hash table (~5 words an id).
        return sum(tab.universe for tab in tables) * (8 * dim + 40)

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
        for t, (keys, g) in enumerate(zip(batch.keys, grads, strict=True)):
            _dense_adagrad(self._w[t], self._acc[t], self._rows(t, keys), g, batch.pooling)

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        r = self._rows(table, batch.keys[table])
        return self._w[table][r], self._acc[table][r]

    def close(self) -> None:
        self._index.clear()
        self._w.clear()
        self._acc.clear()
