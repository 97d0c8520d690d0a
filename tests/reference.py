"""Plain numpy/dict model of an embstore table: the oracle for the other tests.

Implements docs/semantics.md line by line, favouring obviousness over speed: every
occurrence of a key is processed in caller order, float32 arithmetic follows the
operation order the spec gives, and CLOCK eviction is modelled exactly for one shard
(one ring of ``capacity`` rows in allocation order).

Readings of the spec where it leaves room (each one is flagged by a test if the core
disagrees):

* Counters: every *occurrence* of a key in a lookup counts one hit or one miss, judged
  at the moment it is processed, so a missing key repeated in one ``insert=True`` batch
  counts one miss (+ one insert) and then hits.
* ``apply_gradients`` counts inserts and evictions but neither hits nor misses.
* ``apply_gradients`` inserts its missing ids in order of first occurrence; every id of
  the call (present or newly inserted) is pinned for the whole call; after the update
  every updated row has its reference bit set.
* ``TruncatedNormal`` redraws each element on its own (element ``j`` keeps the first
  attempt whose own ``z`` satisfies ``|z| <= 2``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = np.float32
U64Array = npt.NDArray[np.uint64]
F32Array = npt.NDArray[np.float32]

M64 = 2**64
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_TWO_POW_M53 = 2.0**-53
_ATTEMPT_STRIDE = 2**32


# --------------------------------------------------------------------------------------
# Configuration specs (independent of the embstore package)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SGDSpec:
    """``SGD(lr)``."""

    lr: float


@dataclass(frozen=True)
class AdagradSpec:
    """``Adagrad(lr, eps, initial_accumulator)``."""

    lr: float
    eps: float = 1e-8
    initial_accumulator: float = 0.0


@dataclass(frozen=True)
class ZerosSpec:
    """``Zeros()``."""


@dataclass(frozen=True)
class UniformSpec:
    """``Uniform(low, high, seed)``."""

    low: float
    high: float
    seed: int = 0


@dataclass(frozen=True)
class NormalSpec:
    """``Normal(mean, std, seed)``."""

    std: float
    seed: int = 0
    mean: float = 0.0


@dataclass(frozen=True)
class TruncatedNormalSpec:
    """``TruncatedNormal(mean, std, seed)``."""

    std: float
    seed: int = 0
    mean: float = 0.0


OptSpec = SGDSpec | AdagradSpec
InitSpec = ZerosSpec | UniformSpec | NormalSpec | TruncatedNormalSpec


class ReferenceCapacityError(RuntimeError):
    """The reference table is full and ``eviction="none"``."""


# --------------------------------------------------------------------------------------
# Ids and initializers
# --------------------------------------------------------------------------------------


def as_ids(keys: object) -> U64Array:
    """Normalises keys as the spec says: integers widened, then reinterpreted as uint64."""
    arr = np.asarray(keys)
    if arr.dtype.kind == "u":
        return arr.astype(np.uint64).reshape(-1)
    if arr.dtype.kind == "i":
        return arr.astype(np.int64).view(np.uint64).reshape(-1)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    msg = f"keys must be integers, got {arr.dtype}"
    raise TypeError(msg)


def splitmix64_int(x: int) -> int:
    """splitmix64 on a Python int, literally as docs/semantics.md writes it."""
    x = (x + 0x9E3779B97F4A7C15) % M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % M64
    return z ^ (z >> 31)


def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Vectorised splitmix64 (uint64 arithmetic wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
        return z ^ (z >> np.uint64(31))


def row_seeds(seed: int, ids: U64Array) -> U64Array:
    """``row_seed(id) = splitmix64(id ^ splitmix64(seed % M))``."""
    s = np.uint64(splitmix64_int(seed % M64))
    return splitmix64(np.asarray(ids, dtype=np.uint64) ^ s)


def unit(rs: U64Array, j: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
    """``u(id, j)`` for row seeds ``rs`` [n] and stream positions ``j`` [dim] -> [n, dim]."""
    with np.errstate(over="ignore"):
        x = rs[:, None] + j[None, :]
    return (splitmix64(x) >> np.uint64(11)).astype(np.float64) * _TWO_POW_M53


def _gaussian(rs: U64Array, dim: int, attempt: int) -> npt.NDArray[np.float64]:
    j = np.arange(dim, dtype=np.uint64)
    p2 = (j // np.uint64(2)) * np.uint64(2)
    base = np.uint64((attempt * _ATTEMPT_STRIDE) % M64)
    with np.errstate(over="ignore"):
        u1 = 1.0 - unit(rs, p2 + base)
        u2 = unit(rs, p2 + np.uint64(1) + base)
    r = np.sqrt(-2.0 * np.log(u1))
    angle = (2.0 * math.pi) * u2
    even = (np.arange(dim) % 2 == 0)[None, :]
    return np.where(even, r * np.cos(angle), r * np.sin(angle))


def initial_rows(init: InitSpec, keys: object, dim: int) -> F32Array:
    """The initializer's rows for ``keys`` -> float32 [n, dim]."""
    ids = as_ids(keys)
    n = ids.shape[0]
    if isinstance(init, ZerosSpec):
        return np.zeros((n, dim), dtype=F32)
    rs = row_seeds(init.seed, ids)
    if isinstance(init, UniformSpec):
        u = unit(rs, np.arange(dim, dtype=np.uint64))
        return (init.low + (init.high - init.low) * u).astype(F32)
    z = _gaussian(rs, dim, 0)
    if isinstance(init, TruncatedNormalSpec):
        attempt = 0
        bad = np.abs(z) > 2.0
        while bad.any():
            attempt += 1
            z2 = _gaussian(rs, dim, attempt)
            z = np.where(bad, z2, z)
            bad = np.abs(z) > 2.0
    return (init.mean + init.std * z).astype(F32)


