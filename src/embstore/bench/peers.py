"""The peer interface and registry: a store under test is a :class:`Peer` subclass
decorated with :func:`register_peer`; it then appears in ``--peers`` and in the table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

from embstore.bench.workload import Batch, F32Array, TableData


class Peer:
    """A store under test. Subclass, then decorate with :func:`register_peer`.

    Life cycle: ``Peer(threads)``, :meth:`setup` (build and warm ``T`` tables of ``D``
    columns), then for each workload (one per ``L``) :meth:`prepare` and any number of
    :meth:`forward` / :meth:`backward` pairs, then :meth:`close`. :meth:`read_rows` is
    used only by the verification; neither it nor :meth:`prepare` is ever timed.

    Class attributes
    ----------------
    name : str
        Key in :data:`PEERS` and the ``--peers`` flag.
    label : str
        Row label in the result table.
    threaded : bool
        Whether the thread count changes the peer's work. Peers that are not threaded are
        measured once per ``(D, L)`` and shown against embstore at every thread count.
    hashed : bool
        Whether the peer maps hashed ids to rows itself (``False``: dense, precomputed rows).
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    threaded: ClassVar[bool] = False
    hashed: ClassVar[bool] = False

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads

    @classmethod
    def unavailable(cls) -> str | None:
        """Why the peer cannot run here (a missing package), or ``None`` if it can."""
        return None

    @classmethod
    def memory_bytes(cls, tables: Sequence[TableData], dim: int) -> int:
        """Bytes the peer's tables will hold (an estimate, checked against the memory
        available before :meth:`setup`). Default: dense float32 weights and Adagrad
        accumulators, ``8 * D`` bytes a row."""
        return sum(tab.universe for tab in tables) * 8 * dim

    def setup(self, tables: Sequence[TableData], dim: int) -> None:
        """Build the tables and insert all ``U`` ids of each, in placement order."""
        raise NotImplementedError

    def prepare(self, batches: Sequence[Batch], grads: Sequence[F32Array]) -> None:
        """Convert a workload's batches and gradients to the peer's own input format.

        Called before the workload is verified and timed, so that a peer whose API takes
        another layout (FBGEMM's concatenated table-major indices) does not pay for the
        conversion in the timed region. A peer must still accept a batch it was not given
        here (converting it on the fly). The default does nothing.
        """

    def forward(self, batch: Batch) -> Sequence[Any]:
        """Pooled sums: one ``[B, D]`` float32 array (or tensor) per table."""
        raise NotImplementedError

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        """Apply the bag gradients ``grads[t]`` [B, D] of the last forward with Adagrad."""
        raise NotImplementedError

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        """Current weights (and Adagrad accumulators, if readable) of the batch's ids."""
        raise NotImplementedError

    def close(self) -> None:
        """Free the tables."""

    def extra(self) -> dict[str, Any]:
        """Peer-specific facts for the report (memory, counters)."""
        return {}


PeerT = TypeVar("PeerT", bound=type[Peer])

#: Peer registry: name -> class (the class is the factory: ``cls(threads)``).
PEERS: dict[str, type[Peer]] = {}


def register_peer(cls: PeerT) -> PeerT:
    """Class decorator adding a :class:`Peer` subclass to :data:`PEERS` under ``cls.name``.

    Example (see ``peer_fbgemm.py`` for a complete one)::

        @register_peer
        class MyStorePeer(Peer):
            name = "mystore"
            label = "MyStore, hashed"
            threaded = True
            hashed = True

            @classmethod
            def unavailable(cls):
                try:
                    importlib.import_module("mystore")
                except ImportError:
                    return "skipped: mystore not installed (pip install mystore)"
                return None
            ...
    """
    if not cls.name:
        msg = f"{cls.__name__} has no name"
        raise ValueError(msg)
    PEERS[cls.name] = cls
    return cls
