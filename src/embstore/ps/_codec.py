"""Checked arrays of a call: TableGroup's checks before anything is sent, and the names of
the pool modes (the bytes themselves are ``_wire``'s)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from embstore import _arrays
from embstore.ps._wire import TableArrays

__all__ = ["MODES", "encode_grads", "encode_lookup", "known_table"]

#: Pool modes by their proto enum value.
MODES = ("sum", "mean")


def known_table(name: str, dims: Mapping[str, int]) -> int:
    """The dim of table ``name``; KeyError worded as TableGroup's for an unknown name."""
    try:
        return dims[name]
    except KeyError:
        msg = f"unknown table {name!r}; the group has {list(dims)}"
        raise KeyError(msg) from None


def encode_lookup(
    features: Mapping[str, tuple[Any, ...]], dims: Mapping[str, int]
) -> tuple[list[TableArrays], list[int]]:
    """A lookup's tables, checked as TableGroup.lookup_sum checks them, and the number of
    bags of each."""
    tables, bags = [], []
    for name, feature in features.items():
        dim = known_table(name, dims)
        entry = _arrays.named_entry(name, feature, dim, "features", _arrays.lookup_entry)
        k, off = entry[0], entry[1]
        w = entry[2] if len(entry) == 3 else None
        tables.append(TableArrays(name, k, off, weights=w))
        bags.append(max(int(off.shape[0]) - 1, 0))
    return tables, bags


def encode_grads(
    grads: Mapping[str, tuple[Any, ...]], dims: Mapping[str, int]
) -> list[TableArrays]:
    """A gradient push's tables, checked as TableGroup.apply_gradients checks them."""
    tables = []
    for name, given in grads.items():
        dim = known_table(name, dims)
        entry = _arrays.named_entry(name, given, dim, "grads", _arrays.apply_entry)
        w = entry[3] if len(entry) == 4 else None
        tables.append(TableArrays(name, entry[0], entry[1], weights=w, grads=entry[2]))
    return tables
