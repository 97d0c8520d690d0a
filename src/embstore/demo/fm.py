"""A factorization machine in numpy whose sparse parameters live in embstore tables.

One table per field; row ``[w, u_1 .. u_dim]`` of an id holds its first-order weight and
its stored factors, and the table's fused Adagrad trains both. The model's factor vector is
``v = c * u`` for a fixed ``factor_scale`` ``c``: Adagrad moves every element by about its
``lr`` whatever the gradient's size, so ``c`` is the factors' own step size (and initial
scale) relative to the first-order weights'. With ``P_f`` the pooled row of field ``f``
(the id's row times its value; a bag per example per field), ``E_f = c * P_f[1:]`` its
factor part and ``S = sum_f E_f``:

    logit = b + sum_f P_f[0] + (|S|^2 - sum_f |E_f|^2) / 2        (FM: all pairs of fields)

For the mean logloss ``L`` over a batch of ``B`` examples, with ``d = (p - y) / B``:

    dL/dP_f[0] = d,   dL/dP_f[1:] = c * d * (S - E_f),   dL/db = sum d

The forward is one :meth:`TableGroup.lookup_sum` call for all fields, the backward one
:meth:`TableGroup.apply_gradients` call. The bias ``b`` is a numpy scalar trained with the
same Adagrad rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

import embstore
from embstore.demo.data import Batch

__all__ = ["FactorizationMachine", "build_group", "sigmoid"]

F32Array = npt.NDArray[np.float32]


def sigmoid(x: F32Array) -> F32Array:
    """Logistic function, without overflow warnings."""
    out: F32Array = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def build_group(
    fields: tuple[str, ...],
    capacities: Mapping[str, int],
    *,
    dim: int,
    lr: float,
    init_std: float,
    seed: int,
    threads: int | None = None,
) -> embstore.TableGroup:
    """One Adagrad table of ``dim + 1`` columns per field (column 0: first-order weight)."""
    tables = {
        name: embstore.Table(
            dim=dim + 1,
            capacity=capacities[name],
            optimizer=embstore.Adagrad(lr=lr),
            initializer=embstore.Normal(std=init_std, seed=seed * 1000 + f),
            num_threads=threads,
        )
        for f, name in enumerate(fields)
    }
    return embstore.TableGroup(tables)


class FactorizationMachine:
    """The factorization machine above, over ``group`` (see :func:`build_group`)."""

    def __init__(
        self,
        group: embstore.TableGroup,
        *,
        lr: float,
        l2: float = 0.0,
        bias: float = 0.0,
        factor_scale: float = 1.0,
    ) -> None:
        self.group = group
        self.fields = tuple(group.names)
        dims = {group[name].dim for name in self.fields}
        if len(dims) != 1:
            msg = f"every table must have the same dim, got {sorted(dims)}"
            raise ValueError(msg)
        self.dim = dims.pop() - 1
        self.lr = lr
        self.l2 = l2
        self.bias = float(bias)
        self.factor_scale = float(factor_scale)
        self._bias_acc = 0.0

    def _logits(self, pooled: Mapping[str, F32Array]) -> tuple[F32Array, F32Array, F32Array]:
        """(logits [B], stacked pooled rows [F, B, dim + 1], S [B, dim])."""
        p = np.stack([pooled[name] for name in self.fields])  # [F, B, dim + 1]
        e = p[:, :, 1:] * np.float32(self.factor_scale)
        s = e.sum(axis=0)
        pair = 0.5 * (np.einsum("bk,bk->b", s, s) - np.einsum("fbk,fbk->b", e, e))
        logits = (np.float32(self.bias) + p[:, :, 0].sum(axis=0) + pair).astype(np.float32)
        return logits, p, s

    def predict(self, batch: Batch) -> F32Array:
        """Click probabilities; read-only (unknown ids pool as zeros, nothing is inserted)."""
        pooled = self.group.lookup_sum(batch.features, insert=False)
        return sigmoid(self._logits(pooled)[0])

    def train_step(self, batch: Batch) -> F32Array:
        """One Adagrad step on ``batch``; returns the probabilities from before the step."""
        pooled = self.group.lookup_sum(batch.features)
        logits, p, s = self._logits(pooled)
        prob = sigmoid(logits)
        d = ((prob - batch.labels) / np.float32(len(batch))).astype(np.float32)
        c = np.float32(self.factor_scale)
        grads = np.empty_like(p)
        grads[:, :, 0] = d
        np.subtract(s[None, :, :], c * p[:, :, 1:], out=grads[:, :, 1:])
        grads[:, :, 1:] *= (c * d)[None, :, None]
        if self.l2 > 0.0:
            grads += np.float32(self.l2 / len(batch)) * p
        entries = {}
        for f, name in enumerate(self.fields):
            keys, offsets, *weights = batch.features[name]
            entries[name] = (keys, offsets, grads[f], *weights)
        self.group.apply_gradients(entries)  # all fields in one call
        g = float(d.sum())
        self._bias_acc += g * g
        self.bias -= self.lr * g / (math.sqrt(self._bias_acc) + 1e-8)
        return prob
