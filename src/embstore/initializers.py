"""Initializers: the value a new id's row starts with.

Every initializer is deterministic per ``(seed, id)``: an id gets the same initial row
whatever the insertion order, shard count, thread count or capacity (the formulas are in
``docs/semantics.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Initializer", "Normal", "TruncatedNormal", "Uniform", "Zeros"]

_SEED_MOD = 2**64


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        msg = f"{name} must be finite, got {value!r}"
        raise ValueError(msg)
    return value


def _seed(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"seed must be an int, got {type(value).__name__}"
        raise TypeError(msg)
    return value % _SEED_MOD


@dataclass(frozen=True)
class Zeros:
    """Every element starts at 0."""

    def _core_args(self) -> dict[str, Any]:
        """The core constructor's initializer arguments."""
        return {"initializer": 0, "init_a": 0.0, "init_b": 0.0, "seed": 0}


@dataclass(frozen=True)
class Uniform:
    """Elements uniform in ``[low, high)``."""

    low: float = -0.01
    high: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        low, high = _finite("low", self.low), _finite("high", self.high)
        if not low <= high:
            msg = f"low must be <= high, got low={low!r}, high={high!r}"
            raise ValueError(msg)
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)
        object.__setattr__(self, "seed", _seed(self.seed))

    def _core_args(self) -> dict[str, Any]:
        """The core constructor's initializer arguments."""
        return {"initializer": 1, "init_a": self.low, "init_b": self.high, "seed": self.seed}


@dataclass(frozen=True)
class Normal:
    """Elements drawn from ``N(mean, std**2)`` (Box-Muller)."""

    std: float = 0.01
    mean: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        std = _finite("std", self.std)
        if std < 0:
            msg = f"std must be >= 0, got {std!r}"
            raise ValueError(msg)
        object.__setattr__(self, "std", std)
        object.__setattr__(self, "mean", _finite("mean", self.mean))
        object.__setattr__(self, "seed", _seed(self.seed))

    _CORE_CODE: ClassVar[int] = 2

    def _core_args(self) -> dict[str, Any]:
        """The core constructor's initializer arguments."""
        code = self._CORE_CODE
        return {"initializer": code, "init_a": self.mean, "init_b": self.std, "seed": self.seed}


@dataclass(frozen=True)
class TruncatedNormal(Normal):
    """As :class:`Normal`, redrawing any element beyond two standard deviations."""

    _CORE_CODE: ClassVar[int] = 3


Initializer = Zeros | Uniform | Normal | TruncatedNormal
