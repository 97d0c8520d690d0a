"""TableSpec: a table described by :class:`embstore.Table`'s keyword arguments.

A live Table holds an arena that cannot be shipped to another process, so a sharded store
is built from specs; each shard builds its own slice of every table from them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from embstore import _arrays
from embstore.admission import CountFilter
from embstore.initializers import Initializer
from embstore.optimizers import Optimizer
from embstore.table import EvictCallback, Table

__all__ = ["TableSpec"]

#: Extra capacity each shard gets over its equal share (hash imbalance of the route).
SLACK = 0.02


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """:class:`embstore.Table`'s keyword arguments, with ``capacity`` the table's total
    over every shard (each shard gets an equal share plus :data:`SLACK`)."""

    dim: int
    capacity: int
    optimizer: Optimizer | None = None
    initializer: Initializer | None = None
    num_shards: int | None = None
    eviction: str = "clock"
    num_threads: int | None = None
    name: str | None = None
    admission: CountFilter | None = None
    on_evict: EvictCallback | None = None

    def shard_capacity(self, num_shards: int) -> int:
        """The capacity of one shard's slice among ``num_shards``."""
        if num_shards == 1:
            return self.capacity
        share = self.capacity / num_shards
        rows = math.ceil(share * (1 + SLACK) + 4 * math.sqrt(share) + 16)
        return min(self.capacity, rows)

    def build(self, num_shards: int, name: str) -> Table:
        """A Table for one shard's slice among ``num_shards``."""
        kwargs: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        kwargs["capacity"] = self.shard_capacity(num_shards)
        if kwargs["name"] is None:
            kwargs["name"] = name
        if kwargs["num_shards"] is not None and kwargs["num_shards"] > kwargs["capacity"]:
            kwargs["num_shards"] = None
        return Table(**kwargs)

    def check(self) -> None:
        """Raises what Table's constructor raises for these arguments (checked on a table
        of the smallest capacity they allow, so nothing large is reserved)."""
        kwargs: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        _arrays.positive_int("capacity", self.capacity)
        shards = self.num_shards if isinstance(self.num_shards, int) else 1
        kwargs["capacity"] = max(1, min(self.capacity, shards))
        kwargs["num_threads"] = 1
        Table(**kwargs).close()
