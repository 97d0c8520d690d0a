"""TableGroup: several named tables driven by one call per batch.

All fields of a batch cross into C++ once; the core spreads every (table, shard) of the
batch over its worker threads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _arrays, _core, _persist
from embstore.table import Table

__all__ = ["TableGroup"]


class TableGroup(Mapping[str, Table]):
    """A mapping of names to :class:`Table` with batched multi-table operations.

    Parameters
    ----------
    tables : Mapping[str, Table]
        The tables by name. The group holds references; closing a table closes it for
        the group too.
    """

    def __init__(self, tables: Mapping[str, Table]) -> None:
        if not isinstance(tables, Mapping):
            msg = f"tables must be a mapping of name -> Table, got {type(tables).__name__}"
            raise TypeError(msg)
        for name, table in tables.items():
            if not isinstance(name, str):
                msg = f"table names must be str, got {name!r}"
                raise TypeError(msg)
            if not isinstance(table, Table):
                msg = f"tables[{name!r}] must be an embstore.Table, got {type(table).__name__}"
                raise TypeError(msg)
        self._tables: dict[str, Table] = dict(tables)
        for name, table in self._tables.items():
            if not table._name_given:  # label metrics with the group's name for it
                table.name = name
                table._name_given = True

    def __getitem__(self, name: str) -> Table:
        return self._tables[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def names(self) -> list[str]:
        """The table names, in insertion order."""
        return list(self._tables)

    def __repr__(self) -> str:
        return f"<embstore.TableGroup {self.names}>"

    def _table(self, name: str) -> Table:
        try:
            return self._tables[name]
        except KeyError:
            msg = f"unknown table {name!r}; the group has {self.names}"
            raise KeyError(msg) from None

    def _deliver_evicted(self, names: list[str]) -> None:
        for name in names:  # each table's on_evict, after the whole call (no locks held)
            table = self._tables[name]
            if table._on_evict is not None:
                table._deliver_evicted()

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Checkpoint every table into ``directory`` (created if needed): one file per table
        and a ``MANIFEST.json`` written last, atomically, that names them. A crash at any
        moment leaves the previous group checkpoint in ``directory`` loadable; files of
        older saves are removed once the new manifest is in place. Each table is a
        point-in-time snapshot (see :meth:`Table.save`); the snapshots of all tables begin
        back to back before any is written."""
        _persist.save_group(self, directory)

    @classmethod
    def load(
        cls, directory: str | os.PathLike[str], *, num_threads: int | None = None
    ) -> TableGroup:
        """The group saved in ``directory`` by :meth:`save` (``num_threads`` overrides every
        table's). Raises :class:`~embstore.CheckpointError` if any file is bad."""
        return _persist.load_group(directory, num_threads)

    def set_step(self, step: int) -> None:
        """``Table.set_step(step)`` on every table of the group."""
        for table in self._tables.values():
            table.set_step(step)

    def stats(self) -> dict[str, dict[str, Any]]:
        """``Table.stats()`` of every table, by name (a group call's latency is recorded into
        each table it touches)."""
        return {name: table.stats() for name, table in self._tables.items()}

    def lookup_sum(
        self,
        features: Mapping[str, tuple[Any, ...]],
        *,
        mode: str = "sum",
        insert: bool = True,
    ) -> dict[str, npt.NDArray[np.float32]]:
        """Pooled lookups of several tables in one call.

        ``features`` maps a table name to ``(keys, offsets)`` or ``(keys, offsets, weights)``;
        returns name -> float32 ``[bags, dim]``, as :meth:`Table.lookup_sum` would.
        """
        code = _arrays.mode_code(mode)
        names = list(features)
        impls = []
        checked: list[tuple[Any, ...]] = []
        for name, feature in features.items():
            table = self._table(name)
            if not isinstance(feature, tuple) or len(feature) not in (2, 3):
                msg = f"features[{name!r}] must be (keys, offsets) or (keys, offsets, weights)"
                raise ValueError(msg)
            k = _arrays.as_keys(feature[0])
            off = _arrays.as_offsets(feature[1])
            impls.append(table._live())
            w = _arrays.as_weights(feature[2], k.shape[0]) if len(feature) == 3 else None
            checked.append((k, off) if w is None else (k, off, w))
        outs = _core.group_lookup_sum(impls, checked, code, bool(insert), names)
        if insert:  # only inserts evict
            self._deliver_evicted(names)
        return dict(zip(names, outs))

    def apply_gradients(self, grads: Mapping[str, tuple[Any, ...]], *, mode: str = "sum") -> None:
        """Apply the backward of :meth:`lookup_sum` to several tables in one call.

        ``grads`` maps a table name to ``(keys, offsets, grads)`` or
        ``(keys, offsets, grads, weights)`` with grads float32 ``[bags, dim]``.
        """
        code = _arrays.mode_code(mode)
        names = list(grads)
        impls = []
        checked: list[tuple[Any, ...]] = []
        for name, entry in grads.items():
            table = self._table(name)
            if not isinstance(entry, tuple) or len(entry) not in (3, 4):
                msg = (
                    f"grads[{name!r}] must be (keys, offsets, grads) or "
                    "(keys, offsets, grads, weights)"
                )
                raise ValueError(msg)
            k = _arrays.as_keys(entry[0])
            off = _arrays.as_offsets(entry[1])
            impls.append(table._live())
            g = _arrays.as_grads(entry[2], off.shape[0] - 1, table.dim, "one row per bag")
            w = _arrays.as_weights(entry[3], k.shape[0]) if len(entry) == 4 else None
            checked.append((k, off, g) if w is None else (k, off, g, w))
        _core.group_apply_gradients(impls, checked, code, names)
        self._deliver_evicted(names)
