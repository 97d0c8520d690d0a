"""Export and import: every row of a table as numpy arrays, and back (also the payload of
a pickled table)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _arrays, _core
from embstore._internals import TableInternals
from embstore._persist import buffers
from embstore._persist.buffers import MODE_EXPORT, Buffers
from embstore.optimizers import Adagrad


def export(t: TableInternals) -> dict[str, np.ndarray]:
    """``Table.export``: a point-in-time copy of every row as numpy arrays."""
    impl = t.live()
    snap = _core.begin_snapshot(impl, MODE_EXPORT)
    try:
        width = int(snap.row_width)
        buf = Buffers(buffers.chunk_rows(width), width)
        ids: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        steps: list[np.ndarray] = []
        for s in range(int(snap.num_shards)):
            while not snap.done(s):
                n = int(snap.next(s, buf.ids, buf.rows, buf.steps))
                buffers.after_chunk()
                if n:
                    ids.append(buf.ids[:n].copy())
                    rows.append(buf.rows[:n].copy())
                    steps.append(buf.steps[:n].copy())
        snap.commit()
    except BaseException:
        snap.abort()
        raise
    all_ids = np.concatenate(ids) if ids else np.zeros(0, np.uint64)
    all_rows = np.concatenate(rows) if rows else np.zeros((0, width), np.float32)
    out = t.split_rows(all_ids, all_rows, with_state=True)
    out["last_step"] = np.concatenate(steps) if steps else np.zeros(0, np.uint32)
    return out


def fresh_state_rows(t: TableInternals, n: int) -> npt.NDArray[np.float32]:
    """Optimizer state of ``n`` fresh rows ``[n, state_width]`` (as a new row starts)."""
    width = sum(w for _, w, _ in t.layout())
    optimizer = t.spec.optimizer
    value = optimizer.initial_accumulator if isinstance(optimizer, Adagrad) else 0.0
    return np.full((n, width), np.float32(value), dtype=np.float32)


def _check_entries(t: TableInternals, data: Mapping[str, Any]) -> list[str]:
    """Checks the entry names of an import; returns the optimizer state entries given."""
    if not isinstance(data, Mapping):
        msg = f"import_ expects a mapping of name -> array, got {type(data).__name__}"
        raise TypeError(msg)
    state_names = [name for name, _, _ in t.layout()]
    known = {"ids", "values", "last_step", *state_names}
    unknown = sorted(set(data) - known)
    if unknown:
        msg = f"import_: unknown entries {unknown}; expected ids, values, last_step, {state_names}"
        raise ValueError(msg)
    for req in ("ids", "values"):
        if req not in data:
            msg = f"import_: missing entry {req!r}"
            raise ValueError(msg)
    given = [name for name in state_names if name in data]
    if given and len(given) != len(state_names):
        missing = [name for name in state_names if name not in data]
        msg = f"import_: give every optimizer state entry or none; missing {missing}"
        raise ValueError(msg)
    return given


def _full_rows(
    t: TableInternals, data: Mapping[str, Any], n: int, with_state: bool
) -> npt.NDArray[np.float32]:
    """Weights then optimizer state, checked, as the core's ``[n, row_width]`` rows."""
    dim, layout = t.spec.dim, t.layout()
    values = _float_array(data["values"], "values", (n, dim))
    rows = np.empty((n, dim + sum(w for _, w, _ in layout)), dtype=np.float32)
    rows[:, :dim] = values
    if not with_state:
        rows[:, dim:] = fresh_state_rows(t, n)
        return rows
    col = dim
    for name, w, dtype in layout:
        shape = (n,) if w == 1 else (n, w)
        if dtype == "uint32":
            part = _uint_array(data[name], name, shape, 2**32 - 1).astype(np.uint32)
            rows[:, col : col + w] = part.reshape(n, w).view(np.float32)
        else:
            rows[:, col : col + w] = _float_array(data[name], name, shape).reshape(n, w)
        col += w
    return rows


def import_(t: TableInternals, data: Mapping[str, Any], *, restore: bool = False) -> int:
    """``Table.import_``: validates everything, then inserts or overwrites rows.

    ``restore=True`` fills a fresh table as a load does (rows count as checkpointed, nothing
    is evicted; rows that find no room are skipped and not counted)."""
    impl = t.live()
    given = _check_entries(t, data)
    ids = _arrays.as_keys(data["ids"], "ids")
    n = ids.shape[0]
    rows = _full_rows(t, data, n, bool(given))
    steps: npt.NDArray[np.uint32] | None = None
    if "last_step" in data:
        steps = _uint_array(data["last_step"], "last_step", (n,), 2**32 - 1).astype(np.uint32)
    pad = t.padding_key
    if pad is not None and n and bool(np.any(ids == np.uint64(pad))):
        msg = f"import_: ids must not hold the padding id {t.spec.padding_id}"
        raise ValueError(msg)
    if n and np.unique(ids).shape[0] != n:
        msg = "import_: ids must be distinct"
        raise ValueError(msg)
    try:
        stored = impl.import_rows(ids=ids, rows=rows, steps=steps, restore=restore, placed=None)
    finally:
        t.deliver_evicted()
    return int(stored)


def _float_array(x: Any, name: str, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        msg = f"import_: {name} must be a float array, got dtype {arr.dtype}"
        raise TypeError(msg)
    if arr.shape != shape:
        msg = f"import_: {name} must have shape {shape}, got {arr.shape}"
        raise ValueError(msg)
    out = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.all(np.isfinite(out)):
        msg = f"import_: {name} must be finite"
        raise ValueError(msg)
    return out


def _uint_array(x: Any, name: str, shape: tuple[int, ...], high: int) -> npt.NDArray[np.int64]:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        msg = f"import_: {name} must be an integer array, got dtype {arr.dtype}"
        raise TypeError(msg)
    if arr.shape != shape:
        msg = f"import_: {name} must have shape {shape}, got {arr.shape}"
        raise ValueError(msg)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > high):
        msg = f"import_: {name} must be in [0, {high}]"
        raise ValueError(msg)
    return arr.astype(np.int64)


def dump(t: TableInternals) -> dict[str, Any]:
    """Everything a pickled table carries besides its spec: every row (as :func:`export`),
    the current step and whether steps are tracked, and the admission counters."""
    impl = t.live()
    payload: dict[str, Any] = {
        "rows": export(t),
        "step": int(impl.step),
        "step_tracking": bool(impl.step_tracking),
    }
    if t.spec.admission is not None and t.spec.admission.min_count > 1:
        payload["sketches"] = [impl.sketch_counters(s) for s in range(int(impl.num_shards))]
    return payload


def restore(t: TableInternals, payload: Mapping[str, Any]) -> None:
    """Fills a fresh table of the dumped table's spec with :func:`dump`'s ``payload``."""
    impl = t.live()
    rows = payload["rows"]
    stored = import_(t, rows, restore=True)
    if stored != rows["ids"].shape[0]:  # same spec, same shards: every row has its place
        msg = f"embstore internal error: {stored} of {rows['ids'].shape[0]} rows restored"
        raise RuntimeError(msg)
    for s, counters in enumerate(payload.get("sketches", ())):
        impl.restore_sketch(shard=s, counters=np.ascontiguousarray(counters))
    if payload["step_tracking"]:
        impl.set_step(int(payload["step"]))
