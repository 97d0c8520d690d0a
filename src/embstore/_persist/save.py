"""Saving: save, save_delta and group saves, written by the C++ core
(``_core.checkpoint_save`` / ``checkpoint_save_group``; the core keeps each table's chain)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from embstore import _core
from embstore._internals import TableInternals


def signed_padding(padding_id: int | None) -> int | None:
    """``padding_id`` as the int64 the core records (the same 64 bits)."""
    if padding_id is None or padding_id < 2**63:
        return padding_id
    return padding_id - 2**64


def _make_parent_directory(path: str) -> None:
    """Creates the directory a checkpoint file goes into, as a group save does."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)


def save(t: TableInternals, path: str | os.PathLike[str], *, delta: bool) -> str:
    """``Table.save`` / ``Table.save_delta``: returns the new checkpoint id."""
    impl = t.live()
    path = os.fspath(path)
    _make_parent_directory(path)
    spec = t.spec
    return _core.checkpoint_save(
        impl,
        path,
        delta=delta,
        name=spec.name,
        num_threads=spec.num_threads,
        padding_id=signed_padding(spec.padding_id),
    )


def save_group(tables: Mapping[str, TableInternals], directory: str | os.PathLike[str]) -> None:
    """``TableGroup.save``: one checkpoint file per table and a manifest, written last
    (atomically): the manifest names the files, so a crash before it is renamed leaves the
    previous group checkpoint whole. Unreferenced files of older saves are removed after."""
    directory = os.fspath(directory)
    items = [(name, t.live()) for name, t in tables.items()]
    labels = [(t.spec.num_threads, signed_padding(t.spec.padding_id)) for t in tables.values()]
    _core.checkpoint_save_group(items, directory, labels=labels)
