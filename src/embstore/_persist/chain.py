"""A checkpoint chain (a full checkpoint and the deltas that follow it): opening and checking
it, and choosing which rows of which file make the loaded table."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from embstore._persist.header import SavedTable
from embstore.checkpoint import CheckpointError, CheckpointReader

U64Array = npt.NDArray[np.uint64]


def open_chain(
    base: str | os.PathLike[str], deltas: Sequence[str | os.PathLike[str]]
) -> tuple[list[CheckpointReader], list[SavedTable]]:
    readers: list[CheckpointReader] = []
    try:
        for p in [base, *deltas]:
            readers.append(CheckpointReader(p))
        configs = [SavedTable(r) for r in readers]
        if readers[0].kind != "full":
            msg = f"{readers[0].path}: a delta checkpoint, not a full one (pass it in deltas=)"
            raise CheckpointError(msg)
        for k in range(1, len(readers)):
            r, prev = readers[k], readers[k - 1]
            if r.kind != "delta":
                msg = f"{r.path}: a full checkpoint, not a delta (deltas must be deltas)"
                raise CheckpointError(msg)
            if r.parent_id != prev.checkpoint_id:
                msg = (
                    f"{r.path}: this delta follows checkpoint {r.parent_id}, not {prev.path} "
                    f"({prev.checkpoint_id}): the chain does not fit (wrong order, a missing "
                    "delta, or a delta of another table)"
                )
                raise CheckpointError(msg)
            if not configs[k].same_table_shape(configs[0]):
                msg = f"{r.path}: a delta of a table of another shape than {readers[0].path}"
                raise CheckpointError(msg)
    except BaseException:
        for r in readers:
            r.close()
        raise
    return readers, configs


def _scan_ids(
    r: CheckpointReader, scratch: np.ndarray
) -> tuple[U64Array, npt.NDArray[np.uint32], U64Array]:
    """Pre-pass over one file: its row ids, last steps and removed ids (every section is
    checked; rows are only checksummed)."""
    ids: list[np.ndarray] = []
    steps: list[np.ndarray] = []
    removed: list[np.ndarray] = []
    for sec in r.sections():
        if sec.name == "ids":
            ids.append(r.read_payload(sec))
        elif sec.name == "last_step":
            steps.append(r.read_payload(sec))
        elif sec.name == "removed":
            removed.append(r.read_payload(sec))
        else:
            r.skip_payload(sec, scratch)
    cat = np.concatenate
    return (
        cat(ids) if ids else np.zeros(0, np.uint64),
        cat(steps) if steps else np.zeros(0, np.uint32),
        cat(removed) if removed else np.zeros(0, np.uint64),
    )


def select(
    readers: list[CheckpointReader], capacity: int, keep: str | None
) -> tuple[list[npt.NDArray[np.bool_]], bool]:
    """Which rows of each file make the final table: the last version of every id that no
    later delta removes, and with keep="recent" at most ``capacity`` of them (largest last
    step first; ties in file order). Returns per-file masks and whether rows were dropped.
    """
    scratch = np.empty(1 << 20, dtype=np.uint8)
    ev_ids: list[np.ndarray] = []
    ev_seq: list[np.ndarray] = []
    ev_file: list[np.ndarray] = []
    ev_pos: list[np.ndarray] = []
    ev_step: list[np.ndarray] = []
    seq = 0
    sizes = []
    for f, r in enumerate(readers):
        ids, steps, removed = _scan_ids(r, scratch)
        if steps.shape[0] != ids.shape[0] or ids.shape[0] != r.num_rows:
            raise r.error("corrupted (ids and last steps differ in length)")
        sizes.append(ids.shape[0])
        r.close()
        # Within a file, removals come before rows (an id removed then re-inserted).
        for arr, pos, st in (
            (
                removed,
                np.full(removed.shape[0], -1, np.int64),
                np.zeros(removed.shape[0], np.uint32),
            ),
            (ids, np.arange(ids.shape[0], dtype=np.int64), steps),
        ):
            ev_ids.append(arr)
            ev_seq.append(np.arange(seq, seq + arr.shape[0], dtype=np.int64))
            ev_file.append(np.full(arr.shape[0], f, np.int32))
            ev_pos.append(pos)
            ev_step.append(st)
            seq += arr.shape[0]
    all_ids = np.concatenate(ev_ids)
    all_seq = np.concatenate(ev_seq)
    order = np.lexsort((all_seq, all_ids))
    sorted_ids = all_ids[order]
    last = np.ones(order.shape[0], dtype=bool)
    if order.shape[0] > 1:
        last[:-1] = sorted_ids[1:] != sorted_ids[:-1]
    final = order[last]  # the last event of each id
    pos = np.concatenate(ev_pos)[final]
    live = pos >= 0
    final = final[live]
    pos = pos[live]
    files = np.concatenate(ev_file)[final]
    dropped = False
    if keep == "recent" and final.shape[0] > capacity:
        steps_all = np.concatenate(ev_step)[final]
        seqs = all_seq[final]
        # Largest last step first; ties by file order (the event sequence).
        pick = np.lexsort((seqs, -steps_all.astype(np.int64)))[:capacity]
        files, pos = files[pick], pos[pick]
        dropped = True
    masks = [np.zeros(n, dtype=bool) for n in sizes]
    for f in range(len(readers)):
        masks[f][pos[files == f]] = True
    return masks, dropped
