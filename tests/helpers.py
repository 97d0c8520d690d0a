"""Shared test helpers: build a store and its reference twin, compare their states."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from reference import (
    AdagradSpec,
    AdamSpec,
    FTRLSpec,
    InitSpec,
    NormalSpec,
    OptSpec,
    ReferenceTable,
    RowWiseAdagradSpec,
    SGDSpec,
    TruncatedNormalSpec,
    UniformSpec,
    ZerosSpec,
)

import embstore
from embstore import _core

T = TypeVar("T")

COUNTERS = ("hits", "misses", "inserts", "evictions", "erased", "admitted", "rejected")
UNIFORM = UniformSpec(low=-0.5, high=0.5, seed=7)
SGD_HALF = SGDSpec(lr=0.5)
# one spec of each optimizer kind, off its defaults: what a saved state must carry
EVERY_OPTIMIZER: list[OptSpec] = [
    SGDSpec(lr=0.5),
    SGDSpec(lr=0.1, momentum=0.9),
    AdagradSpec(lr=0.1, eps=1e-6, initial_accumulator=0.1),
    RowWiseAdagradSpec(lr=0.1, initial_accumulator=0.05),
    AdamSpec(lr=0.01, weight_decay=0.01),
    FTRLSpec(alpha=0.1, beta=0.5, l1=0.01, l2=0.001),
]


def store_optimizer(spec: OptSpec) -> Any:
    """The embstore optimizer object for a reference spec."""
    if isinstance(spec, SGDSpec):
        if spec.momentum == 0.0:
            return embstore.SGD(lr=spec.lr)
        return embstore.SGD(lr=spec.lr, momentum=spec.momentum)
    if isinstance(spec, AdagradSpec):
        return embstore.Adagrad(
            lr=spec.lr, eps=spec.eps, initial_accumulator=spec.initial_accumulator
        )
    if isinstance(spec, RowWiseAdagradSpec):
        return embstore.RowWiseAdagrad(
            lr=spec.lr, eps=spec.eps, initial_accumulator=spec.initial_accumulator
        )
    if isinstance(spec, AdamSpec):
        return embstore.Adam(
            lr=spec.lr,
            beta1=spec.beta1,
            beta2=spec.beta2,
            eps=spec.eps,
            weight_decay=spec.weight_decay,
        )
    assert isinstance(spec, FTRLSpec)
    return embstore.FTRL(alpha=spec.alpha, beta=spec.beta, l1=spec.l1, l2=spec.l2)


def store_initializer(spec: InitSpec) -> Any:
    """The embstore initializer object for a reference spec."""
    if isinstance(spec, ZerosSpec):
        return embstore.Zeros()
    if isinstance(spec, UniformSpec):
        return embstore.Uniform(low=spec.low, high=spec.high, seed=spec.seed)
    kwargs: dict[str, Any] = {"std": spec.std, "seed": spec.seed}
    if spec.mean != 0.0:
        kwargs["mean"] = spec.mean
    if isinstance(spec, NormalSpec):
        return embstore.Normal(**kwargs)
    assert isinstance(spec, TruncatedNormalSpec)
    return embstore.TruncatedNormal(**kwargs)


@dataclass(frozen=True)
class Config:
    """Everything needed to build a table and its reference."""

    dim: int = 8
    capacity: int = 100_000
    optimizer: OptSpec = SGD_HALF
    initializer: InitSpec = UNIFORM
    eviction: str = "clock"
    num_shards: int | None = None
    num_threads: int | None = None
    min_count: int = 1  # > 1: an exact admission filter (a sketch too wide to collide)

    def table(self, **override: Any) -> embstore.Table:
        """A fresh store with this configuration (keyword overrides allowed)."""
        kw: dict[str, Any] = {
            "dim": self.dim,
            "capacity": self.capacity,
            "optimizer": store_optimizer(self.optimizer),
            "initializer": store_initializer(self.initializer),
            "eviction": self.eviction,
            "num_shards": self.num_shards,
            "num_threads": self.num_threads,
        }
        if self.min_count > 1:
            kw["admission"] = embstore.CountFilter(min_count=self.min_count, width=1 << 22)
        kw.update(override)
        return embstore.Table(**kw)

    def reference(self) -> ReferenceTable:
        """A fresh reference model with this configuration."""
        return ReferenceTable(
            self.dim,
            self.capacity,
            self.optimizer,
            self.initializer,
            self.eviction,
            min_count=self.min_count,
        )

    def pair(self, **override: Any) -> tuple[embstore.Table, ReferenceTable]:
        """(store, reference) built from this configuration."""
        return self.table(**override), self.reference()


def u64(values: Any) -> npt.NDArray[np.uint64]:
    """Keys as a uint64 array (Python ints may be >= 2**63)."""
    return np.array(list(values) if not isinstance(values, np.ndarray) else values, np.uint64)


def assert_same_state(
    t: embstore.Table, ref: ReferenceTable, universe: Any, *, counters: bool = True
) -> None:
    """Asserts len, contains, stored values (read with insert=False on both) and counters.

    The value read is a lookup(insert=False) applied to both sides, so it keeps them in
    step (it sets reference bits of hits and counts hits/misses on both).
    """
    keys = u64(universe)
    assert len(t) == len(ref), f"len: store {len(t)} != reference {len(ref)}"
    got_c = t.contains(keys)
    want_c = ref.contains(keys)
    bad = np.flatnonzero(got_c != want_c)
    assert bad.size == 0, (
        f"contains differs for ids {keys[bad][:10].tolist()}: store {got_c[bad][:10].tolist()}"
        f" reference ring {ref.ring()}"
    )
    got = t.lookup(keys, insert=False)
    want = ref.lookup(keys, insert=False)
    assert_rows_equal(got, want, keys)
    if counters:
        assert_counters(t, ref)


def assert_counters(t: embstore.Table, ref: ReferenceTable) -> None:
    """The store's stats() counters and size equal the reference's."""
    st = t.stats()
    want = ref.stats()
    got = {k: st[k] for k in (*COUNTERS, "size")}
    exp = {k: want[k] for k in (*COUNTERS, "size")}
    assert got == exp, f"stats: store {got} != reference {exp}"


def assert_rows_equal(got: np.ndarray, want: np.ndarray, keys: Any = None) -> None:
    """Bitwise equality of float32 result arrays with a message naming the first bad row."""
    assert got.dtype == np.float32, got.dtype
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    if np.array_equal(got, want):
        return
    diff = np.flatnonzero(np.any(got != want, axis=tuple(range(1, got.ndim))))
    i = int(diff[0])
    key = "" if keys is None else f" (id {int(np.asarray(keys)[i])})"
    ulps = np.abs(got[i].view(np.int32).astype(np.int64) - want[i].view(np.int32))
    msg = (
        f"{diff.size} rows differ; first row {i}{key}:\n got  {got[i].tolist()}\n"
        f" want {want[i].tolist()}\n max ulp diff {int(ulps.max())}"
    )
    raise AssertionError(msg)


def random_offsets(rng: np.random.Generator, n: int, bags: int) -> npt.NDArray[np.int64]:
    """Valid offsets splitting n keys into `bags` bags (some may be empty)."""
    if bags == 0:
        return np.zeros(1, dtype=np.int64)
    cuts = np.sort(rng.integers(0, n + 1, size=bags - 1))
    return np.concatenate([[0], cuts, [n]]).astype(np.int64)


def snapshot(t: embstore.Table, probe: Any) -> tuple[int, dict[str, Any], np.ndarray, np.ndarray]:
    """(len, stats, contains, values) where values are read last with insert=False.

    Two snapshots taken around an operation that must change nothing compare equal,
    because the value read of the first one is mirrored by the second's.
    """
    keys = u64(probe)
    size = len(t)
    st = dict(t.stats())
    st.pop("latency")  # timings of the calls themselves, not table state
    c = t.contains(keys)
    v = t.lookup(keys, insert=False)
    return size, st, c, v


def assert_unchanged(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    """The store did not change between two snapshots (see `snapshot`)."""
    size0, st0, c0, v0 = before
    size1, st1, c1, v1 = after
    assert size1 == size0
    # The first snapshot's value read counted its hits/misses after st0 was taken.
    n_hit = int(c0.sum())
    st0 = dict(st0, hits=st0["hits"] + n_hit, misses=st0["misses"] + (len(c0) - n_hit))
    assert st1 == st0
    assert np.array_equal(c1, c0)
    assert np.array_equal(v1, v0)


def sorted_export(t: embstore.Table) -> dict[str, np.ndarray]:
    """t.export() with rows sorted by id."""
    e = t.export()
    order = np.argsort(e["ids"], kind="stable")
    return {k: v[order] for k, v in e.items()}


def group_export(group: Any) -> dict[str, dict[str, np.ndarray]]:
    """Every table of a group (anything with ``names`` and ``[name]``) as `sorted_export`."""
    return {name: sorted_export(group[name]) for name in group.names}


def bce_step(model: Any, opt: Any, feats: Any, labels: Any) -> float:
    """One optimizer step of a torch ``model`` on binary cross-entropy with logits; the
    loss. torch is imported here: this module must load without it."""
    import torch

    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(feats), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


class DuckKJT:
    """The KeyedJaggedTensor interface, nothing more (TorchRec is not installed)."""

    def __init__(self, keys: list[str], values: Any, lengths: Any, weights: Any = None) -> None:
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Any:
        return self._values

    def lengths(self) -> Any:
        return self._lengths

    def weights_or_none(self) -> Any:
        return self._weights


def random_op(
    t: embstore.Table, ref: ReferenceTable, rng: np.random.Generator, universe: np.ndarray
) -> None:
    """One random operation on both sides, results compared: lookup (with or without
    insert), a two-bag lookup_sum, or an apply of random gradients."""
    keys = rng.choice(universe, size=int(rng.integers(1, 10)))
    kind = int(rng.integers(0, 4))
    if kind == 0:
        assert_rows_equal(t.lookup(keys), ref.lookup(keys), keys)
    elif kind == 1:
        assert_rows_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False), keys)
    elif kind == 2:
        off = np.array([0, keys.shape[0] // 2, keys.shape[0]], dtype=np.int64)
        assert_rows_equal(t.lookup_sum(keys, off), ref.lookup_sum(keys, off))
    else:
        g = rng.standard_normal((keys.shape[0], t.dim)).astype(np.float32)
        t.apply_gradients(keys, g)
        ref.apply_gradients(keys, g)


@contextlib.contextmanager
def core_setting(get: Callable[[], T], put: Callable[[T], None], value: T) -> Iterator[None]:
    """Runs the block with a process-wide core setting (read by ``get``, written by ``put``)
    at ``value``, then restores the value in use before (also when the block raises)."""
    before = get()
    put(value)
    try:
        yield
    finally:
        put(before)


def kernels_at(level: str) -> contextlib.AbstractContextManager[None]:
    """Runs the block on embstore's ``level`` kernels ("baseline" or "avx2")."""
    return core_setting(_core.simd_level, _core.set_simd_level, level)


def pool_spin(us: int) -> contextlib.AbstractContextManager[None]:
    """Runs the block with the worker pool's waits polling for ``us`` microseconds."""
    return core_setting(_core.pool_spin_us, _core.set_pool_spin_us, us)


def markdown_table(text: str, first_header: str) -> list[list[str]]:
    """The cells of the markdown table whose header starts with ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_header} |"))
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows
