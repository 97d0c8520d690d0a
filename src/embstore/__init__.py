"""embstore: a native-accelerated embedding store for recommendation models.

A C++ core keeps each embedding table in one preallocated arena, indexes it with a sharded
hash map (uint64 id -> row), evicts with CLOCK, and runs lookups, pooled lookups and fused
optimizer updates with per-shard locking and the GIL released.

>>> import numpy as np, embstore
>>> t = embstore.Table(dim=4, capacity=1000, optimizer=embstore.SGD(lr=0.1))
>>> t.lookup_sum(np.array([1, 2, 3], dtype=np.uint64), np.array([0, 2, 3])).shape
(2, 4)
"""

from __future__ import annotations

from embstore import checkpoint, metrics
from embstore._core import CapacityError
from embstore._version import __version__
from embstore.admission import CountFilter
from embstore.checkpoint import CheckpointError
from embstore.errors import ShardLostError, StaleStepError
from embstore.group import TableGroup
from embstore.initializers import Normal, TruncatedNormal, Uniform, Zeros
from embstore.optimizers import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad
from embstore.spec import TableSpec
from embstore.table import Table

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "Adam",
    "CapacityError",
    "CheckpointError",
    "CountFilter",
    "Normal",
    "RowWiseAdagrad",
    "ShardLostError",
    "StaleStepError",
    "Table",
    "TableGroup",
    "TableSpec",
    "TruncatedNormal",
    "Uniform",
    "Zeros",
    "__version__",
    "checkpoint",
    "metrics",
]
