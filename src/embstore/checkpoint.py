"""The embstore checkpoint file format: writer, validating reader, and a pure-numpy reader.

This module needs only the standard library and numpy (never the C++ core), so a checkpoint
can be inspected anywhere::

    from embstore import checkpoint
    arrays = checkpoint.read("user.ckpt")      # {"ids", "values", <state>..., "last_step"}
    header = checkpoint.read_header("user.ckpt")

Without a built embstore, load this file by path (``importlib.util.spec_from_file_location``)
or copy it. The format is specified in ``docs/checkpoint.md``; in short (little-endian):

- a 32-byte preamble (magic, format version, JSON header length and crc32, preamble crc32),
  the UTF-8 JSON header (the table's configuration, checkpoint id and parent, layout), zero
  padding to a multiple of 64;
- sections, each a 64-byte header (name, shard, dtype, shape, byte length, payload crc32,
  header crc32) and its payload, which starts 64-byte aligned and is zero-padded to 64;
- a 64-byte trailer (section count, row count, removed-id count, its own offset, a crc32
  over every section header, the header's crc32, trailer crc32).

Rows come in groups of three sections (``ids`` uint64 ``[n]``, ``rows`` float32
``[n, row_width]``, ``last_step`` uint32 ``[n]``); deltas add ``removed`` (uint64), and
tables with an admission filter add each shard's ``sketch`` (uint16).

Errors: a file that is not a checkpoint, is truncated, corrupted (any checksum), of another
format version or inconsistent raises :class:`CheckpointError` (a ``ValueError``) naming the
file. Nothing is returned from a file that fails any check.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import time
import uuid
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # typing.Self needs Python 3.11; annotations are never evaluated at run time
    from typing_extensions import Self

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "CheckpointError",
    "CheckpointReader",
    "CheckpointWriter",
    "Section",
    "read",
    "read_header",
]

#: First 16 bytes of every checkpoint (the 0x89 and CR LF SUB LF catch text-mode mangling).
MAGIC = b"EMBSTORE\x89CKP\r\n\x1a\n"
#: The format version this module writes and reads.
FORMAT_VERSION = 1
FORMAT_NAME = "embstore.checkpoint"

ALIGN = 64
_PREAMBLE = struct.Struct("<16sIIII")  # magic, version, header length, header crc, own crc
_SECTION = struct.Struct("<4sI16sI4sQQQII")  # 64 bytes
_TRAILER = struct.Struct("<8sQQQQII12sI")  # 64 bytes
_SECTION_MAGIC = b"ESEC"
_TRAILER_MAGIC = b"EMBSTEND"
_NO_SHARD = 0xFFFFFFFF
_MAX_HEADER = 1 << 24

#: dtype code in a section header -> numpy dtype
DTYPES: dict[bytes, np.dtype[Any]] = {
    b"<u8": np.dtype("<u8"),
    b"<f4": np.dtype("<f4"),
    b"<u4": np.dtype("<u4"),
    b"<u2": np.dtype("<u2"),
}
#: section name -> dtype code and number of dimensions
SECTIONS: dict[str, tuple[bytes, int]] = {
    "ids": (b"<u8", 1),
    "rows": (b"<f4", 2),
    "last_step": (b"<u4", 1),
    "removed": (b"<u8", 1),
    "sketch": (b"<u2", 1),
}

#: Test hook (see tests/test_checkpoint_crash.py): "<point>" at which the writer writes the
#: file named by EMBSTORE_CHECKPOINT_TEST_MARKER and sleeps, so a test can kill it there.
#: Points: "header", "section:<k>" (before section k), "trailer", "fsync", "replace",
#: "dirsync"; "small-replace" in write_atomic (a group's manifest).
_PAUSE_ENV = "EMBSTORE_CHECKPOINT_TEST_PAUSE"
_MARKER_ENV = "EMBSTORE_CHECKPOINT_TEST_MARKER"


class CheckpointError(ValueError):
    """A checkpoint file is not one, is truncated or corrupted, has an unsupported version,
    or does not fit (a delta chain out of order, a delta of another table). The message
    names the file."""


def _crc(data: Any) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _pad(n: int) -> int:
    return (-n) % ALIGN


def _test_pause(point: str) -> None:
    want = os.environ.get(_PAUSE_ENV)
    if want is None or want != point:
        return
    marker = os.environ.get(_MARKER_ENV)
    if marker:
        with open(marker, "w") as f:
            f.write(point)
    time.sleep(3600)


def new_checkpoint_id() -> str:
    """A fresh random checkpoint id (uuid4, 32 hex digits)."""
    return uuid.uuid4().hex


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


class CheckpointWriter:
    """Writes one checkpoint file atomically: everything goes to a temporary file in the
    destination's directory, which is fsynced, renamed over ``path`` and the directory
    fsynced. Until :meth:`finish` returns, ``path`` keeps its previous content; a crash at
    any moment leaves either the old or the new complete file (and maybe a stray
    ``.<name>.<random>.tmp`` that is never read as a checkpoint).

    Use as a context manager: leaving it with an exception removes the temporary file.
    """

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any]) -> None:
        self.path = os.fspath(path)
        directory, base = os.path.split(os.path.abspath(self.path))
        self._dir = directory
        self._tmp = os.path.join(directory, f".{base}.{uuid.uuid4().hex[:12]}.tmp")
        self._fd: int | None = os.open(
            self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644
        )
        self._offset = 0
        self._sections = 0
        self._section_crc = 0
        self._rows = 0
        self._removed = 0
        self._done = False
        body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        if len(body) > _MAX_HEADER:
            msg = f"{self.path}: checkpoint header too large ({len(body)} bytes)"
            raise ValueError(msg)
        self._header_crc = _crc(body)
        head = struct.pack("<16sIII", MAGIC, FORMAT_VERSION, len(body), self._header_crc)
        pre = head + struct.pack("<I", _crc(head))
        self._write(pre + body + b"\0" * _pad(len(pre) + len(body)))
        _test_pause("header")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self._done:
            self.discard()

    def _write(self, data: Any) -> None:
        assert self._fd is not None
        view = memoryview(data).cast("B")
        total = view.nbytes
        done = 0
        while done < total:
            done += os.write(self._fd, view[done:])
        self._offset += total

    def section(
        self, name: str, array: np.ndarray, shard: int | None = None, crc: int | None = None
    ) -> None:
        """Appends one section holding ``array`` (C-contiguous, of the name's dtype);
        ``crc``: its crc32 when the caller has computed it already."""
        code, ndim = SECTIONS[name]
        if array.dtype != DTYPES[code] or array.ndim != ndim or not array.flags.c_contiguous:
            msg = f"section {name}: bad array {array.dtype} {array.shape}"
            raise ValueError(msg)
        _test_pause(f"section:{self._sections}")
        payload = array.data.cast("B") if array.nbytes else b""
        cols = array.shape[1] if ndim == 2 else 0
        head = struct.pack(
            "<4sI16sI4sQQQI",
            _SECTION_MAGIC,
            self._sections,
            name.encode(),
            _NO_SHARD if shard is None else shard,
            code,
            array.shape[0],
            cols,
            array.nbytes,
            _crc(payload) if crc is None else crc,
        )
        head += struct.pack("<I", _crc(head))
        self._section_crc = zlib.crc32(head, self._section_crc) & 0xFFFFFFFF
        self._write(head)
        if array.nbytes:
            self._write(payload)
        pad = _pad(array.nbytes)
        if pad:
            self._write(b"\0" * pad)
        self._sections += 1
        if name == "rows":
            self._rows += array.shape[0]
        elif name == "removed":
            self._removed += array.shape[0]

    def finish(self) -> None:
        """Writes the trailer and makes the file durable and visible at ``path``."""
        _test_pause("trailer")
        body = struct.pack(
            "<8sQQQQII12s",
            _TRAILER_MAGIC,
            self._sections,
            self._rows,
            self._removed,
            self._offset,
            self._section_crc,
            self._header_crc,
            b"",
        )
        self._write(body + struct.pack("<I", _crc(body)))
        _test_pause("fsync")
        assert self._fd is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        _test_pause("replace")
        os.replace(self._tmp, self.path)
        self._done = True
        _test_pause("dirsync")
        fsync_directory(self._dir)

    def discard(self) -> None:
        """Abandons the file: closes and removes the temporary file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


def fsync_directory(directory: str) -> None:
    """fsync a directory so a rename in it is durable (no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Writes a small file atomically (temporary file, fsync, rename, directory fsync)."""
    path = os.fspath(path)
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{base}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _test_pause("small-replace")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


class Section(NamedTuple):
    """A section header as read (and checked) from a file."""

    number: int  # position in the file, from 0
    name: str
    shard: int | None
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    nbytes: int
    crc: int
    offset: int  # of the payload in the file


class CheckpointReader:
    """Opens a checkpoint and checks its preamble, header and trailer; :meth:`sections` then
    walks the sections in order, checking each header, and :meth:`read_payload` /
    :meth:`skip_payload` check each payload's crc32. After the last section it checks that
    the section count, the crc32 over section headers and the trailer's offset all agree, so
    any truncation or corruption raises :class:`CheckpointError` before the walk ends.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._f: io.FileIO | None = open(self.path, "rb", buffering=0)  # noqa: SIM115
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def error(self, what: str) -> CheckpointError:
        """A CheckpointError about this file: its path, then ``what`` (for callers that
        check the contents further, as the loader does)."""
        return CheckpointError(f"{self.path}: {what}")

    def _read_exact(self, n: int, what: str) -> bytes:
        assert self._f is not None
        data = self._f.read(n)
        if data is None or len(data) != n:
            raise self.error(f"truncated ({what})")
        return data

    def _open(self) -> None:
        assert self._f is not None
        self.size = os.fstat(self._f.fileno()).st_size
        pre = self._f.read(_PREAMBLE.size)
        if len(pre) < len(MAGIC) or pre[: len(MAGIC)] != MAGIC:
            raise self.error("not an embstore checkpoint (bad magic bytes)")
        if len(pre) < _PREAMBLE.size:
            raise self.error("truncated (preamble)")
        _, version, hlen, hcrc, pcrc = _PREAMBLE.unpack(pre)
        if _crc(pre[:28]) != pcrc:
            raise self.error("corrupted preamble (checksum mismatch)")
        if version != FORMAT_VERSION:
            raise self.error(
                f"unsupported checkpoint format version {version} (this embstore reads "
                f"version {FORMAT_VERSION})"
            )
        if hlen > _MAX_HEADER or _PREAMBLE.size + hlen > self.size:
            raise self.error("truncated or corrupted header (bad length)")
        body = self._read_exact(hlen, "header")
        if _crc(body) != hcrc:
            raise self.error("corrupted header (checksum mismatch)")
        try:
            header = json.loads(body.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.error(f"corrupted header (bad JSON: {e})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
            raise self.error("not an embstore checkpoint header")
        self.header: dict[str, Any] = header
        self.header_crc = hcrc
        pad = _pad(_PREAMBLE.size + hlen)
        self._data_start = _PREAMBLE.size + hlen + pad
        # The trailer, found from the end: a truncated file has none.
        if self.size < self._data_start + _TRAILER.size:
            raise self.error("truncated (no trailer)")
        self._f.seek(self.size - _TRAILER.size)
        raw = self._read_exact(_TRAILER.size, "trailer")
        magic, count, rows, removed, offset, scrc, thcrc, _, tcrc = _TRAILER.unpack(raw)
        if magic != _TRAILER_MAGIC:
            raise self.error("truncated or corrupted (no trailer at the end of the file)")
        if _crc(raw[:60]) != tcrc:
            raise self.error("corrupted trailer (checksum mismatch)")
        if offset != self.size - _TRAILER.size or thcrc != hcrc:
            raise self.error("corrupted trailer (does not match the file)")
        self._f.seek(_PREAMBLE.size + hlen)
        if self._read_exact(pad, "header padding") != b"\0" * pad:
            raise self.error("corrupted header (non-zero padding)")
        if raw[48:60] != b"\0" * 12:
            raise self.error("corrupted trailer (reserved bytes are not zero)")
        self.num_sections: int = count
        self.num_rows: int = rows
        self.num_removed: int = removed
        self._sections_crc = scrc
        self._f.seek(self._data_start)
        self._pos = self._data_start
        self._pending: Section | None = None

    # -- header fields ----------------------------------------------------------------
    @property
    def kind(self) -> str:
        """``"full"`` or ``"delta"``."""
        return str(self.header.get("kind"))

    @property
    def checkpoint_id(self) -> str:
        """This checkpoint's id."""
        return str(self.header.get("checkpoint_id"))

    @property
    def parent_id(self) -> str | None:
        """The id of the checkpoint a delta follows (None for a full checkpoint)."""
        p = self.header.get("parent_id")
        return None if p is None else str(p)

    # -- sections ---------------------------------------------------------------------
    def sections(self) -> Iterator[Section]:
        """Yields every section in order. The caller must read or skip each payload before
        asking for the next section."""
        running = 0
        for k in range(self.num_sections):
            if self._pending is not None:
                msg = "read_payload or skip_payload must be called for each section"
                raise RuntimeError(msg)
            raw = self._read_exact(_SECTION.size, f"section {k} header")
            running = zlib.crc32(raw, running) & 0xFFFFFFFF
            magic, index, name, shard, code, n, cols, nbytes, pcrc, hcrc = _SECTION.unpack(raw)
            if magic != _SECTION_MAGIC or _crc(raw[:60]) != hcrc:
                raise self.error(f"corrupted section {k} header (checksum mismatch)")
            sname = name.rstrip(b"\0").decode("ascii", "replace")
            code = code.rstrip(b"\0")
            if index != k or sname not in SECTIONS or SECTIONS[sname][0] != code:
                raise self.error(f"corrupted section {k} header (unexpected content)")
            ndim = SECTIONS[sname][1]
            dtype = DTYPES[code]
            shape = (n, cols) if ndim == 2 else (n,)
            if (ndim == 1 and cols != 0) or nbytes != int(np.prod(shape)) * dtype.itemsize:
                raise self.error(f"corrupted section {k} header (shape and length differ)")
            start = self._pos + _SECTION.size
            end = start + nbytes + _pad(nbytes)
            if end > self.size - _TRAILER.size:
                raise self.error(f"truncated or corrupted (section {k} overruns the file)")
            sec = Section(
                k, sname, None if shard == _NO_SHARD else shard, dtype, shape, nbytes, pcrc, start
            )
            self._pos = start
            self._pending = sec
            yield sec
        if self._pending is not None:
            msg = "read_payload or skip_payload must be called for each section"
            raise RuntimeError(msg)
        if running != self._sections_crc or self._pos != self.size - _TRAILER.size:
            raise self.error("corrupted (sections do not match the trailer)")

    def read_payload(self, sec: Section, out: np.ndarray | None = None) -> np.ndarray:
        """Reads and checks the payload of ``sec`` (the section just yielded), into ``out``
        (a C-contiguous array of the section's dtype with at least as many bytes) when
        given; returns an array of the section's shape."""
        if self._pending is not sec:
            msg = "read_payload: not the current section"
            raise RuntimeError(msg)
        if out is None:
            arr = np.empty(sec.shape, dtype=sec.dtype)
        else:
            flat = out.reshape(-1)
            count = int(np.prod(sec.shape))
            if out.dtype != sec.dtype or flat.shape[0] < count:
                msg = "read_payload: buffer too small or of another dtype"
                raise ValueError(msg)
            arr = flat[:count].reshape(sec.shape)
        view = arr.data.cast("B") if sec.nbytes else memoryview(b"")
        assert self._f is not None
        got = 0
        while got < sec.nbytes:
            n = self._f.readinto(view[got:])
            if not n:
                raise self.error(f"truncated (section {sec.number} payload)")
            got += n
        if _crc(view) != sec.crc:
            raise self.error(
                f"corrupted section {sec.number} ({sec.name}, shard {sec.shard}): checksum mismatch"
            )
        self._skip_padding(sec)
        return arr

    def skip_payload(self, sec: Section, buffer: np.ndarray | None = None) -> None:
        """Checks the payload of ``sec`` without returning it (reads it through ``buffer``,
        a scratch uint8 array, in pieces)."""
        if self._pending is not sec:
            msg = "skip_payload: not the current section"
            raise RuntimeError(msg)
        scratch = buffer if buffer is not None else np.empty(1 << 20, dtype=np.uint8)
        view = scratch.data.cast("B")
        assert self._f is not None
        crc = 0
        left = sec.nbytes
        while left:
            n = self._f.readinto(view[: min(left, view.nbytes)])
            if not n:
                raise self.error(f"truncated (section {sec.number} payload)")
            crc = zlib.crc32(view[:n], crc)
            left -= n
        if (crc & 0xFFFFFFFF) != sec.crc:
            raise self.error(
                f"corrupted section {sec.number} ({sec.name}, shard {sec.shard}): checksum mismatch"
            )
        self._skip_padding(sec)

    def _skip_padding(self, sec: Section) -> None:
        pad = _pad(sec.nbytes)
        if pad and self._read_exact(pad, f"section {sec.number} padding") != b"\0" * pad:
            raise self.error(f"corrupted section {sec.number} (non-zero padding)")
        self._pos = sec.offset + sec.nbytes + pad
        self._pending = None

    def close(self) -> None:
        """Closes the file."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a checkpoint, plus ``rows``, ``removed`` and ``sections`` from its
    trailer (after checking preamble, header and trailer; sections are not read)."""
    with CheckpointReader(path) as r:
        out = dict(r.header)
        out.update(rows=r.num_rows, removed=r.num_removed, sections=r.num_sections)
        return out


def split_rows(
    rows: npt.NDArray[np.float32], dim: int, layout: list[tuple[str, int, str]]
) -> dict[str, np.ndarray]:
    """Splits checkpoint rows ``[n, dim + state]`` into ``values`` ``[n, dim]`` and one
    array per optimizer state entry (``layout``: ``(name, width, dtype)``; width-1 entries
    are 1-D; ``uint32`` entries are reinterpreted, e.g. Adam's step count)."""
    out: dict[str, np.ndarray] = {"values": np.ascontiguousarray(rows[:, :dim])}
    col = dim
    for name, width, dtype in layout:
        part = np.ascontiguousarray(rows[:, col : col + width])
        if dtype == "uint32":
            part = part.view(np.uint32)
        out[name] = part[:, 0] if width == 1 else part
        col += width
    return out


def read(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Reads a whole checkpoint into numpy arrays, checking every checksum.

    Returns ``ids`` (uint64 ``[n]``), ``values`` (float32 ``[n, dim]``), one entry per
    optimizer state (named as in ``Table.state_names()``), ``last_step`` (uint32 ``[n]``)
    and, for a delta, ``removed`` (uint64: ids removed since the parent checkpoint). Rows
    are in file order (shard by shard). Raises :class:`CheckpointError` on any problem.
    """
    with CheckpointReader(path) as r:
        h = r.header
        try:
            dim = int(h["table"]["dim"])
            width = int(h["row_width"])
            layout = [(str(a), int(b), str(c)) for a, b, c in h["state_layout"]]
        except (KeyError, TypeError, ValueError):
            raise r.error("corrupted header (missing fields)") from None
        ids: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        steps: list[np.ndarray] = []
        removed: list[np.ndarray] = []
        for sec in r.sections():
            arr = r.read_payload(sec)
            if sec.name == "ids":
                ids.append(arr)
            elif sec.name == "rows":
                if arr.shape[1] != width:
                    raise r.error(f"section {sec.number}: rows of width {arr.shape[1]}")
                rows.append(arr)
            elif sec.name == "last_step":
                steps.append(arr)
            elif sec.name == "removed":
                removed.append(arr)
        out: dict[str, np.ndarray] = {"ids": _concat(ids, np.uint64, (0,))}
        all_rows = _concat(rows, np.float32, (0, width))
        out.update(split_rows(all_rows, dim, layout))
        out["last_step"] = _concat(steps, np.uint32, (0,))
        if r.kind == "delta":
            out["removed"] = _concat(removed, np.uint64, (0,))
        n = out["ids"].shape[0]
        if all_rows.shape[0] != n or out["last_step"].shape[0] != n or n != r.num_rows:
            raise r.error("corrupted (ids, rows and last steps differ in length)")
        return out


def _concat(parts: list[np.ndarray], dtype: Any, empty: tuple[int, ...]) -> np.ndarray:
    if not parts:
        return np.zeros(empty, dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
