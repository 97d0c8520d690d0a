"""Sharded checkpoints: the top-level manifest (the commit point) and loading a shard's
rows from a checkpoint saved with any number of shards.

Layout of a sharded checkpoint directory::

    MANIFEST.json                           {"body": {"format": "embstore.sharded", ...},
                                             "crc32": ...}, written last, atomically
    shard-00000-of-00002.<save id>/         an ordinary TableGroup checkpoint
    shard-00001-of-00002.<save id>/

Every save writes new shard directories, so a crash before the manifest's rename leaves
the previous manifest and the directories it names untouched. A plain TableGroup
checkpoint directory loads as a checkpoint of one shard.

Loading with a different shard count streams every old file chunk by chunk and imports only
the rows whose route is the new shard's (no shard ever holds rows it drops beyond a chunk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from embstore import _core
from embstore._persist import chain as _chain
from embstore._persist import header as _header
from embstore._persist import load as _load
from embstore._persist import read as _read
from embstore._persist.manifest import seal, unseal
from embstore.checkpoint import CheckpointError, CheckpointReader, read_header, write_atomic
from embstore.spec import TableSpec
from embstore.table import Table

__all__ = ["ROUTE", "Source", "load_shard", "open_source", "route_ids", "write_manifest"]

FORMAT = "embstore.sharded"
VERSION = 1
MANIFEST = "MANIFEST.json"
DELTA = "DELTA.json"
DELTA_FORMAT = "embstore.shard-delta"
#: The route function's name, recorded in every manifest (a new function is a new version).
ROUTE = "splitmix64-salted-mulshift"
SALT = int(_core.ROUTE_SALT)
_SHARD_DIR = re.compile(r"^shard-\d{5}-of-\d{5}\.[0-9a-f]{12}$")


#: Extra capacity each shard gets over its equal share (hash imbalance of the route).
SLACK = 0.02


def shard_capacity(spec: TableSpec, num_shards: int) -> int:
    """The capacity of one shard's slice of ``spec`` among ``num_shards``: an equal share
    of ``spec.capacity`` (the table's total) plus :data:`SLACK` and a few standard
    deviations of the route's imbalance."""
    if num_shards == 1:
        return spec.capacity
    share = spec.capacity / num_shards
    rows = math.ceil(share * (1 + SLACK) + 4 * math.sqrt(share) + 16)
    return min(spec.capacity, rows)


def build_shard(spec: TableSpec, num_shards: int, name: str) -> Table:
    """A Table for one shard's slice of ``spec`` among ``num_shards`` (named ``name``
    unless the spec names it)."""
    capacity = shard_capacity(spec, num_shards)
    shards = spec.num_shards
    if shards is not None and shards > capacity:
        shards = None
    return Table.from_spec(
        dataclasses.replace(
            spec,
            capacity=capacity,
            num_shards=shards,
            name=name if spec.name is None else spec.name,
        )
    )


def route_ids(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each id among ``num_shards`` (uint32)."""
    out: np.ndarray = _core.route_ids(np.ascontiguousarray(ids, np.uint64), num_shards, SALT)
    return out


def shard_dir_name(shard: int, num_shards: int, save_id: str) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.{save_id[:12]}"


@dataclasses.dataclass(frozen=True)
class Source:
    """A committed checkpoint: its shard count and one TableGroup directory per shard."""

    directory: str
    num_shards: int
    shard_dirs: tuple[str, ...]
    step: int | None
    capacities: Mapping[str, int]  # each table's total capacity
    salt: int = SALT
    deltas: tuple[tuple[str, ...], ...] = ()  # per save_delta, one directory per shard


def _write_json_manifest(path: str, body: dict[str, Any]) -> None:
    write_atomic(path, seal(body))


def _read_json_manifest(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        body = unseal(raw)
        if not isinstance(body, dict):
            raise TypeError("body")
        return body
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        msg = f"{path}: not an embstore manifest, or corrupted ({e})"
        raise CheckpointError(msg) from None


def _group_files(directory: str) -> dict[str, str]:
    """name -> checkpoint file of a TableGroup directory, in the group's order."""
    body = _read_json_manifest(os.path.join(directory, MANIFEST))
    try:
        return {str(n): os.path.join(directory, body["tables"][n]["file"]) for n in body["order"]}
    except (KeyError, TypeError) as e:
        msg = f"{directory}: bad group manifest ({e!r})"
        raise CheckpointError(msg) from None


def open_source(directory: str | os.PathLike[str]) -> Source:
    """The committed checkpoint in ``directory``: sharded, or a plain TableGroup one."""
    directory = os.fspath(directory)
    body = _read_json_manifest(os.path.join(directory, MANIFEST))
    if body.get("format") == "embstore.group":
        files = _group_files(directory)
        caps = {n: int(read_header(p)["table"]["capacity"]) for n, p in files.items()}
        return Source(directory, 1, (directory,), None, caps)
    if body.get("format") != FORMAT:
        msg = f"{directory}: not a sharded or group checkpoint ({body.get('format')!r})"
        raise CheckpointError(msg)
    if body.get("version") != VERSION:
        msg = f"{directory}: unsupported sharded format version {body.get('version')}"
        raise CheckpointError(msg)
    route = body["route"]
    if route.get("function") != ROUTE:
        msg = f"{directory}: unknown route function {route.get('function')!r}"
        raise CheckpointError(msg)
    dirs = tuple(os.path.join(directory, d) for d in body["shards"])
    if len(dirs) != int(route["num_shards"]):
        msg = f"{directory}: the manifest names {len(dirs)} shards, its route {route}"
        raise CheckpointError(msg)
    step = body.get("step")
    caps = {str(n): int(c) for n, c in body["capacities"].items()}
    deltas = tuple(
        tuple(os.path.join(directory, d) for d in save) for save in body.get("deltas", [])
    )
    if any(len(save) != len(dirs) for save in deltas):
        msg = f"{directory}: a delta save of the manifest does not have {len(dirs)} shards"
        raise CheckpointError(msg)
    return Source(directory, len(dirs), dirs, step, caps, int(route["salt"], 16), deltas)


def write_manifest(
    directory: str,
    shard_dirs: list[str],
    capacities: Mapping[str, int],
    step: int | None,
    deltas: list[list[str]] | None = None,
) -> None:
    """Commits a save: writes the manifest atomically, then removes shard directories of
    older saves (any not named now)."""
    body = {
        "format": FORMAT,
        "version": VERSION,
        "route": {"function": ROUTE, "salt": f"{SALT:#018x}", "num_shards": len(shard_dirs)},
        "shards": shard_dirs,
        "deltas": deltas or [],
        "capacities": dict(capacities),
        "step": step,
    }
    _write_json_manifest(os.path.join(directory, MANIFEST), body)
    keep = set(shard_dirs).union(*(deltas or []))
    for name in os.listdir(directory):
        if _SHARD_DIR.match(name) and name not in keep:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def read_body(directory: str) -> dict[str, Any] | None:
    """The committed sharded manifest's body in ``directory``, or None if there is none."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    body = _read_json_manifest(path)
    return body if body.get("format") == FORMAT else None


def manifest_key(body: dict[str, Any]) -> tuple[Any, ...]:
    """What tells one committed sharded checkpoint from another in the same directory: its
    shard directories and delta directories (each save names new ones)."""
    return (tuple(body["shards"]), tuple(tuple(d) for d in body.get("deltas", [])))


def committed_step(directory: str | None) -> int | None:
    """The step of the checkpoint committed in ``directory``, or None (none there)."""
    if directory is None or not os.path.exists(os.path.join(directory, MANIFEST)):
        return None
    try:
        return open_source(directory).step
    except CheckpointError:
        return None


def save_delta_files(group: Mapping[str, Table], directory: str) -> None:
    """One shard's ``save_delta``: each table's delta in ``directory``, named by DELTA.json
    (written last, atomically)."""
    os.makedirs(directory, exist_ok=True)
    files = {}
    for k, (name, table) in enumerate(group.items()):
        fname = f"t{k:03d}-delta.ckpt"
        table.save_delta(os.path.join(directory, fname))
        files[name] = fname
    _write_json_manifest(os.path.join(directory, DELTA), {"format": DELTA_FORMAT, "tables": files})


def _delta_files(directory: str) -> dict[str, str]:
    body = _read_json_manifest(os.path.join(directory, DELTA))
    if body.get("format") != DELTA_FORMAT:
        msg = f"{directory}: not a shard delta ({body.get('format')!r})"
        raise CheckpointError(msg)
    return {str(n): os.path.join(directory, f) for n, f in body["tables"].items()}


def specs_of(source: Source) -> dict[str, TableSpec]:
    """Table specs from a checkpoint: the first shard's headers, each table's total capacity."""
    specs: dict[str, TableSpec] = {}
    for name, path in _group_files(source.shard_dirs[0]).items():
        with CheckpointReader(path) as r:
            cfg = _header.SavedTable(r)
        specs[name] = TableSpec(
            dim=cfg.dim,
            capacity=source.capacities[name],
            optimizer=cfg.optimizer,
            initializer=cfg.initializer,
            eviction=cfg.eviction,
            num_threads=cfg.num_threads,
            admission=cfg.admission,
            padding_id=cfg.padding_id,
        )
    return specs


def load_shard(
    source: Source, specs: Mapping[str, TableSpec], shard: int, num_shards: int
) -> dict[str, Table]:
    """Shard ``shard`` of ``num_shards``'s tables from ``source``: its own files when the
    shard count is unchanged, else its rows streamed out of every old shard's files."""
    if num_shards == source.num_shards and not source.deltas:
        loaded = _load.load_group(source.shard_dirs[shard], None)
        return {name: Table._from_internals(t) for name, t in loaded.items()}
    if num_shards != source.num_shards and source.salt != SALT:
        msg = f"{source.directory}: saved with route salt {source.salt:#x}, cannot re-route"
        raise CheckpointError(msg)
    chains = [_chains(source, j) for j in range(source.num_shards)]
    tables: dict[str, Table] = {}
    try:
        for name in chains[0]:
            if num_shards == source.num_shards:
                base, *deltas = chains[shard][name]
                tables[name] = Table.load(base, deltas, name=name)
            else:
                paths = [c[name] for c in chains]
                tables[name] = _load_filtered(paths, specs[name], name, shard, num_shards)
    except BaseException:
        for t in tables.values():
            t.close()
        raise
    return tables


def _chains(source: Source, old_shard: int) -> dict[str, list[str]]:
    """name -> [full checkpoint, deltas...] of one old shard."""
    chains = {n: [p] for n, p in _group_files(source.shard_dirs[old_shard]).items()}
    for save in source.deltas:
        for name, path in _delta_files(save[old_shard]).items():
            chains[name].append(path)
    return chains


def _load_filtered(
    chains: list[list[str]], spec: TableSpec, name: str, shard: int, n: int
) -> Table:
    """A table of the rows routed to ``shard`` of ``n`` out of every old shard's chain (a
    full checkpoint and its deltas), streamed one chunk at a time (admission counters start
    empty: the sketch is per shard)."""
    table: Table | None = None
    try:
        step, tracking = 0, False
        for chain in chains:
            readers, configs = _chain.open_chain(chain[0], chain[1:])
            masks: list[Any] = [None] * len(readers)
            if len(readers) > 1:  # the rows no later delta replaces or removes
                masks, _ = _chain.select(readers, 2**63, None)
                readers = [CheckpointReader(r.path) for r in readers]
            try:
                cfg = configs[-1]
                if table is None:
                    table = build_shard(
                        dataclasses.replace(
                            spec,
                            optimizer=cfg.optimizer,
                            initializer=cfg.initializer,
                            num_shards=None,
                            name=name,
                        ),
                        n,
                        name,
                    )
                elif cfg.dim != table.dim or type(cfg.optimizer) is not type(table.optimizer):
                    raise readers[0].error(f"table {name!r} differs from the other shards'")
                tracking = tracking or cfg.step_tracking
                step = max(step, cfg.step)
                for r, mask in zip(readers, masks, strict=True):
                    _import_routed(table, r, cfg.row_width, shard, n, mask)
            finally:
                for r in readers:
                    r.close()
        assert table is not None
        if tracking:
            table.set_step(step)
        return table
    except BaseException:
        if table is not None:
            table.close()
        raise


def _import_routed(
    table: Table, r: CheckpointReader, width: int, shard: int, n: int, mask: Any
) -> None:
    impl = table._internals().live()
    seen = 0
    with contextlib.closing(_read.prefetch_groups(r, width)) as items:
        for item in items:
            if isinstance(item, tuple):  # a sketch section: not carried over
                continue
            buf, count = item.buffers, item.n
            ids = buf.ids[:count]
            keep = route_ids(ids, n) == shard if n > 1 else np.ones(count, dtype=bool)
            if mask is not None:
                keep &= mask[seen : seen + count]
            seen += count
            kept = int(keep.sum())
            if kept:
                stored = int(
                    impl.import_rows(
                        ids=ids[keep],
                        rows=np.ascontiguousarray(buf.rows[:count][keep]),
                        steps=buf.steps[:count][keep],
                        restore=True,
                        placed=None,
                    )
                )
                if stored != kept:
                    msg = (
                        f"{r.path}: {kept - stored} rows of table {table.name!r} did not fit "
                        f"shard {shard} of {n} (capacity {table.capacity})"
                    )
                    raise _core.CapacityError(msg)
            item.release()
    if seen != r.num_rows:
        raise r.error("corrupted (row count differs from the trailer)")
