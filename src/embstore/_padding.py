"""Padding ids: the id that stands for "no id" is dropped before the core sees a batch.

Only tables with a ``padding_id`` call these, so other tables pay nothing. A padding id
contributes nothing to its bag (nor to a mean's count), gets no row and no update.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["drop_from_bags", "drop_from_entry", "drop_from_rows", "mask"]


def mask(keys: np.ndarray, key: int) -> npt.NDArray[np.bool_] | None:
    """Which ``keys`` (uint64 or int64, compared by their bits) are real ids, or None when
    none is the padding ``key``."""
    bits = keys.view(np.uint64) if keys.dtype != np.uint64 else keys
    keep = bits != np.uint64(key)
    return None if keep.all() else keep


def _valid_csr(offsets: npt.NDArray[np.int64], n: int) -> bool:
    return bool(offsets[0] == 0 and offsets[-1] == n and np.all(offsets[1:] >= offsets[:-1]))


def drop_from_bags(
    key: int,
    keys: np.ndarray,
    offsets: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32] | None,
) -> tuple[np.ndarray, npt.NDArray[np.int64], npt.NDArray[np.float32] | None]:
    """CSR bags without their padding ids (the same number of bags). Offsets the core
    would reject are passed on as they are, so its error reports them."""
    keep = mask(keys, key)
    if keep is None or not _valid_csr(offsets, keys.shape[0]):
        return keys, offsets, weights
    kept_before = np.zeros(keys.shape[0] + 1, dtype=np.int64)
    np.cumsum(keep, out=kept_before[1:])
    new_weights = None if weights is None else np.ascontiguousarray(weights[keep])
    return np.ascontiguousarray(keys[keep]), kept_before[offsets], new_weights


def drop_from_entry(key: int, entry: tuple[Any, ...], grads: bool) -> tuple[Any, ...]:
    """A checked group entry -- ``(keys, offsets[, weights])``, or with ``grads``
    ``(keys, offsets, grads[, weights])`` -- without its padding ids (the same bags)."""
    w_at = 3 if grads else 2
    w = entry[w_at] if len(entry) > w_at else None
    k, off, w = drop_from_bags(key, entry[0], entry[1], w)
    head = (k, off, entry[2]) if grads else (k, off)
    return head if w is None else (*head, w)


def drop_from_rows(key: int, keys: np.ndarray, grads: Any) -> tuple[np.ndarray, Any]:
    """Per-id gradients without the rows of padding ids."""
    keep = mask(keys, key)
    if keep is None:
        return keys, grads
    return np.ascontiguousarray(keys[keep]), np.ascontiguousarray(grads[keep])
