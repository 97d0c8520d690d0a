"""The server's table config file (``python -m embstore.ps serve --config tables.json``).

Format (docs/ps.md)::

    {"tables": {"<name>": {"dim": 32, "capacity": 1000000,
                           "optimizer": {"type": "Adagrad", "lr": 0.01},
                           "initializer": {"type": "Normal", "std": 0.01, "seed": 0},
                           "num_shards": 64, "num_threads": 2, "eviction": "clock"}}}

``optimizer`` and ``initializer`` name an embstore class (``SGD``, ``Adagrad``,
``RowWiseAdagrad``, ``Adam``, ``FTRL``; ``Zeros``, ``Uniform``, ``Normal``,
``TruncatedNormal``) and its keyword arguments; every other key is a ``Table`` keyword.
"""

from __future__ import annotations

import json
import os
from typing import Any

import embstore
from embstore.group import TableGroup
from embstore.table import Table

__all__ = ["group_from_config", "load_config"]

_OPTIMIZERS = ("SGD", "Adagrad", "RowWiseAdagrad", "Adam", "FTRL")
_INITIALIZERS = ("Zeros", "Uniform", "Normal", "TruncatedNormal")
_TABLE_KEYS = ("dim", "capacity", "num_shards", "num_threads", "eviction")


def _component(spec: Any, allowed: tuple[str, ...], where: str) -> Any:
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        msg = f'{where} must be an object with a "type" ({", ".join(allowed)})'
        raise TypeError(msg)
    kwargs = {k: v for k, v in spec.items() if k != "type"}
    if spec["type"] not in allowed:
        msg = f"{where}.type must be one of {', '.join(allowed)}, got {spec['type']!r}"
        raise ValueError(msg)
    try:
        return getattr(embstore, spec["type"])(**kwargs)
    except TypeError as e:
        msg = f"{where}: {e}"
        raise ValueError(msg) from None


def group_from_config(config: dict[str, Any]) -> TableGroup:
    """A new TableGroup built from a parsed config (see the module docstring)."""
    tables_spec = config.get("tables") if isinstance(config, dict) else None
    if not isinstance(tables_spec, dict) or not tables_spec:
        msg = 'config must be an object with a non-empty "tables" object'
        raise ValueError(msg)
    tables: dict[str, Table] = {}
    for name, spec in tables_spec.items():
        where = f"tables[{name!r}]"
        if not isinstance(spec, dict):
            msg = f"{where} must be an object"
            raise TypeError(msg)
        unknown = set(spec) - set(_TABLE_KEYS) - {"optimizer", "initializer"}
        if unknown:
            msg = f"{where}: unknown keys {sorted(unknown)}"
            raise ValueError(msg)
        kwargs = {k: spec[k] for k in _TABLE_KEYS if k in spec}
        if "optimizer" in spec:
            kwargs["optimizer"] = _component(spec["optimizer"], _OPTIMIZERS, f"{where}.optimizer")
        if "initializer" in spec:
            kwargs["initializer"] = _component(
                spec["initializer"], _INITIALIZERS, f"{where}.initializer"
            )
        tables[name] = Table(name=name, **kwargs)
    return TableGroup(tables)


def load_config(path: str | os.PathLike[str]) -> TableGroup:
    """The TableGroup the config file at ``path`` describes."""
    with open(path, encoding="utf-8") as f:
        return group_from_config(json.load(f))
