"""The protocol's bulk messages in protobuf's wire format, written and read directly.

A W1 lookup moves 1 MiB of keys up and 2 MiB of pooled rows down. Through the generated
message classes each array is copied four times on the way up (``tobytes``, the message,
``SerializeToString``, gRPC's buffer) and three times on the way down (gRPC's buffer, the
parsed message, the field's ``bytes``). Here a request is one ``bytes.join`` over the
arrays' own buffers, and a reply's arrays are views of the received bytes. Only the bulk
messages (``LookupRequest``, ``PushGradRequest``, ``LookupResponse``) take this path; the
tests check it against the message classes, field for field.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "TableArrays",
    "TableView",
    "WireError",
    "encode_lookup_request",
    "encode_lookup_response",
    "encode_push_request",
    "parse_lookup_response",
    "parse_request",
]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_LE = {"keys": "<u8", "offsets": "<i8", "weights": "<f4", "grads": "<f4"}


class WireError(ValueError):
    """Bytes that are not a well-formed message of the protocol."""


@dataclass
class TableArrays:
    """One table's part of a request, as arrays (``weights``/``grads`` optional)."""

    table: str
    keys: npt.NDArray[Any]
    offsets: npt.NDArray[Any]
    weights: npt.NDArray[Any] | None = None
    grads: npt.NDArray[Any] | None = None


@dataclass
class TableView:
    """One table's part of a received request: read-only views of the request's bytes."""

    table: str
    keys: npt.NDArray[Any]
    offsets: npt.NDArray[Any]
    weights: npt.NDArray[Any] | None
    grads: npt.NDArray[Any]  # empty when the request has none


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64: two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _le_buffer(a: npt.NDArray[Any], kind: str) -> memoryview:
    """``a`` as little-endian C-order bytes, without a copy when it already is."""
    a = np.ascontiguousarray(a, dtype=_LE[kind]).reshape(-1)
    return a.view(np.uint8).data


def _scalar(field: int, value: int) -> list[bytes]:
    return [] if value == 0 else [_tag(field, _VARINT), _varint(value)]


def _table_pieces(t: TableArrays) -> tuple[list[Any], int]:
    """The pieces of one TableBatch (without its own field header) and their length."""
    name = t.table.encode()
    parts: list[Any] = [_tag(1, _LEN), _varint(len(name)), name] if name else []
    arrays: list[tuple[str, int, npt.NDArray[Any] | None]] = [
        ("keys", 2, t.keys),
        ("offsets", 3, t.offsets),
        ("weights", 4, t.weights),
        ("grads", 5, t.grads),
    ]
    for kind, field, a in arrays:
        if a is None:
            continue
        buf = _le_buffer(a, kind)
        if buf.nbytes:
            parts += [_tag(field, _LEN), _varint(buf.nbytes), buf]
    return parts, sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


def _request(tables: Sequence[TableArrays], tail: list[bytes]) -> bytes:
    pieces: list[Any] = []
    for t in tables:
        parts, n = _table_pieces(t)
        pieces += [_tag(1, _LEN), _varint(n), *parts]
    return b"".join([*pieces, *tail])


def encode_lookup_request(
    tables: Sequence[TableArrays], *, insert: bool, mode: int, client_send_ns: int
) -> bytes:
    """A serialised ``LookupRequest``: one copy of every array."""
    tail = _scalar(2, int(insert)) + _scalar(3, mode) + _scalar(4, client_send_ns)
    return _request(tables, tail)


def encode_push_request(tables: Sequence[TableArrays], *, mode: int, client_send_ns: int) -> bytes:
    """A serialised ``PushGradRequest``: one copy of every array."""
    return _request(tables, _scalar(2, mode) + _scalar(3, client_send_ns))


def encode_lookup_response(pooled: Sequence[npt.NDArray[np.float32]]) -> bytes:
    """A serialised ``LookupResponse`` of 2-D float32 arrays: one copy of each."""
    pieces: list[Any] = []
    for a in pooled:
        buf = _le_buffer(a, "grads")
        pieces += [_tag(1, _LEN), _varint(buf.nbytes), buf]
    dims = b"".join(_varint(int(a.shape[1])) for a in pooled)
    if dims:
        pieces += [_tag(2, _LEN), _varint(len(dims)), dims]
    return b"".join(pieces)


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if pos >= end or shift > 63:
            msg = "truncated or overlong varint"
            raise WireError(msg)
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field, wire type, value or start, length) of each field in ``buf[pos:end]``."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            yield field, wire, value, 0
            continue
        if wire == _LEN:
            n, pos = _read_varint(buf, pos, end)
        elif wire in (_I64, _I32):
            n = 8 if wire == _I64 else 4
        else:
            msg = f"unsupported wire type {wire} (field {field})"
            raise WireError(msg)
        if pos + n > end:
            msg = f"field {field} runs past the end of its message"
            raise WireError(msg)
        yield field, wire, pos, n
        pos += n


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def parse_lookup_response(raw: bytes) -> tuple[list[tuple[int, int]], list[int]]:
    """(start, length) of each ``pooled`` entry in ``raw``, and the ``dims``."""
    spans: list[tuple[int, int]] = []
    dims: list[int] = []
    for field, wire, value, n in _fields(raw, 0, len(raw)):
        if field == 1 and wire == _LEN:
            spans.append((value, n))
        elif field == 2 and wire == _LEN:  # packed
            pos, end = value, value + n
            while pos < end:
                d, pos = _read_varint(raw, pos, end)
                dims.append(_int64(d))
        elif field == 2 and wire == _VARINT:
            dims.append(_int64(value))
    return spans, dims


def _view(raw: bytes, start: int, n: int, kind: str, table: str) -> npt.NDArray[Any]:
    dtype = np.dtype(_LE[kind])
    if n % dtype.itemsize:
        msg = (
            f"features[{table!r}]: {kind} is {n} bytes, not a whole number of "
            f"{dtype.itemsize}-byte values"
        )
        raise ValueError(msg)
    return np.frombuffer(raw, dtype=dtype, count=n // dtype.itemsize, offset=start)


def _table_view(raw: bytes, start: int, end: int) -> TableView:
    name = ""
    spans: dict[str, tuple[int, int]] = {}
    kinds = {2: "keys", 3: "offsets", 4: "weights", 5: "grads"}
    for field, wire, value, n in _fields(raw, start, end):
        if wire != _LEN:
            continue
        if field == 1:
            name = raw[value : value + n].decode()
        elif field in kinds:
            spans[kinds[field]] = (value, n)

    def get(kind: str) -> npt.NDArray[Any]:
        s, n = spans.get(kind, (0, 0))
        return _view(raw, s, n, kind, name)

    return TableView(
        table=name,
        keys=get("keys"),
        offsets=get("offsets"),
        weights=get("weights") if spans.get("weights", (0, 0))[1] else None,
        grads=get("grads"),
    )


def parse_request(raw: bytes) -> tuple[list[TableView], dict[int, int]]:
    """A ``LookupRequest`` or ``PushGradRequest``: its tables (field 1) as views of
    ``raw``, and its scalar fields by number (absent ones are 0)."""
    tables: list[TableView] = []
    scalars: dict[int, int] = {}
    for field, wire, value, n in _fields(raw, 0, len(raw)):
        if field == 1 and wire == _LEN:
            tables.append(_table_view(raw, value, value + n))
        elif wire == _VARINT:
            scalars[field] = _int64(value)
    return tables, scalars
