"""TableGroup: several named tables driven by one call per batch.

All fields of a batch cross into C++ once; the core spreads every (table, shard) of the
batch over its worker threads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
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
            raise _arrays.unknown_table(name, self.names) from None

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

    @classmethod
    def load_sharded(cls, directory: str | os.PathLike[str]) -> TableGroup:
        """Every shard of a :class:`embstore.ray.ShardedTableGroup` checkpoint merged into
        one in-process group (each table at its total capacity). Needs no Ray."""
        from embstore.ray.store import load_sharded

        return load_sharded(directory)

    def set_step(self, step: int) -> None:
        """``Table.set_step(step)`` on every table of the group."""
        for table in self._tables.values():
            table.set_step(step)

    def stats(self) -> dict[str, dict[str, Any]]:
        """``Table.stats()`` of every table, by name (a group call's latency is recorded into
        each table it touches)."""
        return {name: table.stats() for name, table in self._tables.items()}

    def _live_impls(self, names: Iterable[str]) -> list[_core.Table] | None:
        """The open tables' cores for ``names``, or None if a name is unknown or its table
        closed (the caller's checked path then raises the error that says so)."""
        impls = []
        for name in names:
            table = self._tables.get(name)
            impl = None if table is None else table._impl
            if impl is None:
                return None
            impls.append(impl)
        return impls

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
        names, given = list(features), list(features.values())
        impls = self._live_impls(names)
        # Arrays already in the core's dtypes and layout go straight to it (W4: 8% of a
        # call's time was this loop in Python); the core returns None for anything else.
        outs = None
        if impls is not None:
            outs = _core.group_lookup_sum(impls, given, code, bool(insert), names)
        if outs is None:
            impls = []
            checked: list[tuple[Any, ...]] = []
            for name, feature in zip(names, given):
                table = self._table(name)
                checked.append(_arrays.group_feature(name, feature))
                impls.append(table._live())
            outs = _core.group_lookup_sum(impls, checked, code, bool(insert), names)
            if outs is None:
                raise _not_taken(checked)
        if insert:  # only inserts evict
            self._deliver_evicted(names)
        return dict(zip(names, outs))

    def apply_gradients(self, grads: Mapping[str, tuple[Any, ...]], *, mode: str = "sum") -> None:
        """Apply the backward of :meth:`lookup_sum` to several tables in one call.

        ``grads`` maps a table name to ``(keys, offsets, grads)`` or
        ``(keys, offsets, grads, weights)`` with grads float32 ``[bags, dim]``.
        """
        code = _arrays.mode_code(mode)
        names, given = list(grads), list(grads.values())
        impls = self._live_impls(names)
        applied = impls is not None and _core.group_apply_gradients(impls, given, code, names)
        if not applied:
            impls = []
            checked: list[tuple[Any, ...]] = []
            for name, entry in zip(names, given):
                table = self._table(name)
                checked.append(_arrays.group_grads(name, entry, table.dim))
                impls.append(table._live())
            if not _core.group_apply_gradients(impls, checked, code, names):
                raise _not_taken(checked)
        self._deliver_evicted(names)


def _not_taken(checked: list[tuple[Any, ...]]) -> RuntimeError:
    """The error for converted arrays the core still refused: a bug in embstore, not in the
    caller's input (nothing ran)."""
    forms = [tuple((a.dtype.str, a.shape, a.flags.c_contiguous) for a in f) for f in checked]
    return RuntimeError(f"embstore internal error: the core refused converted arrays {forms}")
