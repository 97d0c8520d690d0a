"""Arrays <-> protocol bytes: little-endian, C order, one copy on encode (``tobytes``) and
none on decode (``np.frombuffer`` views, read-only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _arrays

__all__ = ["MODES", "decode_array", "encode_grads", "encode_lookup", "known_table"]

#: Pool modes by their proto enum value.
MODES = ("sum", "mean")
_LE = {"keys": "<u8", "offsets": "<i8", "weights": "<f4", "grads": "<f4"}


def decode_array(raw: bytes, kind: str, table: str) -> npt.NDArray[Any]:
    """A read-only view of ``raw`` as the dtype of field ``kind`` of ``table``'s batch."""
    dtype = np.dtype(_LE[kind])
    if len(raw) % dtype.itemsize:
        msg = (
            f"features[{table!r}]: {kind} is {len(raw)} bytes, not a whole number of "
            f"{dtype.itemsize}-byte values"
        )
        raise ValueError(msg)
    return np.frombuffer(raw, dtype=dtype)


def known_table(name: str, dims: Mapping[str, int]) -> int:
    """The dim of table ``name``; KeyError worded as TableGroup's for an unknown name."""
    try:
        return dims[name]
    except KeyError:
        msg = f"unknown table {name!r}; the group has {list(dims)}"
        raise KeyError(msg) from None


def _le(a: npt.NDArray[Any], kind: str) -> bytes:
    return a.astype(_LE[kind], copy=False).tobytes()


def encode_lookup(
    features: Mapping[str, tuple[Any, ...]], dims: Mapping[str, int], batch_type: Any
) -> tuple[list[Any], list[int]]:
    """TableBatch messages of a lookup, checked as TableGroup.lookup_sum checks them, and
    the number of bags of each."""
    batches, bags = [], []
    for name, feature in features.items():
        dim = known_table(name, dims)
        entry = _arrays.named_entry(name, feature, dim, "features", _arrays.lookup_entry)
        k, off = entry[0], entry[1]
        w = entry[2] if len(entry) == 3 else None
        batches.append(_table_batch(batch_type, name, k, off, w))
        bags.append(max(int(off.shape[0]) - 1, 0))
    return batches, bags


def encode_grads(
    grads: Mapping[str, tuple[Any, ...]], dims: Mapping[str, int], batch_type: Any
) -> list[Any]:
    """TableBatch messages of a gradient push, checked as TableGroup.apply_gradients
    checks them."""
    batches = []
    for name, given in grads.items():
        dim = known_table(name, dims)
        entry = _arrays.named_entry(name, given, dim, "grads", _arrays.apply_entry)
        k, off, g = entry[0], entry[1], entry[2]
        w = entry[3] if len(entry) == 4 else None
        batches.append(_table_batch(batch_type, name, k, off, w, grads=_le(g, "grads")))
    return batches


def _table_batch(batch_type: Any, name: str, k: Any, off: Any, w: Any, **more: bytes) -> Any:
    """One TableBatch message: a checked entry's arrays as little-endian bytes."""
    return batch_type(
        table=name,
        keys=_le(k, "keys"),
        offsets=_le(off, "offsets"),
        weights=b"" if w is None else _le(w, "weights"),
        **more,
    )
