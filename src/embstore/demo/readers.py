"""Readers of CTR files into :class:`~embstore.demo.data.CTRData`.

- **Criteo** (the Kaggle Display Advertising Challenge TSV): ``label``, 13 integer and 26
  categorical columns, tab-separated, empty = missing. Each column is a field (a table):
  ``I1``..``I13`` and ``C1``..``C26``. An integer ``x`` is bucketed as
  ``floor(ln(x)**2)`` when ``x > 2`` and kept as is otherwise (the Kaggle winners'
  transform, see :func:`criteo_bucket`); a categorical value is its hex hash. The
  (field, value) pair is hashed into a uint64 id, and a missing value is one more id of
  its field.
- **libFM** (``label id:value id:value ...``): the label is 1 when positive, 0 otherwise
  (so both 0/1 and -1/1 files work); ids are used as they are, and values become the
  weights of the pooled lookup. libFM carries no field information: the k-th feature of a
  line is taken as field ``fk``. That is exact for files written one feature per field in a
  fixed order (Frappe, and the libFM exports of the NFM/AFM benchmarks), and the factor
  machine then models every pair of fields. Lines with fewer features leave the last
  fields empty.

Malformed lines raise :class:`~embstore.demo.data.DataError` (a ``ValueError``) naming
the file, the line number and the problem.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import numpy.typing as npt

from embstore.bench import splitmix64
from embstore.demo.data import CTRData, DataError

__all__ = [
    "CRITEO_FIELDS",
    "DataError",
    "criteo_bucket",
    "detect_format",
    "read",
    "read_criteo",
    "read_libfm",
]

CRITEO_INTEGER = 13
CRITEO_CATEGORICAL = 26
CRITEO_FIELDS = tuple(f"I{i}" for i in range(1, CRITEO_INTEGER + 1)) + tuple(
    f"C{i}" for i in range(1, CRITEO_CATEGORICAL + 1)
)
#: Token of a missing value: outside the range of any bucket or 64-bit hex hash we accept.
_MISSING_INT = 1 << 62
_MISSING_CAT = 1 << 63
_U64 = (1 << 64) - 1
_LOG_BUCKET = 1 << 40
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def criteo_bucket(x: int) -> int:
    """Bucket token of a Criteo integer feature: ``x`` itself for ``x <= 2``, else
    ``floor(ln(x)**2)`` in a range of its own (``2**40 + bucket``), so that ``x = 1`` and
    the bucket of ``x = 3`` (also 1) stay apart."""
    return _LOG_BUCKET + int(math.log(x) ** 2) if x > 2 else x


def _field_ids(tokens: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """uint64 ids of ``tokens[f, i]``, hashed with the field index ``f``."""
    salts = splitmix64(np.arange(1, tokens.shape[0] + 1, dtype=np.uint64))
    return splitmix64(tokens ^ salts[:, None])


def _lines(path: Path) -> list[tuple[int, str]]:
    """(1-based line number, text) of every non-blank line."""
    with open(path, encoding="utf-8", newline="") as f:
        return [(n, line.rstrip("\r\n")) for n, line in enumerate(f, start=1) if line.strip() != ""]


def read_criteo(path: str | Path) -> CTRData:
    """Read a Criteo-format TSV (see the module docstring)."""
    path = Path(path)
    lines = _lines(path)
    width = 1 + CRITEO_INTEGER + CRITEO_CATEGORICAL
    labels = np.empty(len(lines), dtype=np.float32)
    tokens = np.empty((width - 1, len(lines)), dtype=np.uint64)
    for i, (lineno, line) in enumerate(lines):
        cols = line.split("\t")
        if len(cols) != width:
            msg = (
                f"{path}:{lineno}: a Criteo line has {width} tab-separated fields (label, "
                f"{CRITEO_INTEGER} integer, {CRITEO_CATEGORICAL} categorical), got {len(cols)}"
            )
            raise DataError(msg)
        if cols[0] not in ("0", "1"):
            msg = f"{path}:{lineno}: the label must be 0 or 1, got {cols[0]!r}"
            raise DataError(msg)
        labels[i] = float(cols[0])
        for j in range(CRITEO_INTEGER):
            text = cols[1 + j]
            if text == "":
                tokens[j, i] = _MISSING_INT
                continue
            try:
                value = int(text)
            except ValueError:
                msg = f"{path}:{lineno}: I{j + 1} must be an integer, got {text!r}"
                raise DataError(msg) from None
            tokens[j, i] = criteo_bucket(value) & _U64
        for j in range(CRITEO_CATEGORICAL):
            text = cols[1 + CRITEO_INTEGER + j]
            if text == "":
                tokens[CRITEO_INTEGER + j, i] = _MISSING_CAT
                continue
            if len(text) > 15 or not _HEX_DIGITS.issuperset(text):
                msg = (
                    f"{path}:{lineno}: C{j + 1} must be a hex hash (up to 15 digits), got {text!r}"
                )
                raise DataError(msg)
            tokens[CRITEO_INTEGER + j, i] = int(text, 16)
    if not lines:
        msg = f"{path}: no examples"
        raise DataError(msg)
    return CTRData(labels=labels, ids=_field_ids(tokens), fields=CRITEO_FIELDS)


def read_libfm(path: str | Path, num_fields: int | None = None) -> CTRData:
    """Read a libFM file (see the module docstring).

    ``num_fields`` fixes the number of fields (a held-out file must have the fields of the
    training file); by default it is the most features on a line.
    """
    path = Path(path)
    lines = _lines(path)
    if not lines:
        msg = f"{path}: no examples"
        raise DataError(msg)
    labels = np.empty(len(lines), dtype=np.float32)
    rows: list[list[int]] = []
    vals: list[list[float]] = []
    for i, (lineno, line) in enumerate(lines):
        parts = line.split()
        try:
            label = float(parts[0])
        except ValueError:
            msg = f"{path}:{lineno}: the label must be a number, got {parts[0]!r}"
            raise DataError(msg) from None
        labels[i] = 1.0 if label > 0 else 0.0
        ids: list[int] = []
        values: list[float] = []
        for token in parts[1:]:
            key, sep, val = token.partition(":")
            try:
                ident = int(key)
                value = float(val)
            except ValueError:
                ident, value = -1, math.nan
            if not sep or not 0 <= ident <= _U64 or not math.isfinite(value):
                msg = (
                    f"{path}:{lineno}: a libFM feature is id:value (id a non-negative integer, "
                    f"value a finite number), got {token!r}"
                )
                raise DataError(msg)
            ids.append(ident)
            values.append(value)
        if num_fields is not None and len(ids) > num_fields:
            msg = f"{path}:{lineno}: {len(ids)} features, more than the {num_fields} fields"
            raise DataError(msg)
        rows.append(ids)
        vals.append(values)
    width = max(len(r) for r in rows) if num_fields is None else num_fields
    if width == 0:
        msg = f"{path}: no line has a feature"
        raise DataError(msg)
    n = len(rows)
    ids_fn = np.zeros((n, width), dtype=np.uint64)
    values_fn = np.ones((n, width), dtype=np.float32)
    present = np.zeros((n, width), dtype=np.bool_)
    if all(len(r) == width for r in rows):
        ids_fn[:] = rows
        values_fn[:] = vals
        present[:] = True
    else:
        for i, (r, v) in enumerate(zip(rows, vals, strict=True)):
            ids_fn[i, : len(r)] = r
            values_fn[i, : len(v)] = v
            present[i, : len(r)] = True
    return CTRData(
        labels=labels,
        ids=np.ascontiguousarray(ids_fn.T),
        fields=tuple(f"f{k}" for k in range(width)),
        values=None if bool((values_fn == 1.0).all()) else np.ascontiguousarray(values_fn.T),
        present=None if bool(present.all()) else np.ascontiguousarray(present.T),
    )


def detect_format(path: str | Path) -> str:
    """``"criteo"`` or ``"libfm"``, from the first non-blank line."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                break
        else:
            msg = f"{path}: no examples"
            raise DataError(msg)
    if "\t" in line:
        return "criteo"
    if ":" in line:
        return "libfm"
    msg = f"{path}: neither a Criteo TSV (tab-separated) nor a libFM file (label id:value ...)"
    raise DataError(msg)


def read(path: str | Path, fmt: str = "auto", like: CTRData | None = None) -> CTRData:
    """Read ``path`` as ``fmt`` (``"auto"``, ``"criteo"`` or ``"libfm"``).

    ``like``: a held-out file must have the fields of this (training) data set.
    """
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "criteo":
        data = read_criteo(path)
    elif fmt == "libfm":
        data = read_libfm(path, None if like is None else like.num_fields)
    else:
        msg = f"unknown data format {fmt!r}: expected 'auto', 'criteo' or 'libfm'"
        raise DataError(msg)
    if like is not None and data.fields != like.fields:
        msg = f"{path}: fields {data.fields} differ from the training data's {like.fields}"
        raise DataError(msg)
    return data
