"""A client of the reference PS with TableGroup's call shapes and errors.

Arguments are checked here with TableGroup's own checks (the server checks again: other
clients exist); a request is written in one copy of its arrays, and pooled rows come back
as read-only ``np.frombuffer`` views of the reply (no copy; see ``_wire``). Each call is timed
(``client.<Op>.{Total,Encode,RPC,Decode}``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import numpy.typing as npt

from embstore import _arrays, _core
from embstore._layers import Timer
from embstore.checkpoint import CheckpointError
from embstore.ps import _codec, _wire
from embstore.ps._proto import SERVICE, messages
from embstore.ps.server import DEFAULT_MAX_MESSAGE_BYTES, ERROR_KEY, channel_options

if TYPE_CHECKING:  # typing.Self needs Python 3.11
    from typing_extensions import Self

__all__ = ["Client", "PSError", "ServerHistogram"]

_ERRORS: dict[str, type[BaseException]] = {
    "ValueError": ValueError,
    "KeyError": KeyError,
    "TypeError": TypeError,
    "CapacityError": _core.CapacityError,
    "CheckpointError": CheckpointError,
    "OSError": OSError,
    "FileNotFoundError": FileNotFoundError,
    "PermissionError": PermissionError,
}


class PSError(RuntimeError):
    """A call that failed in transport or in the server for a reason other than its input
    (the gRPC error is the ``__cause__``)."""


class ServerHistogram:
    """One raw histogram of the server (``Client.histograms()``): ``layer`` is ``kv`` for a
    table's own timers, with ``table`` its name; else a named timer's layer and ``table``
    ``"-"``. ``snapshot`` diffs with another by :func:`window`."""

    __slots__ = ("layer", "name", "snapshot", "table")

    def __init__(self, layer: str, table: str, name: str, snapshot: Any) -> None:
        self.layer, self.table, self.name, self.snapshot = layer, table, name, snapshot

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.layer, self.table, self.name)


def window(before: ServerHistogram | None, now: ServerHistogram) -> dict[str, Any]:
    """Summary (``count``, ``p50_us`` ...) of what ``now`` recorded since ``before``."""
    base = _core.HistogramSnapshot() if before is None else before.snapshot
    out: dict[str, Any] = _core.summarize_histograms(base, now.snapshot)
    return out


class _Timers:
    def __init__(self, op: str) -> None:
        self.total = Timer(f"client.{op}.Total")
        self.encode = Timer(f"client.{op}.Encode")
        self.rpc = Timer(f"client.{op}.RPC")
        self.decode = Timer(f"client.{op}.Decode")


class Client:
    """A connection to an embstore PS (``python -m embstore.ps serve`` or
    :func:`embstore.ps.serve`) with :class:`~embstore.TableGroup`'s ``lookup_sum`` and
    ``apply_gradients``: swap one for the other and a trainer (or
    ``embstore.torch.EmbeddingBagCollection``) goes remote.

    Parameters
    ----------
    target : str
        ``"host:port"`` of the server.
    timeout : float, optional
        Seconds each call may take (default: no limit).
    max_message_bytes : int
        Largest request or reply (gRPC's default is 4 MiB).
    options : list of (str, value), optional
        More gRPC channel options.

    Errors of the store come back as the exception type TableGroup raises (ValueError,
    KeyError, TypeError, CapacityError, CheckpointError) with the store's message;
    anything else as :class:`PSError`.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: list[tuple[str, Any]] | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        opts: list[tuple[str, Any]] = [*channel_options(max_message_bytes), *(options or [])]
        self._channel = grpc.insecure_channel(target, options=opts)
        m = messages
        # Lookup and PushGrad travel as bytes written and read by _wire (no message copy).
        self._calls = {
            name: self._channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=None if req is None else m[req].SerializeToString,
                response_deserializer=None if resp is None else m[resp].FromString,
            )
            for name, req, resp in (
                ("Lookup", None, None),
                ("PushGrad", None, None),
                ("Save", "SaveRequest", "SaveResponse"),
                ("Stats", "StatsRequest", "StatsResponse"),
                ("Ping", "PingRequest", "PingResponse"),
            )
        }
        self._dims: dict[str, int] | None = None
        self._lookup_t = _Timers("Lookup")
        self._push_t = _Timers("PushGrad")

    def __repr__(self) -> str:
        return f"<embstore.ps.Client {self.target}>"

    def _call(self, method: str, request: Any) -> Any:
        try:
            return self._calls[method](request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _translate(e) from None

    @property
    def dims(self) -> dict[str, int]:
        """The server's tables and their dims, in the group's order (fetched once)."""
        if self._dims is None:
            reply = self._call("Stats", messages["StatsRequest"]())
            self._dims = {t.name: int(t.dim) for t in reply.tables}
        return self._dims

    @property
    def names(self) -> list[str]:
        """The server's table names, in the group's order."""
        return list(self.dims)

    def lookup_sum(
        self,
        features: Mapping[str, tuple[Any, ...]],
        *,
        mode: str = "sum",
        insert: bool = True,
    ) -> dict[str, npt.NDArray[np.float32]]:
        """:meth:`TableGroup.lookup_sum <embstore.TableGroup.lookup_sum>` on the server. The
        returned arrays are read-only views of the reply."""
        t = self._lookup_t
        with t.total:
            with t.encode:
                code = _arrays.mode_code(mode)
                tables, bags = _codec.encode_lookup(features, self.dims)
                request = _wire.encode_lookup_request(
                    tables, insert=bool(insert), mode=code, client_send_ns=time.monotonic_ns()
                )
            with t.rpc:
                reply = self._call("Lookup", request)
            with t.decode:
                return _pooled(reply, tables, bags)

    def apply_gradients(self, grads: Mapping[str, tuple[Any, ...]], *, mode: str = "sum") -> None:
        """:meth:`TableGroup.apply_gradients <embstore.TableGroup.apply_gradients>` on the
        server."""
        t = self._push_t
        with t.total:
            with t.encode:
                code = _arrays.mode_code(mode)
                tables = _codec.encode_grads(grads, self.dims)
                request = _wire.encode_push_request(
                    tables, mode=code, client_send_ns=time.monotonic_ns()
                )
            with t.rpc:
                self._call("PushGrad", request)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """``TableGroup.save(directory)`` on the server (a path on the server's machine,
        relative to its ``--checkpoint-dir`` if it has one). Lookups and pushes of other
        clients go on meanwhile."""
        self._call("Save", messages["SaveRequest"](dir=os.fspath(directory), delta=False))

    def save_delta(self, directory: str | os.PathLike[str]) -> None:
        """Every table's ``save_delta`` into ``directory`` on the server (see docs/ps.md)."""
        self._call("Save", messages["SaveRequest"](dir=os.fspath(directory), delta=True))

    def stats(self) -> dict[str, dict[str, Any]]:
        """The server's ``TableGroup.stats()``."""
        reply = self._call("Stats", messages["StatsRequest"]())
        out: dict[str, dict[str, Any]] = json.loads(reply.tables_json)
        return out

    def histograms(self) -> list[ServerHistogram]:
        """Raw buckets of every histogram of the server: tables' (``layer="kv"``) and named
        timers'. Two calls give a window (:func:`window`)."""
        reply = self._call("Stats", messages["StatsRequest"]())
        return [
            ServerHistogram(
                h.layer,
                h.table,
                h.name,
                _core.HistogramSnapshot(h.counts, h.sum_ns, h.max_ns, h.resets),
            )
            for h in reply.histograms
        ]

    def ping(self, payload: bytes = b"", reply_bytes: int = 0) -> None:
        """A round trip with no store work: ``payload`` up, ``reply_bytes`` zero bytes
        down (the transport floor of a call that moves that many bytes)."""
        self._call("Ping", messages["PingRequest"](payload=payload, reply_bytes=reply_bytes))

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pooled(
    reply: bytes, tables: list[_wire.TableArrays], bags: list[int]
) -> dict[str, npt.NDArray[np.float32]]:
    """The pooled rows of a Lookup reply, as read-only views of its bytes."""
    try:
        spans, dims = _wire.parse_lookup_response(reply)
    except _wire.WireError as e:
        msg = f"malformed Lookup reply: {e}"
        raise PSError(msg) from None
    if len(spans) != len(tables) or len(dims) != len(tables):
        msg = f"Lookup reply has {len(spans)} tables, the request {len(tables)}"
        raise PSError(msg)
    out = {}
    for t, n, (start, size), dim in zip(tables, bags, spans, dims, strict=True):
        if size != n * dim * 4:
            msg = f"Lookup reply for {t.table!r} is {size} bytes, not {n} bags x {dim} floats"
            raise PSError(msg)
        out[t.table] = np.frombuffer(reply, "<f4", n * dim, start).reshape(n, dim)
    return out


def _translate(e: Any) -> BaseException:
    """The exception a failed call raises: the store's type when the server named one."""
    meta = dict(e.trailing_metadata() or ())
    details = e.details() or ""
    kind = _ERRORS.get(str(meta.get(ERROR_KEY, "")))
    if kind is not None:
        return kind(details)
    return PSError(f"{e.code()}: {details}")
