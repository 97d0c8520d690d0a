"""Argument normalisation shared by Table and TableGroup.

Everything here runs before the C++ core is called, so a bad argument raises a TypeError or
ValueError naming it and leaves the store unchanged. Conversions are zero-copy when the
input already has the right dtype and layout (int64 keys are reinterpreted as uint64).
Value checks that need a pass over the data (offsets monotone, gradients finite) run in the
C++ core, also before anything changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _core

_MODES = {"sum": 0, "mean": 1}


def as_keys(keys: Any, name: str = "keys") -> npt.NDArray[np.uint64]:
    """Return ``keys`` as a 1-D C-contiguous uint64 array (int64 reinterpreted, no copy)."""
    is_array = isinstance(keys, np.ndarray)
    arr = np.asarray(keys)
    if not is_array and arr.size == 0 and arr.ndim == 1:
        return np.empty(0, dtype=np.uint64)  # [] parses as float64
    if arr.dtype.kind not in "iu":
        msg = f"{name} must be an array of integers, got dtype {arr.dtype}"
        raise TypeError(msg)
    if arr.ndim != 1:
        msg = f"{name} must be 1-D, got shape {arr.shape}"
        raise ValueError(msg)
    if arr.dtype != np.uint64:
        if arr.dtype.kind == "i":
            arr = arr.astype(np.int64, copy=False).view(np.uint64)
        else:
            arr = arr.astype(np.uint64, copy=False)
    return np.ascontiguousarray(arr)


def as_offsets(offsets: Any) -> npt.NDArray[np.int64]:
    """Return CSR ``offsets`` as 1-D int64 (values are checked by the core)."""
    arr = np.asarray(offsets)
    if arr.dtype.kind not in "iu":
        msg = f"offsets must be an int32 or int64 array, got dtype {arr.dtype}"
        raise TypeError(msg)
    if arr.ndim != 1:
        msg = f"offsets must be 1-D, got shape {arr.shape}"
        raise ValueError(msg)
    if arr.shape[0] == 0:
        msg = "offsets must hold at least one element (offsets[0] == 0)"
        raise ValueError(msg)
    return np.ascontiguousarray(arr, dtype=np.int64)


def as_weights(weights: Any, n: int) -> npt.NDArray[np.float32] | None:
    """Return per-id ``weights`` as float32 [n], or None."""
    if weights is None:
        return None
    arr = np.asarray(weights)
    if arr.dtype.kind not in "fiu":
        msg = f"weights must be a float array, got dtype {arr.dtype}"
        raise TypeError(msg)
    if arr.ndim != 1 or arr.shape[0] != n:
        msg = f"weights must have shape ({n},) like keys, got {arr.shape}"
        raise ValueError(msg)
    return np.ascontiguousarray(arr, dtype=np.float32)


def as_grads(grads: Any, rows: int, dim: int, what: str) -> npt.NDArray[np.float32]:
    """Return ``grads`` as C-contiguous float32 [rows, dim]."""
    arr = np.asarray(grads)
    if arr.dtype.kind != "f":
        msg = f"grads must be a float array, got dtype {arr.dtype}"
        raise TypeError(msg)
    if arr.shape != (rows, dim):
        msg = f"grads must have shape ({rows}, {dim}) ({what}), got {arr.shape}"
        raise ValueError(msg)
    return np.ascontiguousarray(arr, dtype=np.float32)


def group_feature(name: str, feature: Any) -> tuple[Any, ...]:
    """One table's ``(keys, offsets[, weights])`` of a group lookup, converted (as
    TableGroup.lookup_sum checks it)."""
    if not isinstance(feature, tuple) or len(feature) not in (2, 3):
        msg = f"features[{name!r}] must be (keys, offsets) or (keys, offsets, weights)"
        raise ValueError(msg)
    k = as_keys(feature[0])
    off = as_offsets(feature[1])
    w = as_weights(feature[2], k.shape[0]) if len(feature) == 3 else None
    return (k, off) if w is None else (k, off, w)


def group_grads(name: str, entry: Any, dim: int) -> tuple[Any, ...]:
    """One table's ``(keys, offsets, grads[, weights])`` of a group apply, converted (as
    TableGroup.apply_gradients checks it)."""
    if not isinstance(entry, tuple) or len(entry) not in (3, 4):
        msg = f"grads[{name!r}] must be (keys, offsets, grads) or (keys, offsets, grads, weights)"
        raise ValueError(msg)
    k = as_keys(entry[0])
    off = as_offsets(entry[1])
    g = as_grads(entry[2], off.shape[0] - 1, dim, "one row per bag")
    w = as_weights(entry[3], k.shape[0]) if len(entry) == 4 else None
    return (k, off, g) if w is None else (k, off, g, w)


def unknown_table(name: str, names: list[str]) -> KeyError:
    """The error for a table name a group does not have."""
    return KeyError(f"unknown table {name!r}; the group has {names}")


def mode_code(mode: str) -> int:
    """Return the core's code for a pooling ``mode`` ("sum" or "mean")."""
    try:
        return _MODES[mode]
    except (KeyError, TypeError):
        msg = f"mode must be 'sum' or 'mean', got {mode!r}"
        raise ValueError(msg) from None


def new_rows(rows: int, dim: int) -> npt.NDArray[np.float32]:
    """A new float32 [rows, dim] array (contents unspecified) from the core's output pool."""
    result: npt.NDArray[np.float32] = _core.empty_rows(rows, dim)
    return result


def output(out: Any, rows: int, dim: int) -> npt.NDArray[np.float32]:
    """Return a float32 [rows, dim] result buffer: a new one, or the checked ``out``.

    A new one comes from the core's output pool (memory of results already freed), so large
    results do not page-fault on every call (docs/semantics.md, "Results").
    """
    if out is None:
        return new_rows(rows, dim)
    if not isinstance(out, np.ndarray):
        msg = f"out must be a numpy array, got {type(out).__name__}"
        raise TypeError(msg)
    if out.dtype != np.float32:
        msg = f"out must have dtype float32, got {out.dtype}"
        raise TypeError(msg)
    if out.shape != (rows, dim):
        msg = f"out must have shape ({rows}, {dim}), got {out.shape}"
        raise ValueError(msg)
    if not out.flags.c_contiguous:
        msg = "out must be C-contiguous"
        raise ValueError(msg)
    if not out.flags.writeable:
        msg = "out must be writeable"
        raise ValueError(msg)
    return out


def positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an int > 0, or raise TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        msg = f"{name} must be an int, got {type(value).__name__}"
        raise TypeError(msg)
    if value <= 0:
        msg = f"{name} must be positive, got {value}"
        raise ValueError(msg)
    return int(value)
