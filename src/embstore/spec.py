"""TableSpec: everything a :class:`~embstore.Table` is built from, as one frozen value.

A spec is checked when it is made, compares by value, pickles, and encodes itself for the
C++ core; ``Table(**kwargs)`` and ``Table.from_spec(TableSpec(**kwargs))`` build the same
table, and ``table.spec`` gives it back (with the current learning rate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _arrays
from embstore.admission import CountFilter
from embstore.initializers import Initializer, Normal, TruncatedNormal, Uniform, Zeros
from embstore.optimizers import FTRL, SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad

__all__ = ["EvictCallback", "TableSpec"]

#: ``on_evict(ids, values)``: uint64 ``[k]`` and float32 ``[k, dim]`` of rows CLOCK evicted.
EvictCallback = Callable[[npt.NDArray[np.uint64], npt.NDArray[np.float32]], object]

_OPTIMIZERS = (SGD, Adagrad, RowWiseAdagrad, Adam, FTRL)
_INITIALIZERS = (Zeros, Uniform, Normal, TruncatedNormal)
_EVICTION = {"none": 0, "clock": 1}


def _default_optimizer() -> Optimizer:
    return Adagrad(lr=0.01)


def _default_initializer() -> Initializer:
    return Normal(std=0.01, seed=0)


@dataclass(frozen=True)
class TableSpec:
    """The settings of a :class:`~embstore.Table`: its keyword arguments, checked.

    The fields, their defaults and their meaning are :class:`~embstore.Table`'s
    parameters (``optimizer=None`` and ``initializer=None`` mean the defaults,
    ``Adagrad(lr=0.01)`` and ``Normal(std=0.01, seed=0)``). A spec holds no rows: it
    pickles as long as ``on_evict`` does (a module-level function does, a lambda does not).
    """

    dim: int
    capacity: int
    _: KW_ONLY  # as in Table: everything after capacity is a keyword
    optimizer: Optimizer = field(default_factory=_default_optimizer)
    initializer: Initializer = field(default_factory=_default_initializer)
    num_shards: int | None = None
    eviction: str = "clock"
    num_threads: int | None = None
    name: str | None = None
    admission: CountFilter | None = None
    on_evict: EvictCallback | None = field(default=None, compare=False)
    padding_id: int | None = None

    def __post_init__(self) -> None:
        dim = _arrays.positive_int("dim", self.dim)
        capacity = _arrays.positive_int("capacity", self.capacity)
        self._set("dim", dim)
        self._set("capacity", capacity)
        self._check_components()
        if self.num_shards is not None:
            shards = _arrays.positive_int("num_shards", self.num_shards)
            if shards & (shards - 1):
                msg = f"num_shards must be a power of two, got {shards}"
                raise ValueError(msg)
            if shards > capacity:
                msg = f"num_shards ({shards}) must not exceed capacity ({capacity})"
                raise ValueError(msg)
            self._set("num_shards", shards)
        if self.num_threads is not None:
            self._set("num_threads", _arrays.positive_int("num_threads", self.num_threads))
        if self.name is not None and not isinstance(self.name, str):
            msg = f"name must be a str or None, got {type(self.name).__name__}"
            raise TypeError(msg)
        if self.on_evict is not None and not callable(self.on_evict):
            msg = f"on_evict must be callable or None, got {self.on_evict!r}"
            raise TypeError(msg)
        if self.padding_id is not None:
            _padding_key(self.padding_id)
            self._set("padding_id", int(self.padding_id))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_components(self) -> None:
        if self.optimizer is None:  # Table's keyword default
            self._set("optimizer", _default_optimizer())
        if type(self.optimizer) not in _OPTIMIZERS:
            msg = (
                "optimizer must be embstore.SGD, Adagrad, RowWiseAdagrad, Adam or FTRL, "
                f"got {self.optimizer!r}"
            )
            raise TypeError(msg)
        if self.initializer is None:
            self._set("initializer", _default_initializer())
        if type(self.initializer) not in _INITIALIZERS:
            msg = f"initializer must be an embstore initializer, got {self.initializer!r}"
            raise TypeError(msg)
        if self.eviction not in _EVICTION:
            msg = f"eviction must be 'clock' or 'none', got {self.eviction!r}"
            raise ValueError(msg)
        if self.admission is not None and not isinstance(self.admission, CountFilter):
            msg = f"admission must be an embstore.CountFilter or None, got {self.admission!r}"
            raise TypeError(msg)

    @property
    def padding_key(self) -> int | None:
        """``padding_id`` as a uint64 key (``-1`` is ``2**64 - 1``), or None."""
        return None if self.padding_id is None else _padding_key(self.padding_id)

    def core_args(self) -> dict[str, Any]:
        """The C++ core's constructor arguments for this spec (0: let the core choose)."""
        admission = self.admission if self.admission is not None else CountFilter(min_count=1)
        return {
            "dim": self.dim,
            "capacity": self.capacity,
            "num_shards": self.num_shards or 0,
            "num_threads": self.num_threads or 0,
            "eviction": _EVICTION[self.eviction],
            **self.optimizer._core_args(),
            **self.initializer._core_args(),
            **admission._core_args(),
            "stage_evicted": self.on_evict is not None,
        }


def _padding_key(value: Any) -> int:
    """A padding id as the uint64 the core sees (negative ids wrap, as int64 keys do)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        msg = f"padding_id must be an int or None, got {type(value).__name__}"
        raise TypeError(msg)
    if not -(2**63) <= int(value) < 2**64:
        msg = f"padding_id must fit in int64 or uint64, got {value}"
        raise ValueError(msg)
    return int(value) % 2**64
