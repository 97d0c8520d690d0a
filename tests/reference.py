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
* Optimizer state belongs to the row: a row inserted by ``lookup`` or ``apply_gradients``
  (also after an eviction or erase) starts with fresh state (Adam: ``m = v = 0``, ``t = 0``).
  Adam's ``t`` counts the calls that updated the row (duplicates of one call are one update).
* Every hyper-parameter is rounded to float32 first; Adam's ``float64(beta)`` is the float32
  beta widened (not the Python double the caller passed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

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
    """``SGD(lr, momentum)``."""

    lr: float
    momentum: float = 0.0


@dataclass(frozen=True)
class AdagradSpec:
    """``Adagrad(lr, eps, initial_accumulator)``."""

    lr: float
    eps: float = 1e-8
    initial_accumulator: float = 0.0


@dataclass(frozen=True)
class RowWiseAdagradSpec:
    """``RowWiseAdagrad(lr, eps, initial_accumulator)``: one accumulator per row."""

    lr: float
    eps: float = 1e-8
    initial_accumulator: float = 0.0


@dataclass(frozen=True)
class AdamSpec:
    """``Adam(lr, beta1, beta2, eps, weight_decay)``."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True)
class FTRLSpec:
    """``FTRL(alpha, beta, l1, l2)``: FTRL-Proximal, ``alpha`` is the learning rate."""

    alpha: float
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0


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


OptSpec = SGDSpec | AdagradSpec | RowWiseAdagradSpec | AdamSpec | FTRLSpec
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
# Optimizers (docs/semantics.md, "Optimizers"): one update of one row
# --------------------------------------------------------------------------------------


def _empty() -> F32Array:
    return np.zeros(0, dtype=F32)


@dataclass
class RowState:
    """A row's optimizer state; only the fields its optimizer uses are filled."""

    acc: F32Array = field(default_factory=_empty)  # Adagrad [dim], RowWiseAdagrad [1]
    buf: F32Array = field(default_factory=_empty)  # SGD momentum [dim]
    m: F32Array = field(default_factory=_empty)  # Adam [dim]
    v: F32Array = field(default_factory=_empty)  # Adam [dim]
    t: int = 0  # Adam: updates applied to this row
    z: F32Array = field(default_factory=_empty)  # FTRL [dim]
    n: F32Array = field(default_factory=_empty)  # FTRL [dim]


def learning_rate(spec: OptSpec) -> float:
    """The spec's learning rate (``alpha`` for FTRL)."""
    return spec.alpha if isinstance(spec, FTRLSpec) else spec.lr


def with_learning_rate(spec: OptSpec, lr: float) -> OptSpec:
    """The spec with its learning rate (``alpha`` for FTRL) replaced, as ``set_lr`` does."""
    if not math.isfinite(lr) or lr <= 0.0:
        msg = f"lr must be a positive finite number, got {lr!r}"
        raise ValueError(msg)
    if isinstance(spec, FTRLSpec):
        return replace(spec, alpha=lr)
    return replace(spec, lr=lr)


def state_width(spec: OptSpec, dim: int) -> int:
    """Floats of optimizer state per row."""
    if isinstance(spec, SGDSpec):
        return dim if spec.momentum > 0.0 else 0
    if isinstance(spec, AdagradSpec):
        return dim
    if isinstance(spec, RowWiseAdagradSpec):
        return 1
    if isinstance(spec, AdamSpec):
        return 2 * dim + 1
    return 2 * dim


def row_stride(spec: OptSpec, dim: int) -> int:
    """Floats per row in the arena: weights + state, rounded up to a multiple of 4."""
    return (dim + state_width(spec, dim) + 3) // 4 * 4


def fresh_state(spec: OptSpec, dim: int) -> RowState:
    """The state of a newly inserted row."""
    if isinstance(spec, SGDSpec):
        return RowState(buf=np.zeros(dim, F32)) if spec.momentum > 0.0 else RowState()
    if isinstance(spec, AdagradSpec):
        return RowState(acc=np.full(dim, F32(spec.initial_accumulator), F32))
    if isinstance(spec, RowWiseAdagradSpec):
        return RowState(acc=np.full(1, F32(spec.initial_accumulator), F32))
    if isinstance(spec, AdamSpec):
        return RowState(m=np.zeros(dim, F32), v=np.zeros(dim, F32))
    return RowState(z=np.zeros(dim, F32), n=np.zeros(dim, F32))


def optimizer_step(spec: OptSpec, w: F32Array, state: RowState, g: F32Array) -> F32Array:
    """One update of row ``w`` with the summed gradient ``g``: returns the new row and
    updates ``state`` in place. Every operand is float32 (scalars are ``np.float32``), so
    numpy rounds each operation to float32 exactly as the FMA-free core does."""
    w = np.asarray(w, F32)
    g = np.asarray(g, F32)
    out = _step(spec, w, state, g)
    for arr in (out, state.acc, state.buf, state.m, state.v, state.z, state.n):
        assert arr.dtype == F32, arr.dtype  # no silent float64 promotion
    return out


def _step(spec: OptSpec, w: F32Array, state: RowState, g: F32Array) -> F32Array:
    if isinstance(spec, SGDSpec):
        lr = F32(spec.lr)
        if spec.momentum > 0.0:
            state.buf = F32(spec.momentum) * state.buf + g
            return w - lr * state.buf
        return w - lr * g
    if isinstance(spec, AdagradSpec):
        acc = state.acc + g * g
        state.acc = acc
        root: F32Array = np.sqrt(acc)  # float32 in, float32 out (correctly rounded)
        return w - (F32(spec.lr) * g) / (root + F32(spec.eps))
    if isinstance(spec, RowWiseAdagradSpec):
        return _rowwise_adagrad_step(spec, w, state, g)
    if isinstance(spec, AdamSpec):
        return _adam_step(spec, w, state, g)
    return _ftrl_step(spec, w, state, g)


def _rowwise_adagrad_step(
    spec: RowWiseAdagradSpec, w: F32Array, state: RowState, g: F32Array
) -> F32Array:
    s = F32(0.0)
    for gj in g.tolist():  # sequential, in order (not numpy's pairwise sum)
        x = F32(gj)
        s = F32(s + F32(x * x))
    acc = F32(state.acc[0] + F32(s / F32(g.shape[0])))
    state.acc = np.full(1, acc, F32)
    d = F32(np.sqrt(acc) + F32(spec.eps))
    return w - (F32(spec.lr) * g) / d


def _adam_step(spec: AdamSpec, w: F32Array, state: RowState, g: F32Array) -> F32Array:
    lr, b1, b2, eps = F32(spec.lr), F32(spec.beta1), F32(spec.beta2), F32(spec.eps)
    wd = F32(spec.weight_decay)
    state.t += 1
    if wd != 0.0:
        w = w - F32(lr * wd) * w
    one = F32(1.0)
    state.m = b1 * state.m + F32(one - b1) * g
    state.v = b2 * state.v + (F32(one - b2) * g) * g
    # The power in float64 of the float32 beta, 1 - power in float64, rounded once.
    bc1 = F32(1.0 - float(b1) ** state.t)
    bc2 = F32(1.0 - float(b2) ** state.t)
    root: F32Array = np.sqrt(state.v / bc2)
    return w - (lr * (state.m / bc1)) / (root + eps)


def _ftrl_step(spec: FTRLSpec, w: F32Array, state: RowState, g: F32Array) -> F32Array:
    alpha, beta, l1, l2 = F32(spec.alpha), F32(spec.beta), F32(spec.l1), F32(spec.l2)
    n = state.n
    n2 = n + g * g
    root_n2: F32Array = np.sqrt(n2)
    root_n: F32Array = np.sqrt(n)
    sigma: F32Array = (root_n2 - root_n) / alpha
    z: F32Array = (state.z + g) - sigma * w
    state.z = z
    state.n = n2
    with np.errstate(divide="ignore", invalid="ignore"):  # the discarded branch may be 0/0
        shrunk = -(z - np.sign(z) * l1) / ((beta + root_n2) / alpha + l2)
    out: F32Array = np.where(np.abs(z) <= l1, F32(0.0), shrunk).astype(F32)
    return out


# --------------------------------------------------------------------------------------
# The table model
# --------------------------------------------------------------------------------------


class ReferenceTable:
    """Dict-based model of ``embstore.Table`` with exact single-ring CLOCK eviction.

    With ``eviction="clock"`` the model is exact only for ``num_shards=1`` (or when the
    table never fills); with ``eviction="none"`` the capacity check is exact for one shard.
    ``min_count`` models an admission filter with exact counts (a ``CountFilter`` whose
    sketch is wide enough to have no collisions for the ids used).
    """

    def __init__(
        self,
        dim: int,
        capacity: int,
        optimizer: OptSpec,
        initializer: InitSpec,
        eviction: str = "clock",
        min_count: int = 1,
    ) -> None:
        self.dim = dim
        self.capacity = capacity
        self.optimizer = optimizer
        self.initializer = initializer
        self.eviction = eviction
        self.weights: dict[int, F32Array] = {}
        self.state: dict[int, RowState] = {}
        self.slot_of: dict[int, int] = {}
        self.slot_key: dict[int, int] = {}
        self.ref: dict[int, bool] = {}  # CLOCK reference bit, by slot
        self.read_mark: dict[int, bool] = {}  # mark of a lookup that cannot insert, by slot
        self.free: list[int] = []  # LIFO stack of erased slots
        self.bump = 0  # slots [0, bump) have been allocated at least once
        self.hand = 0
        self.hits = 0
        self.misses = 0
        self.inserts = 0
        self.evictions = 0
        self.erased = 0
        self.step = 0
        self.last_step: dict[int, int] = {}
        self.min_count = min_count
        self.seen: dict[int, int] = {}  # sightings of ids without a row (admission)
        self.rejected = 0
        self.evicted_log: list[tuple[int, F32Array]] = []  # rows CLOCK evicted, in order

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
            "admitted": self.inserts if self.min_count > 1 else 0,
            "rejected": self.rejected,
        }

    def keys(self) -> list[int]:
        """Present ids, in ring (slot) order."""
        return [self.slot_key[s] for s in sorted(self.slot_key)]

    def peek(self, key: int) -> F32Array | None:
        """The stored row of ``key`` (no side effects), or None when absent."""
        row = self.weights.get(int(key) % M64)
        return None if row is None else row.copy()

    def ring(self) -> list[tuple[int, int, bool, bool]]:
        """(slot, id, reference bit, read mark) of every occupied slot, for debugging."""
        return [
            (s, self.slot_key[s], self.ref[s], self.read_mark[s]) for s in sorted(self.slot_key)
        ]

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
            self.evicted_log.append((victim, self.weights.pop(victim)))
            del self.state[victim]
            del self.last_step[victim]
            self.evictions += 1
        self.slot_key[slot] = key
        self.slot_of[key] = slot
        self.ref[slot] = True
        self.read_mark[slot] = False
        self.weights[key] = row.copy()
        self.state[key] = fresh_state(self.optimizer, self.dim)
        self.last_step[key] = self.step
        self.inserts += 1

    def _clock_victim(self, pinned: set[int]) -> int:
        for _ in range(3 * self.capacity + 1):
            slot = self.hand
            self.hand = (self.hand + 1) % self.capacity
            if self.slot_key[slot] in pinned:
                continue
            if self.ref[slot]:  # the bit first, the read mark the next time round
                self.ref[slot] = False
                continue
            if self.read_mark[slot]:
                self.read_mark[slot] = False
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
                if insert:
                    self.ref[slot] = True
                else:
                    self.read_mark[slot] = True
                self.last_step[k] = self.step
                out[i] = self.weights[k]
                continue
            self.misses += 1
            if insert and self.min_count > 1:
                self.seen[k] = self.seen.get(k, 0) + 1
                if self.seen[k] < self.min_count:
                    self.rejected += 1
                    continue
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
            admitted = self.seen.get(k, 0) >= self.min_count
            if self.min_count > 1 and k not in self.slot_of and not admitted:
                self.rejected += 1  # not admitted: its gradient is dropped
                continue
            acc = summed.get(k)
            if acc is None:
                acc = np.zeros(self.dim, dtype=F32)
            summed[k] = acc + g[i]
        pinned = set(summed)
        missing = [k for k in summed if k not in self.slot_of]  # first-occurrence order
        inits = self.initial_values(np.array(missing, dtype=np.uint64))
        for k, row in zip(missing, inits, strict=True):
            self._insert(k, row, pinned)
        for k, gk in summed.items():
            self._update(k, gk)
            self.ref[self.slot_of[k]] = True
            self.last_step[k] = self.step

    def set_step(self, step: int) -> None:
        """``Table.set_step``: later lookups and updates record ``step`` in their rows."""
        self.step = step

    def evict(self, older_than: int) -> tuple[list[int], F32Array, list[RowState]]:
        """``Table.evict``: rows with last step < ``older_than``, in slot order (one shard),
        freed like ``erase``; returns (ids, values, states)."""
        ids = [k for k in self.keys() if self.last_step[k] < older_than]
        values = np.array([self.weights[k] for k in ids], dtype=F32).reshape(len(ids), self.dim)
        states = [self.state[k] for k in ids]
        for k in ids:
            self._free(k)
        self.evictions += len(ids)
        return ids, values, states

    def _free(self, key: int) -> None:
        """Removes a present key; its slot goes on the LIFO free list."""
        slot = self.slot_of.pop(key)
        del self.slot_key[slot]
        del self.weights[key]
        del self.state[key]
        del self.last_step[key]
        self.ref[slot] = False
        self.read_mark[slot] = False
        self.free.append(slot)

    def _update(self, key: int, g: F32Array) -> None:
        self.weights[key] = optimizer_step(self.optimizer, self.weights[key], self.state[key], g)

    def set_lr(self, lr: float) -> None:
        """``Table.set_lr``: later updates use learning rate ``lr`` (alpha for FTRL)."""
        self.optimizer = with_learning_rate(self.optimizer, lr)

    def row_state(self, key: int) -> RowState | None:
        """The optimizer state of ``key`` (a copy), or None when absent."""
        st = self.state.get(int(key) % M64)
        if st is None:
            return None
        return replace(
            st,
            acc=st.acc.copy(),
            buf=st.buf.copy(),
            m=st.m.copy(),
            v=st.v.copy(),
            z=st.z.copy(),
            n=st.n.copy(),
        )

    def contains(self, keys: object) -> npt.NDArray[np.bool_]:
        """``Table.contains``: no side effects."""
        return np.array([k in self.slot_of for k in as_ids(keys).tolist()], dtype=bool)

    def erase(self, keys: object) -> int:
        """``Table.erase``: frees rows (pushed on the LIFO free list), returns rows removed."""
        removed = 0
        for k in as_ids(keys).tolist():
            if k in self.slot_of:
                self._free(k)
                removed += 1
        self.erased += removed
        return removed
