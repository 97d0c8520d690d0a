"""The numpy reference every peer is checked against before it is timed."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from embstore.bench.workload import EPS, LR, F32Array

#: Forward outputs must match the numpy reference within these tolerances (the core is
#: specified to be bit-exact; the tolerance only absorbs peers that sum in another order).
FWD_RTOL, FWD_ATOL = 1e-5, 1e-6
#: Slack on top of :func:`reference_adagrad`'s per-element tolerance (which is a few ulp
#: where the duplicate sum is well conditioned).
UPD_ATOL = 1e-9


def reference_pool(rows: F32Array, pooling: int) -> F32Array:
    """Pooled sums of ``rows`` [B * L, D] per bag of ``L``, added in order from zero."""
    r3 = rows.reshape(-1, pooling, rows.shape[1])
    out = np.zeros((r3.shape[0], r3.shape[2]), dtype=np.float32)
    for j in range(pooling):
        out += r3[:, j]
    return out


def reference_adagrad(
    keys: npt.NDArray[Any],
    before: F32Array,
    acc_before: F32Array | None,
    grads: F32Array,
    pooling: int,
    lr: float = LR,
    eps: float = EPS,
) -> tuple[F32Array, npt.NDArray[np.float64]]:
    """Rows of ``keys`` after one Adagrad step (docs/semantics.md), one row per occurrence.

    Gradients of equal keys are summed in order from zero, then each distinct row is
    updated once: ``acc += g * g; w -= (lr * g) / (sqrt(acc) + eps)`` in float32. That is
    embstore's exact arithmetic; a peer that sums duplicates in another order (torch's
    ``coalesce``) gets another ``g``, and where the sum cancels (``|g|`` near ``eps``) the
    step amplifies that difference: W1 at D=128 had ``|g| = 3e-6`` from 6 terms of size 1
    differing by 1% between orders, and weights 1.5e-6 apart.

    Returns
    -------
    rows : numpy.ndarray of float32, [n, D]
        The updated row of every occurrence.
    tol : numpy.ndarray of float64, [n, D]
        What any summation order may change: the float32 bound on the sum's error,
        ``count * 2**-24 * sum(|g_i|)``, times the largest slope of the step in ``g``
        over that interval, capped at ``2 * lr``; plus 8 ulp of ``|w| + |step|``.
    """
    dim = before.shape[1]
    uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    per_id = np.repeat(grads, pooling, axis=0)
    g = np.zeros((uniq.shape[0], dim), dtype=np.float32)
    np.add.at(g, inv, per_id)  # unbuffered and in order
    acc = np.zeros_like(g) if acc_before is None else acc_before[first].copy()
    a0 = acc.astype(np.float64)
    acc += g * g
    step = (np.float32(lr) * g) / (np.sqrt(acc) + np.float32(eps))
    new = before[first] - step
    # Conditioning of the step f(g) = lr * g / (sqrt(a0 + g^2) + eps):
    # |f'(g)| = lr * (a0 / s + eps) / (s + eps)^2 with s = sqrt(a0 + g^2), decreasing in s.
    abs_sum = np.zeros(g.shape, dtype=np.float64)
    np.add.at(abs_sum, inv, np.abs(per_id).astype(np.float64))
    count = np.bincount(inv, minlength=uniq.shape[0]).astype(np.float64)[:, None]
    dg = count * 2.0**-24 * abs_sum
    g_min = np.maximum(np.abs(g.astype(np.float64)) - dg, 0.0)
    s_min = np.sqrt(a0 + g_min * g_min)
    a0_over_s = np.divide(a0, s_min, out=np.zeros_like(a0), where=s_min > 0)
    slope = lr * (a0_over_s + eps) / (s_min + eps) ** 2
    scale = np.abs(before[first]) + np.abs(step)  # w - step may cancel: ulp of the operands
    tol = np.minimum(slope * dg, 2.0 * lr) + 8.0 * np.spacing(scale).astype(np.float64)
    return new[inv].astype(np.float32, copy=False), tol[inv]


def max_abs_err(a: npt.ArrayLike, b: npt.ArrayLike) -> float:
    d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    return float(d.max()) if d.size else 0.0


def as_numpy(x: Any) -> F32Array:
    """numpy view of a peer's output (torch tensors are detached first)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


class VerificationError(AssertionError):
    """A peer's result differs from the numpy reference."""
