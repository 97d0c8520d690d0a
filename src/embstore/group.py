"""TableGroup: several named tables driven by one call per batch.

All fields of a batch cross into C++ once; the core spreads every (table, shard) of the
batch over its worker threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _arrays, _core, _padding, _sharded
from embstore._arrays import (
    INT64_DTYPE,
    KEY_DTYPES,
    NDARRAY,
    STRIDES_8,
    apply_entry,
    as_is_grads,
    as_is_weights,
    lookup_entry,
    named_entry,
)
from embstore._persist import load as _load
from embstore._persist import save as _save
from embstore.table import Table

__all__ = ["TableGroup"]


class TableGroup(Mapping[str, Table]):
    """A mapping of names to :class:`Table` with batched multi-table operations.

    Parameters
    ----------
    tables : Mapping[str, Table]
        The tables by name. The group holds references; closing a table closes it for
        the group too.

    Notes
    -----
    A group pickles with its tables (see :class:`Table` on what a pickle holds, and when
    to prefer the streamed :meth:`save` / :meth:`load`).
    """

    def __init__(self, tables: Mapping[str, Table]) -> None:
        _arrays.check_tables(tables, Table, lambda t: type(t).__name__)
        self._tables: dict[str, Table] = dict(tables)
        self._states = {name: table._internals() for name, table in self._tables.items()}
        # Tables with a padding id: their batches lose it before the core call.
        self._padding = {
            name: s.padding_key for name, s in self._states.items() if s.padding_key is not None
        }
        for name, state in self._states.items():
            state.adopt_name(name)  # an unnamed table takes the group's name
        # Tables with an on_evict callback: the only ones a call must hand evicted rows to.
        self._evicting = {n for n, s in self._states.items() if s.spec.on_evict is not None}

    def __reduce__(self) -> tuple[Any, ...]:
        return (TableGroup, (self._tables,))

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
        if not self._evicting:
            return
        for name in names:  # each table's on_evict, after the whole call (no locks held)
            if name in self._evicting:
                self._states[name].deliver_evicted()

    def _direct(
        self, entries: Any, what: str
    ) -> tuple[list[str], list[_core.Table], list[Any]] | None:
        """The names, cores and entries (taken by name: a dict subclass may iterate in
        another order) of a call that may go to the core as it is: every table known and
        open, none with a padding id. The core then checks the entries' formats itself (the
        per-table checks in Python cost more than the call at W5's sizes)."""
        names = _arrays.entry_names(entries, what)
        if self._padding:
            return None
        cores = []
        states = self._states
        for name in names:
            state = states.get(name)
            core = None if state is None else state.core
            if core is None:
                return None
            cores.append(core)
        return names, cores, [entries[n] for n in names]

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Checkpoint every table into ``directory`` (created if needed): one file per table
        and a ``MANIFEST.json`` written last, atomically, that names them. A crash at any
        moment leaves the previous group checkpoint in ``directory`` loadable; files of
        older saves are removed once the new manifest is in place. Each table is a
        point-in-time snapshot (see :meth:`Table.save`); the snapshots of all tables begin
        back to back before any is written."""
        _save.save_group({n: t._internals() for n, t in self._tables.items()}, directory)

    @classmethod
    def load(
        cls, directory: str | os.PathLike[str], *, num_threads: int | None = None
    ) -> TableGroup:
        """The group saved in ``directory`` by :meth:`save` (``num_threads`` overrides every
        table's). Raises :class:`~embstore.CheckpointError` if any file is bad."""
        loaded = _load.load_group(directory, num_threads)
        return cls({name: Table._from_internals(t) for name, t in loaded.items()})

    @classmethod
    def load_sharded(cls, directory: str | os.PathLike[str]) -> TableGroup:
        """Every shard of a :class:`embstore.ray.ShardedTableGroup` checkpoint merged into
        one in-process group (each table at its total capacity). Needs no Ray."""
        source = _sharded.open_source(directory)
        return cls(_sharded.load_shard(source, _sharded.specs_of(source), 0, 1))

    def set_step(self, step: int) -> None:
        """``Table.set_step(step)`` on every table of the group."""
        for table in self._tables.values():
            table.set_step(step)

    def stats(self) -> dict[str, dict[str, Any]]:
        """``Table.stats()`` of every table, by name (a group call's latency is recorded into
        each table it touches)."""
        return {name: table.stats() for name, table in self._tables.items()}

    def _converted(
        self, name: str, entry: Any, what: str, convert: Callable[[Any, int], tuple[Any, ...]]
    ) -> tuple[_core.Table, tuple[Any, ...]]:
        """A table's core and its entry converted to the core's formats, or the error that
        names the table and the argument ``what``."""
        table = self._table(name)
        try:
            core = table._internals().live()
        except ValueError as e:
            raise ValueError(f"table {name!r}: {what}[{name!r}]: {e}") from None
        return core, named_entry(name, entry, table.dim, what, convert)

    def lookup_entries(
        self, features: Any
    ) -> tuple[list[str], list[_core.Table], list[tuple[Any, ...]]]:
        """Each named table's core and its ``features`` entry in the core's formats.

        An entry already in them goes as it is: the check is spelled out inline because it
        runs for every table of every call. Any other entry is converted; every check runs
        before the core is called, so a bad entry changes nothing."""
        names = _arrays.entry_names(features, "features")
        impls: list[_core.Table] = []
        batches: list[tuple[Any, ...]] = []
        states = self._states
        for name in names:  # entries by name: a mapping may iterate apart from items()
            entry = features[name]
            state = states.get(name)
            core = None if state is None else state.core
            if core is not None and type(entry) is tuple and 2 <= len(entry) <= 3:
                k, off = entry[0], entry[1]
                w = entry[2] if len(entry) == 3 else None
                if (
                    type(k) is NDARRAY
                    and k.dtype in KEY_DTYPES
                    and k.strides == STRIDES_8
                    and type(off) is NDARRAY
                    and off.dtype in INT64_DTYPE
                    and off.strides == STRIDES_8
                    and off.shape[0] > 0
                    and (w is None or as_is_weights(w, k.shape[0]))
                ):
                    impls.append(core)
                    batches.append(entry)
                    continue
            core, batch = self._converted(name, entry, "features", lookup_entry)
            impls.append(core)
            batches.append(batch)
        if self._padding:
            self._drop_padding(names, batches, grads=False)
        return names, impls, batches

    def apply_entries(
        self, grads: Any
    ) -> tuple[list[str], list[_core.Table], list[tuple[Any, ...]]]:
        """As :meth:`lookup_entries`, for ``grads`` entries."""
        names = _arrays.entry_names(grads, "grads")
        impls: list[_core.Table] = []
        batches: list[tuple[Any, ...]] = []
        states = self._states
        for name in names:  # by name, as in lookup_entries
            entry = grads[name]
            state = states.get(name)
            core = None if state is None else state.core
            if (
                core is not None
                and state is not None
                and type(entry) is tuple
                and 3 <= len(entry) <= 4
                and as_is_grads(entry, state.spec.dim)
            ):
                impls.append(core)
                batches.append(entry)
                continue
            core, batch = self._converted(name, entry, "grads", apply_entry)
            impls.append(core)
            batches.append(batch)
        if self._padding:
            self._drop_padding(names, batches, grads=True)
        return names, impls, batches

    def _drop_padding(
        self, names: list[str], batches: list[tuple[Any, ...]], *, grads: bool
    ) -> None:
        """Removes padding ids from the (checked) batches of tables that have one."""
        for i, name in enumerate(names):
            pad = self._padding.get(name)
            if pad is not None:
                batches[i] = _padding.drop_from_entry(pad, batches[i], grads)

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
        A bad entry raises an error naming its table, and no table changes.
        """
        code = _arrays.mode_code(mode)
        direct = self._direct(features, "features")
        outs = None
        if direct is not None:  # entries already in the core's formats: no copies, no checks
            names, cores, values = direct
            outs = _core.group_lookup_sum(cores, values, code, bool(insert), names, False)
        if outs is None:
            names, impls, batches = self.lookup_entries(features)
            outs = _core.group_lookup_sum(impls, batches, code, bool(insert), names)
        if insert:  # only inserts evict
            self._deliver_evicted(names)
        return dict(zip(names, outs, strict=True))

    def apply_gradients(self, grads: Mapping[str, tuple[Any, ...]], *, mode: str = "sum") -> None:
        """Apply the backward of :meth:`lookup_sum` to several tables in one call.

        ``grads`` maps a table name to ``(keys, offsets, grads)`` or
        ``(keys, offsets, grads, weights)`` with grads float32 ``[bags, dim]``.
        A bad entry raises an error naming its table, and no table changes.
        """
        code = _arrays.mode_code(mode)
        direct = self._direct(grads, "grads")
        done = False
        if direct is not None:  # as in lookup_sum
            names, cores, values = direct
            done = _core.group_apply_gradients(cores, values, code, names, False)
        if not done:
            names, impls, batches = self.apply_entries(grads)
            _core.group_apply_gradients(impls, batches, code, names)
        self._deliver_evicted(names)
