"""Argument normalisation shared by Table and TableGroup.

Everything here runs before the C++ core is called, so a bad argument raises a TypeError or
ValueError naming it and leaves the store unchanged. Conversions are zero-copy when the
input already has the right dtype and layout (int64 keys are reinterpreted as uint64).
Value checks that need a pass over the data (offsets monotone, gradients finite) run in the
C++ core, also before anything changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
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


# The core's own formats. Arrays already in them pass through untouched (no copy, no
# conversion); 1-D arrays with these strides are C-contiguous.
NDARRAY = np.ndarray
KEY_DTYPES = (np.dtype(np.uint64), np.dtype(np.int64))
INT64_DTYPE = (np.dtype(np.int64),)
FLOAT32_DTYPE = (np.dtype(np.float32),)
STRIDES_8 = (8,)
STRIDES_4 = (4,)


def core_keys(keys: Any) -> npt.NDArray[np.uint64] | npt.NDArray[np.int64]:
    """``keys`` as the core takes them: uint64 or int64, 1-D, C-contiguous."""
    if type(keys) is NDARRAY and keys.dtype in KEY_DTYPES and keys.strides == STRIDES_8:
        return keys
    return as_keys(keys)


def core_offsets(offsets: Any) -> npt.NDArray[np.int64]:
    """CSR ``offsets`` as the core takes them: int64, 1-D, C-contiguous, not empty."""
    if (
        type(offsets) is NDARRAY
        and offsets.dtype in INT64_DTYPE
        and offsets.strides == STRIDES_8
        and offsets.shape[0]
    ):
        return offsets
    return as_offsets(offsets)


def core_weights(weights: Any, n: int) -> npt.NDArray[np.float32] | None:
    """Per-id ``weights`` as the core takes them: None, or float32 [n] C-contiguous."""
    if as_is_weights(weights, n):
        return weights  # type: ignore[no-any-return]
    return as_weights(weights, n)


def core_grads(grads: Any, rows: int, dim: int) -> npt.NDArray[np.float32]:
    """Per-bag ``grads`` as the core takes them: float32 [rows, dim] C-contiguous."""
    if (
        type(grads) is NDARRAY
        and grads.dtype in FLOAT32_DTYPE
        and grads.shape == (rows, dim)
        and grads.flags.c_contiguous
    ):
        return grads
    return as_grads(grads, rows, dim, "one row per bag")


def as_is_weights(w: Any, n: int) -> bool:
    """Whether weights are in the core's format (float32 [n], C-contiguous)."""
    return (
        type(w) is NDARRAY
        and w.dtype in FLOAT32_DTYPE
        and w.strides == STRIDES_4
        and w.shape[0] == n
    )


def as_is_grads(entry: tuple[Any, ...], dim: int) -> bool:
    """Whether a ``grads`` entry is in the core's formats (the ids as for a lookup; grads
    float32 [bags, dim] C-contiguous; weights None or as for a lookup)."""
    k, off, g = entry[0], entry[1], entry[2]
    w = entry[3] if len(entry) == 4 else None
    return (
        type(k) is NDARRAY
        and k.dtype in KEY_DTYPES
        and k.strides == STRIDES_8
        and type(off) is NDARRAY
        and off.dtype in INT64_DTYPE
        and off.strides == STRIDES_8
        and off.shape[0] > 0
        and type(g) is NDARRAY
        and g.dtype in FLOAT32_DTYPE
        and g.shape == (off.shape[0] - 1, dim)
        and g.flags.c_contiguous
        and (w is None or as_is_weights(w, k.shape[0]))
    )


def lookup_entry(entry: Any, dim: int) -> tuple[Any, ...]:
    """``(keys, offsets[, weights])`` in the core's formats."""
    if not isinstance(entry, tuple) or len(entry) not in (2, 3):
        msg = "must be (keys, offsets) or (keys, offsets, weights)"
        raise ValueError(msg)
    k = core_keys(entry[0])
    off = core_offsets(entry[1])
    w = core_weights(entry[2], k.shape[0]) if len(entry) == 3 else None
    return (k, off) if w is None else (k, off, w)


def apply_entry(entry: Any, dim: int) -> tuple[Any, ...]:
    """``(keys, offsets, grads[, weights])`` in the core's formats."""
    if not isinstance(entry, tuple) or len(entry) not in (3, 4):
        msg = "must be (keys, offsets, grads) or (keys, offsets, grads, weights)"
        raise ValueError(msg)
    k = core_keys(entry[0])
    off = core_offsets(entry[1])
    g = core_grads(entry[2], off.shape[0] - 1, dim)
    w = core_weights(entry[3], k.shape[0]) if len(entry) == 4 else None
    return (k, off, g) if w is None else (k, off, g, w)


def named_entry(
    name: str, entry: Any, dim: int, what: str, convert: Callable[[Any, int], tuple[Any, ...]]
) -> tuple[Any, ...]:
    """``convert(entry, dim)``, or its error reworded to name the table and the argument
    ``what`` (``features`` or ``grads``), as every group-shaped call reports it."""
    try:
        return convert(entry, dim)
    except (TypeError, ValueError) as e:
        raise type(e)(f"table {name!r}: {what}[{name!r}]: {e}") from None


def entry_names(given: Any, what: str) -> list[str]:
    """The table names of a group-shaped argument ``what`` (``features`` or ``grads``), or
    TypeError naming it when it is not a mapping."""
    if not isinstance(given, Mapping):
        msg = (
            f"{what} must be a mapping of table name -> tuple of arrays, got {type(given).__name__}"
        )
        raise TypeError(msg)
    return list(given)


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


def learning_rate(lr: Any) -> float:
    """Return ``lr`` as a positive finite float, or raise ValueError naming it."""
    rate = float(lr)
    if not math.isfinite(rate) or rate <= 0.0:
        msg = f"lr must be a positive finite number, got {rate!r}"
        raise ValueError(msg)
    return rate


def check_tables(tables: Any, kind: type, got: Callable[[Any], str]) -> None:
    """Check a group's ``tables`` argument: a mapping of str -> ``kind``; a TypeError names
    the argument (``got`` describes a value of another kind)."""
    if not isinstance(tables, Mapping):
        msg = f"tables must be a mapping of name -> {kind.__name__}, got {type(tables).__name__}"
        raise TypeError(msg)
    for name, value in tables.items():
        if not isinstance(name, str):
            msg = f"table names must be str, got {name!r}"
            raise TypeError(msg)
        if not isinstance(value, kind):
            msg = f"tables[{name!r}] must be an embstore.{kind.__name__}, got {got(value)}"
            raise TypeError(msg)