# --------------------------------------------------------------------------------------
# Pooling and gradient expansion (pure functions)
# --------------------------------------------------------------------------------------


def _check_mode(mode: str) -> None:
    if mode not in ("sum", "mean"):
        msg = f"mode must be 'sum' or 'mean', got {mode!r}"
        raise ValueError(msg)


def pool(
    rows: F32Array,
    offsets: Sequence[int] | npt.NDArray[np.integer],
    weights: npt.ArrayLike | None = None,
    mode: str = "sum",
) -> F32Array:
    """Pooled sum of ``rows`` per bag, in order from zero (docs: lookup_sum)."""
    _check_mode(mode)
    off = np.asarray(offsets, dtype=np.int64)
    bags = off.shape[0] - 1
    dim = rows.shape[1]
    out = np.zeros((bags, dim), dtype=F32)
    w = None if weights is None else np.asarray(weights, dtype=F32)
    for b in range(bags):
        s = np.zeros(dim, dtype=F32)
        for i in range(int(off[b]), int(off[b + 1])):
            s = s + rows[i] if w is None else s + w[i] * rows[i]
        count = int(off[b + 1] - off[b])
        if mode == "mean" and count > 0:
            s = s / F32(count)
        out[b] = s
    return out


def per_id_grads(
    n: int,
    grads: npt.ArrayLike,
    offsets: Sequence[int] | npt.NDArray[np.integer] | None,
    weights: npt.ArrayLike | None,
    mode: str,
) -> F32Array:
    """Expands apply_gradients inputs to one float32 gradient per key occurrence."""
    _check_mode(mode)
    g = np.asarray(grads, dtype=F32)
    if offsets is None:
        return g.reshape(n, g.shape[-1] if g.ndim == 2 else -1).copy()
    off = np.asarray(offsets, dtype=np.int64)
    w = None if weights is None else np.asarray(weights, dtype=F32)
    out = np.zeros((n, g.shape[1]), dtype=F32)
    for b in range(off.shape[0] - 1):
        count = int(off[b + 1] - off[b])
        for i in range(int(off[b]), int(off[b + 1])):
            if w is None and mode == "sum":
                out[i] = g[b]
                continue
            c = F32(1.0) if w is None else F32(w[i])
            if mode == "mean":
                c = F32(c / F32(count))
            out[i] = c * g[b]
    return out


