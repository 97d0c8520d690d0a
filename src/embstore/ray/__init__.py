"""embstore.ray: one embedding store sharded over N processes (Ray actors) or, for tests
and as the reference, over N in-process shards (``backend="local"``).

Ray is imported only by ``backend="ray"`` (the optional extra ``embstore[ray]``).
See ``docs/ray.md``.
"""

from __future__ import annotations

from embstore.errors import ShardLostError, StaleStepError
from embstore.ray._handle import ApplyHandle
from embstore.ray.store import ShardedTableGroup
from embstore.spec import TableSpec

__all__ = ["ApplyHandle", "ShardLostError", "ShardedTableGroup", "StaleStepError", "TableSpec"]
