"""Optimizers fused into the store: one update per distinct row per call.

Each optimizer is an immutable settings object; the table keeps the state in each row, right
after the weights (the exact float32 formulas are in ``docs/semantics.md``). State per row:

==================  ===================================  ===========================
optimizer           state                                floats per row
==================  ===================================  ===========================
SGD                 none (a momentum buffer if > 0)      0 (dim)
Adagrad             accumulator per element              dim
RowWiseAdagrad      one accumulator                      1
Adam                m, v per element; step count t       2 * dim + 1
FTRL                z, n per element                     2 * dim
==================  ===================================  ===========================
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "Adam",
    "Optimizer",
    "RowWiseAdagrad",
    "learning_rate",
    "state_layout",
]


def _positive_finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        msg = f"{name} must be a positive finite number, got {value!r}"
        raise ValueError(msg)
    return value


def _non_negative(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        msg = f"{name} must be finite and >= 0, got {value!r}"
        raise ValueError(msg)
    return value


def _unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value < 1.0:
        msg = f"{name} must be in [0, 1), got {value!r}"
        raise ValueError(msg)
    return value


def _set(obj: object, name: str, value: float) -> None:
    object.__setattr__(obj, name, value)


# The core's constructor takes every optimizer's parameters; these fill the ones the chosen
# optimizer does not read (any valid value would do).
_CORE_UNUSED: dict[str, float] = {
    "eps": 1e-8,
    "initial_accumulator": 0.0,
    "momentum": 0.0,
    "beta1": 0.9,
    "beta2": 0.999,
    "weight_decay": 0.0,
    "ftrl_beta": 1.0,
    "l1": 0.0,
    "l2": 0.0,
}


def _core_args(code: int, lr: float, **own: float) -> dict[str, Any]:
    return {**_CORE_UNUSED, "optimizer": code, "lr": lr, **own}


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent: ``w -= lr * g``.

    With ``momentum > 0`` a per-element buffer: ``buf = momentum * buf + g; w -= lr * buf``.
    """

    lr: float
    momentum: float = 0.0

    def __post_init__(self) -> None:
        _set(self, "lr", _positive_finite("lr", self.lr))
        _set(self, "momentum", _unit_interval("momentum", self.momentum))

    def _core_args(self) -> dict[str, Any]:
        """The core constructor's optimizer arguments."""
        return _core_args(0, self.lr, momentum=self.momentum)


@dataclass(frozen=True)
class Adagrad:
    """Element-wise Adagrad: ``acc += g*g; w -= lr * g / (sqrt(acc) + eps)``."""

    lr: float
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        _set(self, "lr", _positive_finite("lr", self.lr))
        _set(self, "eps", _positive_finite("eps", self.eps))
        _set(
            self,
            "initial_accumulator",
            _non_negative("initial_accumulator", self.initial_accumulator),
        )

    _CORE_CODE: ClassVar[int] = 1

    def _core_args(self) -> dict[str, Any]:
        """The core constructor's optimizer arguments."""
        return _core_args(
            self._CORE_CODE,
            self.lr,
            eps=self.eps,
            initial_accumulator=self.initial_accumulator,
        )


@dataclass(frozen=True)
class RowWiseAdagrad(Adagrad):
    """Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): one accumulator per row,
    ``acc += mean(g*g)``, then ``w -= lr * g / (sqrt(acc) + eps)``."""

    _CORE_CODE: ClassVar[int] = 2


@dataclass(frozen=True)
class Adam:
    """Adam with a per-row step count and decoupled weight decay.

    ``t += 1``; ``w -= lr * weight_decay * w``; ``m = b1*m + (1-b1)*g``;
    ``v = b2*v + (1-b2)*g*g``; ``w -= lr * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)``.
    """

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _set(self, "lr", _positive_finite("lr", self.lr))
        _set(self, "beta1", _unit_interval("beta1", self.beta1))
        _set(self, "beta2", _unit_interval("beta2", self.beta2))
        _set(self, "eps", _positive_finite("eps", self.eps))
        _set(self, "weight_decay", _non_negative("weight_decay", self.weight_decay))

    def _core_args(self) -> dict[str, Any]:
        """The core constructor's optimizer arguments."""
        return _core_args(
            3,
            self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )


@dataclass(frozen=True)
class FTRL:
    """FTRL-Proximal (McMahan et al.), the CTR classic; ``alpha`` is the learning rate.

    Per element: ``sigma = (sqrt(n + g*g) - sqrt(n)) / alpha; z += g - sigma*w; n += g*g``;
    ``w = 0`` if ``|z| <= l1`` else ``-(z - sign(z)*l1) / ((beta + sqrt(n))/alpha + l2)``.
    """

    alpha: float
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0

    def __post_init__(self) -> None:
        _set(self, "alpha", _positive_finite("alpha", self.alpha))
        _set(self, "beta", _non_negative("beta", self.beta))
        _set(self, "l1", _non_negative("l1", self.l1))
        _set(self, "l2", _non_negative("l2", self.l2))

    def _core_args(self) -> dict[str, Any]:
        """The core constructor's optimizer arguments."""
        return _core_args(4, self.alpha, ftrl_beta=self.beta, l1=self.l1, l2=self.l2)


Optimizer = SGD | Adagrad | RowWiseAdagrad | Adam | FTRL


def learning_rate(optimizer: Optimizer) -> float:
    """The optimizer's learning rate (``alpha`` for FTRL)."""
    return optimizer.alpha if isinstance(optimizer, FTRL) else optimizer.lr


def with_learning_rate(optimizer: Optimizer, lr: float) -> Optimizer:
    """A copy of ``optimizer`` with another learning rate (``alpha`` for FTRL)."""
    if isinstance(optimizer, FTRL):
        return dataclasses.replace(optimizer, alpha=lr)
    return dataclasses.replace(optimizer, lr=lr)


def state_layout(optimizer: Optimizer, dim: int) -> list[tuple[str, int, str]]:
    """The optimizer state stored after a row's ``dim`` weights, in order, as
    ``(name, floats, dtype)``: Adagrad ``accumulator`` [dim]; RowWiseAdagrad ``accumulator``
    [1]; SGD with momentum ``momentum`` [dim]; Adam ``m`` [dim], ``v`` [dim], ``step`` [1]
    (a uint32 count stored in a float32 slot); FTRL ``z`` [dim], ``n`` [dim]."""
    if isinstance(optimizer, RowWiseAdagrad):
        return [("accumulator", 1, "float32")]
    if isinstance(optimizer, Adagrad):
        return [("accumulator", dim, "float32")]
    if isinstance(optimizer, SGD):
        return [("momentum", dim, "float32")] if optimizer.momentum > 0.0 else []
    if isinstance(optimizer, Adam):
        return [("m", dim, "float32"), ("v", dim, "float32"), ("step", 1, "uint32")]
    return [("z", dim, "float32"), ("n", dim, "float32")]
