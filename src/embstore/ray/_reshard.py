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
import json
import os
import re
import shutil
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from embstore import _core, _persist
from embstore.checkpoint import CheckpointError, CheckpointReader, read_header, write_atomic
from embstore.group import TableGroup
from embstore.ray.spec import TableSpec
from embstore.table import Table

__all__ = ["ROUTE", "Source", "load_shard", "open_source", "route_ids", "write_manifest"]

FORMAT = "embstore.sharded"
VERSION = 1
MANIFEST = "MANIFEST.json"
#: The route function's name, recorded in every manifest (a new function is a new version).
ROUTE = "splitmix64-salted-mulshift"
SALT = int(_core.ROUTE_SALT)
_SHARD_DIR = re.compile(r"^shard-\d{5}-of-\d{5}\.[0-9a-f]{12}$")


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


def _read_json_manifest(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw.decode())
        body = manifest["body"]
        text = json.dumps(body, sort_keys=True)
        if zlib.crc32(text.encode()) & 0xFFFFFFFF != manifest["crc32"]:
            raise ValueError("checksum")
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
    return Source(directory, len(dirs), dirs, step, caps, int(route["salt"], 16))


def write_manifest(
    directory: str,
    shard_dirs: list[str],
    capacities: Mapping[str, int],
    step: int | None,
) -> None:
    """Commits a save: writes the manifest atomically, then removes shard directories of
    older saves (any not named now)."""
    body = {
        "format": FORMAT,
        "version": VERSION,
        "route": {"function": ROUTE, "salt": f"{SALT:#018x}", "num_shards": len(shard_dirs)},
        "shards": shard_dirs,
        "capacities": dict(capacities),
        "step": step,
    }
    text = json.dumps(body, sort_keys=True)
    manifest = {"body": body, "crc32": zlib.crc32(text.encode()) & 0xFFFFFFFF}
    write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest).encode())
    keep = set(shard_dirs)
    for name in os.listdir(directory):
        if _SHARD_DIR.match(name) and name not in keep:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def specs_of(source: Source) -> dict[str, TableSpec]:
    """Table specs from a checkpoint: the first shard's headers, each table's total capacity."""
    specs: dict[str, TableSpec] = {}
    for name, path in _group_files(source.shard_dirs[0]).items():
        with CheckpointReader(path) as r:
            cfg = _persist._Config(r)
        specs[name] = TableSpec(
            dim=cfg.dim,
            capacity=source.capacities[name],
            optimizer=cfg.optimizer,
            initializer=cfg.initializer,
            eviction=cfg.eviction,
            num_threads=cfg.num_threads,
            admission=cfg.admission,
        )
    return specs


def load_shard(
    source: Source, specs: Mapping[str, TableSpec], shard: int, num_shards: int
) -> TableGroup:
    """Shard ``shard`` of ``num_shards``'s tables from ``source``: its own directory when
    the shard count is unchanged, else its rows streamed out of every old shard."""
    if num_shards == source.num_shards:
        return TableGroup.load(source.shard_dirs[shard])
    if source.salt != SALT:
        msg = f"{source.directory}: saved with route salt {source.salt:#x}, cannot re-route"
        raise CheckpointError(msg)
    per_shard = [_group_files(d) for d in source.shard_dirs]
    tables: dict[str, Table] = {}
    try:
        for name in per_shard[0]:
            paths = [files[name] for files in per_shard]
            spec = specs[name]
            tables[name] = _load_filtered(paths, spec, name, shard, num_shards)
    except BaseException:
        for t in tables.values():
            t.close()
        raise
    return TableGroup(tables)


def _load_filtered(paths: list[str], spec: TableSpec, name: str, shard: int, n: int) -> Table:
    """A table of the rows routed to ``shard`` of ``n`` out of full checkpoints ``paths``,
    streamed one chunk at a time (admission counters start empty: the sketch is per shard)."""
    table: Table | None = None
    try:
        step, tracking = 0, False
        for path in paths:
            with CheckpointReader(path) as r:
                cfg = _persist._Config(r)
                if r.kind != "full":
                    raise r._error("a sharded checkpoint's shards must be full checkpoints")
                if table is None:
                    table = dataclasses.replace(
                        spec,
                        optimizer=cfg.optimizer,
                        initializer=cfg.initializer,
                        num_shards=None,
                        name=name,
                    ).build(n, name)
                elif cfg.dim != table.dim or type(cfg.optimizer) is not type(table.optimizer):
                    raise r._error(f"table {name!r} differs from the other shards' ({paths[0]})")
                tracking = tracking or cfg.step_tracking
                step = max(step, cfg.step)
                _import_routed(table, r, cfg.row_width, shard, n)
        assert table is not None
        if tracking:
            table.set_step(step)
        return table
    except BaseException:
        if table is not None:
            table.close()
        raise


def _import_routed(table: Table, r: CheckpointReader, width: int, shard: int, n: int) -> None:
    impl = table._live()
    seen = 0
    with contextlib.closing(_persist._prefetch_groups(r, width)) as items:
        for item in items:
            if isinstance(item, tuple):  # a sketch section: not carried over
                continue
            buf, count = item.buffers, item.n
            ids = buf.ids[:count]
            keep = route_ids(ids, n) == shard if n > 1 else np.ones(count, dtype=bool)
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
        raise r._error("corrupted (row count differs from the trailer)")
