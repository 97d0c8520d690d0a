"""The tables' part of EmbeddingBagCollection.state_dict / load_state_dict.

Per table ``name`` (under the module's prefix): ``tables.<name>.ids`` (int64: the uint64
ids' bits, as embstore reads int64 keys), ``.values`` (float32 ``[n, dim]``),
``.optimizer.<state>`` (each optimizer state array of :meth:`Table.state_names`; uint32
ones such as Adam's per-row ``step`` as int64), ``.last_step`` (int64 ``[n]``: each row's
last step, which :meth:`Table.evict` reads), ``.step`` (the table's current step) and
``.lr`` (the current learning rate, float64). Restoring replaces the table's rows by
exactly these (rows not in the state are erased) and sets its step and learning rate.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from embstore.optimizers import learning_rate

__all__ = ["checkpointable", "load_tables", "save_tables"]

_METHODS = ("export", "import_", "erase", "state_names", "set_step", "set_lr")


def checkpointable(backend: Any) -> dict[str, Any] | None:
    """``{name: table}`` if every table of ``backend`` can be exported and restored, else
    None (a backend that is not a mapping of tables, e.g. a remote store)."""
    if not isinstance(backend, Mapping):
        return None
    tables = dict(backend.items())
    for table in tables.values():
        if not all(callable(getattr(table, m, None)) for m in _METHODS):
            return None
    return tables


def _suffixes(table: Any) -> list[str]:
    states = [f"optimizer.{name}" for name in table.state_names()]
    return ["ids", "values", *states, "last_step", "step", "lr"]


def _int64(array: npt.NDArray[Any]) -> torch.Tensor:
    if array.dtype == np.uint64:
        return torch.from_numpy(array.view(np.int64))
    return torch.from_numpy(array.astype(np.int64))


def save_tables(backend: Any, destination: dict[str, Any], prefix: str) -> None:
    """Add every table's entries to ``destination`` (a state_dict being built)."""
    tables = checkpointable(backend)
    if tables is None:
        msg = (
            f"EmbeddingBagCollection.state_dict: the backend {type(backend).__name__} is not a "
            "mapping of embstore tables, so its rows are NOT in the state_dict; checkpoint it "
            "with its own save"
        )
        warnings.warn(msg, UserWarning, stacklevel=4)
        return
    for name, table in tables.items():
        base = f"{prefix}tables.{name}."
        data = table.export()
        destination[base + "ids"] = _int64(data["ids"])
        destination[base + "values"] = torch.from_numpy(data["values"])
        for state in table.state_names():
            array = data[state]
            tensor = _int64(array) if array.dtype.kind == "u" else torch.from_numpy(array)
            destination[f"{base}optimizer.{state}"] = tensor
        destination[base + "last_step"] = _int64(data["last_step"])
        destination[base + "step"] = torch.tensor(int(table.step), dtype=torch.int64)
        lr = learning_rate(table.optimizer)
        destination[base + "lr"] = torch.tensor(lr, dtype=torch.float64)


def _numpy(value: Any, key: str) -> npt.NDArray[Any]:
    if not isinstance(value, torch.Tensor):
        msg = f"{key} must be a tensor, got {type(value).__name__}"
        raise TypeError(msg)
    array: npt.NDArray[Any] = value.detach().cpu().numpy()
    return array


def _restore(table: Any, base: str, entries: dict[str, Any]) -> None:
    """Replace ``table``'s rows, step and learning rate by the state's (checked first)."""
    arrays = {suffix: _numpy(value, base + suffix) for suffix, value in entries.items()}
    ids = arrays["ids"]
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        msg = f"{base}ids must be a 1-D integer tensor, got {ids.dtype} {ids.shape}"
        raise ValueError(msg)
    n = ids.shape[0]
    values = arrays["values"]
    if values.shape != (n, table.dim):
        msg = (
            f"size mismatch for {base}values: the table's rows are [{n}, {table.dim}], "
            f"the state's {list(values.shape)}"
        )
        raise ValueError(msg)
    for suffix, array in arrays.items():
        if suffix not in ("step", "lr") and (array.ndim == 0 or array.shape[0] != n):
            msg = f"size mismatch for {base}{suffix}: expected {n} rows, got {list(array.shape)}"
            raise ValueError(msg)
    data: dict[str, Any] = {"ids": ids.astype(np.int64, copy=False).view(np.uint64)}
    data["values"] = values
    data["last_step"] = arrays["last_step"]
    for state in table.state_names():
        data[state] = arrays[f"optimizer.{state}"]
    step, lr = int(arrays["step"]), float(arrays["lr"])
    if len(table):  # rows the state does not hold go first (also frees their capacity)
        extra = np.setdiff1d(table.export()["ids"], data["ids"], assume_unique=True)
        if extra.size:
            table.erase(extra)
    table.import_(data)
    table.set_step(step)
    if lr != learning_rate(table.optimizer):
        table.set_lr(lr)


def load_tables(
    backend: Any,
    state_dict: Mapping[str, Any],
    prefix: str,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Restore every table whose entries are all in ``state_dict``; report the rest as torch
    does (missing and unexpected keys, errors)."""
    root = prefix + "tables."
    mine = {key for key in state_dict if key.startswith(root)}
    tables = checkpointable(backend) or {}
    for name, table in tables.items():
        base = f"{root}{name}."
        keys = [base + suffix for suffix in _suffixes(table)]
        mine.difference_update(keys)
        absent = [key for key in keys if key not in state_dict]
        if absent:
            missing_keys.extend(absent)
            continue
        try:
            _restore(table, base, {key[len(base) :]: state_dict[key] for key in keys})
        except (TypeError, ValueError, RuntimeError) as exc:
            error_msgs.append(f"While restoring table {name!r}: {exc}")
    unexpected_keys.extend(sorted(mine))
