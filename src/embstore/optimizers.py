"""Optimizers fused into the store: one update per distinct row per call.

Each optimizer is an immutable settings object; the table keeps the state (the formulas are
in ``docs/semantics.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SGD", "Adagrad", "Optimizer"]


def _positive_finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        msg = f"{name} must be a positive finite number, got {value!r}"
        raise ValueError(msg)
    return value


@dataclass(frozen=True)
class SGD:
    """Plain stochastic gradient descent: ``w -= lr * g``. No optimizer state.

    Parameters
    ----------
    lr : float
        Learning rate (> 0).
    """

    lr: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _positive_finite("lr", self.lr))


@dataclass(frozen=True)
class Adagrad:
    """Element-wise Adagrad: ``acc += g*g; w -= lr * g / (sqrt(acc) + eps)``.

    Parameters
    ----------
    lr : float
        Learning rate (> 0).
    eps : float
        Added to ``sqrt(acc)`` (> 0).
    initial_accumulator : float
        Starting value of every accumulator element (>= 0).
    """

    lr: float
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _positive_finite("lr", self.lr))
        object.__setattr__(self, "eps", _positive_finite("eps", self.eps))
        acc = float(self.initial_accumulator)
        if not math.isfinite(acc) or acc < 0.0:
            msg = f"initial_accumulator must be finite and >= 0, got {acc!r}"
            raise ValueError(msg)
        object.__setattr__(self, "initial_accumulator", acc)


Optimizer = SGD | Adagrad