# --------------------------------------------------------------------------------------
# The table model
# --------------------------------------------------------------------------------------


class ReferenceTable:
    """Dict-based model of ``embstore.Table`` with exact single-ring CLOCK eviction.

    With ``eviction="clock"`` the model is exact only for ``num_shards=1`` (or when the
    table never fills); with ``eviction="none"`` the capacity check is exact for one shard.
    """

    def __init__(
        self,
        dim: int,
        capacity: int,
        optimizer: OptSpec,
        initializer: InitSpec,
        eviction: str = "clock",
    ) -> None:
        self.dim = dim
        self.capacity = capacity
        self.optimizer = optimizer
        self.initializer = initializer
        self.eviction = eviction
        self.weights: dict[int, F32Array] = {}
        self.accum: dict[int, F32Array] = {}
        self.slot_of: dict[int, int] = {}
        self.slot_key: dict[int, int] = {}
        self.ref: dict[int, bool] = {}
        self.free: list[int] = []  # LIFO stack of erased slots
        self.bump = 0  # slots [0, bump) have been allocated at least once
        self.hand = 0
        self.hits = 0
        self.misses = 0
        self.inserts = 0
        self.evictions = 0
        self.erased = 0

    # ---- introspection ------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.weights)

    def stats(self) -> dict[str, int]:
        """The counters the store's ``stats()`` must report."""
        return {
            "size": len(self),
            "capacity": self.capacity,
            "dim": self.dim,
            "hits": self.hits,
            "misses": self.misses,
            "inserts": self.inserts,
            "evictions": self.evictions,
            "erased": self.erased,
        }

    def keys(self) -> list[int]:
        """Present ids, in ring (slot) order."""
        return [self.slot_key[s] for s in sorted(self.slot_key)]

    def peek(self, key: int) -> F32Array | None:
        """The stored row of ``key`` (no side effects), or None when absent."""
        row = self.weights.get(int(key) % M64)
        return None if row is None else row.copy()

    def ring(self) -> list[tuple[int, int, bool]]:
        """(slot, id, reference bit) of every occupied slot, for debugging messages."""
        return [(s, self.slot_key[s], self.ref[s]) for s in sorted(self.slot_key)]

    def initial_values(self, keys: object) -> F32Array:
        """The initializer rows of ``keys``."""
        return initial_rows(self.initializer, keys, self.dim)

    # ---- allocation -----------------------------------------------------------------
    def _insert(self, key: int, row: F32Array, pinned: set[int]) -> None:
        if self.free:
            slot = self.free.pop()
        elif self.bump < self.capacity:
            slot = self.bump
            self.bump += 1
        elif self.eviction == "none":
            msg = "table full"
            raise ReferenceCapacityError(msg)
        else:
            slot = self._clock_victim(pinned)
            victim = self.slot_key.pop(slot)
            del self.slot_of[victim]
            del self.weights[victim]
            self.accum.pop(victim, None)
            self.evictions += 1
        self.slot_key[slot] = key
        self.slot_of[key] = slot
        self.ref[slot] = True
        self.weights[key] = row.copy()
        if isinstance(self.optimizer, AdagradSpec):
            self.accum[key] = np.full(self.dim, F32(self.optimizer.initial_accumulator), F32)
        self.inserts += 1

    def _clock_victim(self, pinned: set[int]) -> int:
        for _ in range(2 * self.capacity + 1):
            slot = self.hand
            self.hand = (self.hand + 1) % self.capacity
            if self.slot_key[slot] in pinned:
                continue
            if self.ref[slot]:
                self.ref[slot] = False
                continue
            return slot
        msg = "every row is pinned"
        raise ReferenceCapacityError(msg)

    # ---- operations -----------------------------------------------------------------
    def lookup(self, keys: object, insert: bool = True) -> F32Array:
        """``Table.lookup``: rows of ``keys`` (occurrences processed in order)."""
        arr = as_ids(keys)
        ids = arr.tolist()
        out = np.zeros((len(ids), self.dim), dtype=F32)
        inits = self.initial_values(arr) if insert else out
        for i, k in enumerate(ids):
            slot = self.slot_of.get(k)
            if slot is not None:
                self.hits += 1
                self.ref[slot] = True
                out[i] = self.weights[k]
                continue
            self.misses += 1
            if insert:
                self._insert(k, inits[i], set())
                out[i] = self.weights[k]
        return out

    def lookup_sum(
        self,
        keys: object,
        offsets: Sequence[int] | npt.NDArray[np.integer],
        weights: npt.ArrayLike | None = None,
        mode: str = "sum",
        insert: bool = True,
    ) -> F32Array:
        """``Table.lookup_sum``: rows fetched as by ``lookup``, then pooled per bag."""
        _check_mode(mode)
        rows = self.lookup(keys, insert=insert)
        return pool(rows, offsets, weights, mode)

    def apply_gradients(
        self,
        keys: object,
        grads: npt.ArrayLike,
        offsets: Sequence[int] | npt.NDArray[np.integer] | None = None,
        weights: npt.ArrayLike | None = None,
        mode: str = "sum",
    ) -> None:
        """``Table.apply_gradients``: sum per distinct id in order, then one update each."""
        if offsets is None and (weights is not None or mode != "sum"):
            msg = "weights and mode need offsets"
            raise ValueError(msg)
        arr = as_ids(keys)
        ids = arr.tolist()
        if weights is not None and not np.all(np.isfinite(np.asarray(weights, F32))):
            msg = "weights must be finite"
            raise ValueError(msg)
        if not np.all(np.isfinite(np.asarray(grads, F32))):
            msg = "grads must be finite"
            raise ValueError(msg)
        g = per_id_grads(len(ids), grads, offsets, weights, mode)
        summed: dict[int, F32Array] = {}
        for i, k in enumerate(ids):
            acc = summed.get(k)
            if acc is None:
                acc = np.zeros(self.dim, dtype=F32)
            summed[k] = acc + g[i]
        pinned = set(summed)
        missing = [k for k in summed if k not in self.slot_of]  # first-occurrence order
        inits = self.initial_values(np.array(missing, dtype=np.uint64))
        for k, row in zip(missing, inits):
            self._insert(k, row, pinned)
        for k, gk in summed.items():
            self._update(k, gk)
            self.ref[self.slot_of[k]] = True

    def _update(self, key: int, g: F32Array) -> None:
        w = self.weights[key]
        opt = self.optimizer
        if isinstance(opt, SGDSpec):
            self.weights[key] = w - F32(opt.lr) * g
        else:
            acc = self.accum[key] + g * g
            self.accum[key] = acc
            root: F32Array = np.sqrt(acc)  # float32 in, float32 out (correctly rounded)
            self.weights[key] = w - (F32(opt.lr) * g) / (root + F32(opt.eps))

    def contains(self, keys: object) -> npt.NDArray[np.bool_]:
        """``Table.contains``: no side effects."""
        return np.array([k in self.slot_of for k in as_ids(keys).tolist()], dtype=bool)

    def erase(self, keys: object) -> int:
        """``Table.erase``: frees rows (pushed on the LIFO free list), returns rows removed."""
        removed = 0
        for k in as_ids(keys).tolist():
            slot = self.slot_of.pop(k, None)
            if slot is None:
                continue
            del self.slot_key[slot]
            del self.weights[k]
            self.accum.pop(k, None)
            self.ref[slot] = False
            self.free.append(slot)
            removed += 1
        self.erased += removed
        return removed
