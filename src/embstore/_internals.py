"""The engine room of one table, shared by its facade and by persistence.

:class:`~embstore.Table` is the public face of a :class:`TableInternals`; persistence
(:mod:`embstore._persist`) and :mod:`embstore.metrics` work on the internals directly, so
they never import the facade (``Table._internals()`` hands them out).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import numpy.typing as npt

from embstore import _core, checkpoint, metrics
from embstore.optimizers import Optimizer, state_layout
from embstore.spec import TableSpec

__all__ = ["TableInternals", "make_core"]


def make_core(spec: TableSpec) -> _core.Table:
    """The C++ table for ``spec``: the one place Python constructs it."""
    return _core.Table(_core.TableConfig(**spec.core_args()))


class TableInternals:
    """A table's spec (current settings), C++ core and evicted-row hand-off.

    ``spec.name`` is the name the caller gave (None: ``name`` is an automatic one).
    """

    def __init__(self, spec: TableSpec, core: _core.Table | None = None) -> None:
        """``core``: an existing core of ``spec`` (a loaded one); default: a new one."""
        self.spec = spec
        #: ``spec.padding_id`` as a uint64 key, or None (read on every call).
        self.padding_key = spec.padding_key
        # The core keeps the checkpoint chain (the parent of its next save_delta).
        self.core: _core.Table | None = make_core(spec) if core is None else core
        self._delivering = threading.local()
        auto = metrics.register(self)
        self.name: str = spec.name if spec.name is not None else auto

    @property
    def checkpoint_id(self) -> str | None:
        """The checkpoint the core last saved this table to or loaded it from (the parent
        of its next save_delta), or None."""
        return _core.table_checkpoint_id(self.live())

    @property
    def closed(self) -> bool:
        """True once the core was released."""
        return self.core is None

    def live(self) -> _core.Table:
        """The core, or ValueError once closed."""
        core = self.core
        if core is None:
            msg = "operation on a closed embstore.Table"
            raise ValueError(msg)
        return core

    def close(self) -> None:
        """Release the core (its memory goes once no call is still running on it)."""
        self.core = None

    def adopt_name(self, name: str) -> None:
        """Take ``name`` (a group's name for the table) unless the caller named the table."""
        if self.spec.name is None:
            self.spec = dataclasses.replace(self.spec, name=name)
            self.name = name

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Record the optimizer's current settings (after a learning rate change)."""
        self.spec = dataclasses.replace(self.spec, optimizer=optimizer)

    def layout(self) -> list[tuple[str, int, str]]:
        """The optimizer state stored after each row's weights (see ``state_layout``)."""
        return state_layout(self.spec.optimizer, self.spec.dim)

    def split_rows(
        self, ids: npt.NDArray[np.uint64], rows: npt.NDArray[np.float32], *, with_state: bool
    ) -> dict[str, np.ndarray]:
        """``{"ids", "values"}`` of full rows (weights then state), plus each state entry
        with ``with_state``."""
        dim = self.spec.dim
        if not with_state:
            return {"ids": ids, "values": np.ascontiguousarray(rows[:, :dim])}
        return {"ids": ids, **checkpoint.split_rows(rows, dim, self.layout())}

    def deliver_evicted(self) -> None:
        """Hand rows CLOCK evicted to ``on_evict`` (after a call that may insert)."""
        on_evict, core = self.spec.on_evict, self.core
        if on_evict is None or core is None or core.evicted_pending == 0:
            return
        if getattr(self._delivering, "active", False):
            return  # a nested call from the callback: the outer loop delivers its rows
        self._delivering.active = True
        try:
            while core.evicted_pending:
                batch = core.drain_evicted()
                if batch["ids"].shape[0]:
                    on_evict(batch["ids"], batch["rows"])
        finally:
            self._delivering.active = False
