"""The reference parameter server: gRPC over one :class:`~embstore.TableGroup`.

Handlers decode the request's bytes into zero-copy numpy views, make one TableGroup call
(the core releases the GIL for the compute) and encode the pooled rows with one
``tobytes``. Each step is timed (``server.<Op>.{Queue,Decode,Handle,Encode}``). Errors of
the store come back as INVALID_ARGUMENT (bad input) or FAILED_PRECONDITION (capacity,
checkpoint) with the store's message; the Python type travels in the trailing metadata
``embstore-error`` so :class:`~embstore.ps.Client` re-raises it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc

from embstore import _core
from embstore._layers import Timer
from embstore.checkpoint import CheckpointError
from embstore.group import TableGroup
from embstore.ps import _codec, _wire
from embstore.ps._proto import SERVICE, messages

if TYPE_CHECKING:  # typing.Self needs Python 3.11
    from typing_extensions import Self

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "ERROR_KEY", "Server", "serve"]

#: gRPC's 4 MiB default is too small for W1 at B=2048, L=8 with 8 tables (3.2 MiB grads +
#: keys per push); 256 MiB leaves room for B=16384.
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
#: Trailing-metadata key naming the Python exception type of a failed call.
ERROR_KEY = "embstore-error"
_INVALID = (ValueError, KeyError, TypeError)
_PRECONDITION = (_core.CapacityError, CheckpointError, OSError)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


class _Timers:
    def __init__(self, op: str) -> None:
        self.queue = Timer(f"server.{op}.Queue")
        self.decode = Timer(f"server.{op}.Decode")
        self.handle = Timer(f"server.{op}.Handle")
        self.encode = Timer(f"server.{op}.Encode")

    def arrived(self, client_send_ns: int, now_ns: int) -> None:
        # CLOCK_MONOTONIC is shared by processes of one host only: loopback clients.
        if client_send_ns > 0:
            self.queue.record_ns(now_ns - client_send_ns)


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and len(e.args) == 1:
        return str(e.args[0])  # str(KeyError) would add quotes
    return str(e)


class _Service:
    def __init__(self, group: TableGroup, checkpoint_dir: str | None, max_reply: int) -> None:
        self.group = group
        self.max_reply_bytes = max_reply // 2  # the payload plus framing must fit
        self.checkpoint_dir = None if checkpoint_dir is None else os.path.abspath(checkpoint_dir)
        self.lookup_timers = _Timers("Lookup")
        self.push_timers = _Timers("PushGrad")

    def _decode(
        self, tables: list[_wire.TableView], with_grads: bool
    ) -> dict[str, tuple[Any, ...]]:
        out: dict[str, tuple[Any, ...]] = {}
        for tb in tables:
            name = tb.table
            if name in out:
                msg = f"features[{name!r}]: the table appears twice in one request"
                raise ValueError(msg)
            k, off, w = tb.keys, tb.offsets, tb.weights
            if not with_grads:
                out[name] = (k, off) if w is None else (k, off, w)
                continue
            g = tb.grads
            table = self.group.get(name)
            bags = off.shape[0] - 1
            if table is not None and bags >= 0 and g.shape[0] == bags * table.dim:
                g = g.reshape(bags, table.dim)  # else the store names the wrong shape
            out[name] = (k, off, g) if w is None else (k, off, g, w)
        return out

    def _mode(self, code: int) -> str:
        if not 0 <= code < len(_codec.MODES):
            msg = f"mode must be 'sum' or 'mean', got enum value {code}"
            raise ValueError(msg)
        return _codec.MODES[code]

    def _arrived(
        self, t: _Timers, raw: bytes, *, with_grads: bool, send_field: int
    ) -> tuple[list[_wire.TableView], dict[str, tuple[Any, ...]], dict[int, int]]:
        """A request's tables, entries and scalar fields, decoded and checked, timed by
        ``t``."""
        start = time.monotonic_ns()
        with t.decode:
            tables, scalars = _wire.parse_request(raw)
            entries = self._decode(tables, with_grads=with_grads)
        t.arrived(scalars.get(send_field, 0), start)
        return tables, entries, scalars

    def lookup(self, raw: bytes) -> bytes:
        t = self.lookup_timers
        tables, features, sc = self._arrived(t, raw, with_grads=False, send_field=4)
        mode = self._mode(sc.get(3, 0))
        with t.handle:
            pooled = self.group.lookup_sum(features, mode=mode, insert=bool(sc.get(2, 0)))
        with t.encode:
            return _wire.encode_lookup_response([pooled[tb.table] for tb in tables])

    def push(self, raw: bytes) -> bytes:
        t = self.push_timers
        _, grads, sc = self._arrived(t, raw, with_grads=True, send_field=3)
        mode = self._mode(sc.get(2, 0))
        with t.handle:
            self.group.apply_gradients(grads, mode=mode)
        return b""

    def _save_dir(self, given: str) -> str:
        if self.checkpoint_dir is None:
            if not given:
                msg = "dir: the server has no --checkpoint-dir, so a directory is required"
                raise ValueError(msg)
            return given
        path = os.path.abspath(os.path.join(self.checkpoint_dir, given))
        if os.path.commonpath([path, self.checkpoint_dir]) != self.checkpoint_dir:
            msg = f"dir: {given!r} is outside the server's checkpoint directory"
            raise ValueError(msg)
        return path

    def save(self, request: Any) -> Any:
        with Timer("server.Save.Handle"):
            path = self._save_dir(request.dir)
            if request.delta:
                save_group_delta(self.group, path)
            else:
                self.group.save(path)
        return messages["SaveResponse"]()

    def stats(self, request: Any) -> Any:
        m = messages
        hists = []
        for name in self.group.names:
            impl = self.group[name]._internals().core
            if impl is None:
                continue
            for timer, snap in _core.table_histograms(impl):
                hists.append(_histogram(m, "kv", name, timer, snap))
        for full, snap in _core.named_histograms():
            layer, _, rest = full.partition(".")
            hists.append(_histogram(m, layer, "-", rest, snap))
        infos = [m["TableInfo"](name=n, dim=self.group[n].dim) for n in self.group.names]
        return m["StatsResponse"](
            tables_json=json.dumps(self.group.stats()), histograms=hists, tables=infos
        )

    def ping(self, request: Any) -> Any:
        n = request.reply_bytes
        if not 0 <= n <= self.max_reply_bytes:
            msg = f"reply_bytes must be in [0, {self.max_reply_bytes}], got {n}"
            raise ValueError(msg)
        return messages["PingResponse"](payload=bytes(n))


def _histogram(m: Any, layer: str, table: str, name: str, snap: Any) -> Any:
    return m["Histogram"](
        layer=layer,
        table=table,
        name=name,
        counts=snap.counts,
        sum_ns=snap.sum_ns,
        max_ns=snap.max_ns,
        resets=snap.resets,
    )


def save_group_delta(group: TableGroup, directory: str) -> None:
    """Each table's ``save_delta`` into ``directory``/``<k>.delta`` (k: the table's position
    in the group), and ``DELTAS.json`` naming them, written last. A table's delta follows
    its previous save (a ``TableGroup.save`` or an earlier delta)."""
    from embstore.checkpoint import write_atomic

    os.makedirs(directory, exist_ok=True)
    files = {}
    for k, name in enumerate(group.names):
        fname = f"t{k:03d}.delta"
        group[name].save_delta(os.path.join(directory, fname))
        files[name] = fname
    body = {"format": "embstore.ps.deltas", "order": group.names, "files": files}
    write_atomic(os.path.join(directory, "DELTAS.json"), json.dumps(body).encode())


def _wrap(handler: Any) -> Any:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return handler(request)
        except _INVALID as e:
            code = grpc.StatusCode.INVALID_ARGUMENT
            err: BaseException = e
        except _PRECONDITION as e:
            code = grpc.StatusCode.FAILED_PRECONDITION
            err = e
        context.set_trailing_metadata(((ERROR_KEY, type(err).__name__),))
        context.abort(code, _message(err))

    return call


class Server:
    """A running PS server (see :func:`serve`). ``port`` is the bound port."""

    def __init__(self, grpc_server: grpc.Server, port: int, group: TableGroup) -> None:
        self._server = grpc_server
        self.port = port
        self.group = group
        self._stopped = threading.Event()

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving (calls in progress get ``grace`` seconds) and wait until stopped."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._server.stop(grace).wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout`` seconds pass)."""
        return bool(self._server.wait_for_termination(timeout))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    group: TableGroup,
    port: int = 0,
    threads: int | None = None,
    *,
    host: str = "127.0.0.1",
    checkpoint_dir: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> Server:
    """Serve ``group`` over gRPC on ``host:port`` (port 0: any free port) and return at once.

    Parameters
    ----------
    group : TableGroup
        The tables to serve; the caller may keep using it in-process.
    port : int
        TCP port; 0 picks a free one (``Server.port`` says which).
    threads : int, optional
        Handler threads (default 4). Handlers run TableGroup calls concurrently; a ``Save``
        occupies one thread while lookups and pushes go on.
    host : str
        Interface to bind; loopback by default.
    checkpoint_dir : str, optional
        If set, ``Save`` directories are taken relative to it and may not leave it.
    max_message_bytes : int
        Largest request or response (gRPC's default is 4 MiB).
    """
    if not isinstance(group, TableGroup):
        msg = f"group must be an embstore.TableGroup, got {type(group).__name__}"
        raise TypeError(msg)
    workers = 4 if threads is None else int(threads)
    if workers < 1:
        msg = f"threads must be a positive int, got {threads!r}"
        raise ValueError(msg)
    service = _Service(group, checkpoint_dir, max_message_bytes)
    m = messages
    methods = {
        "Lookup": (service.lookup, None, None),  # bytes in and out: see _wire
        "PushGrad": (service.push, None, None),
        "Save": (service.save, m["SaveRequest"], m["SaveResponse"]),
        "Stats": (service.stats, m["StatsRequest"], m["StatsResponse"]),
        "Ping": (service.ping, m["PingRequest"], m["PingResponse"]),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _wrap(fn),
            request_deserializer=None if req is None else req.FromString,
            response_serializer=None if resp is None else resp.SerializeToString,
        )
        for name, (fn, req, resp) in methods.items()
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embstore-ps"),
        options=channel_options(max_message_bytes),
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    bound = server.add_insecure_port(f"{host}:{int(port)}")
    if bound == 0:
        msg = f"port: could not bind {host}:{port}"
        raise OSError(msg)
    server.start()
    return Server(server, bound, group)
