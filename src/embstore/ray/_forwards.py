"""The sharded client's record of its training forwards: which the shards still hold (so
that an apply ships only bag gradients), and each table's last forward with copies of its
batch (so that an apply is recognised as that forward's only when its ids, offsets and
weights are the same, bit for bit)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from embstore import _core
from embstore.ray import _pool
from embstore.ray.shard import MAX_PENDING

__all__ = ["Forwards"]


class _Forward:
    """One table's last training forward: its step token, mode and split, whose ``keep``
    holds copies of its ids, offsets and weights (made by the route: the caller may rewrite
    its own arrays in between, a reused loader buffer say)."""

    __slots__ = ("code", "plan", "token")

    def __init__(self, token: int, code: int, plan: _pool.Plan) -> None:
        self.token = token
        self.code = code
        self.plan = plan

    def matches(self, checked: tuple[Any, ...], code: int) -> bool:
        """Whether an apply's checked entry (keys, offsets, grads[, weights]) is this
        forward's batch, bit for bit, in the same mode."""
        keys, offsets, weights = self.plan.keep
        w = checked[3] if len(checked) == 4 else None
        return (
            code == self.code
            and (w is None) == (weights is None)
            and _core.same_bytes(checked[0], keys)
            and _core.same_bytes(checked[1], offsets)
            and (w is None or _core.same_bytes(w, weights))
        )


class Forwards:
    """Each table's last training forward, and the forwards the shards hold for this
    client (token -> tables not applied yet), kept as each shard keeps them
    (``ShardServer.looked_up``: the newest MAX_PENDING)."""

    def __init__(self) -> None:
        self._last: dict[str, _Forward] = {}
        self._held: OrderedDict[int, set[str]] = OrderedDict()

    def keep(self, token: int, names: list[str], code: int, plans: Sequence[_pool.Plan]) -> None:
        """A training forward the shards now hold (``plans`` routed with ``keep``). Past
        MAX_PENDING they drop the oldest, and so does this record (its tables' applies are
        then routed afresh)."""
        if not names:
            return  # the shards keep nothing for an empty forward either
        for name, plan in zip(names, plans, strict=True):
            self._last[name] = _Forward(token, code, plan)
        self._held[token] = set(names)
        while len(self._held) > MAX_PENDING:
            old, tables = self._held.popitem(last=False)
            for name in tables:
                fwd = self._last.get(name)
                if fwd is not None and fwd.token == old:
                    del self._last[name]

    def take(
        self, names: list[str], checked: Sequence[tuple[Any, ...]], code: int
    ) -> tuple[int | None, dict[str, _pool.Plan]]:
        """An apply's forward: the step token of the first table whose batch is exactly its
        forward's (None: none is), and the splits of that forward's tables whose batch is
        theirs, which the shards now consume. Every other table of the apply is routed
        afresh (its forward from that token, or any when there is none, is dropped)."""
        token = None
        held: dict[str, _pool.Plan] = {}
        for name, c in zip(names, checked, strict=True):
            fwd = self._last.get(name)
            if fwd is None or (token is not None and fwd.token != token):
                continue
            if fwd.matches(c, code):
                token = fwd.token
                held[name] = fwd.plan
        for name in names:  # (a forward of another token stays, for a later apply)
            fwd = self._last.get(name)
            if fwd is not None and (token is None or fwd.token == token):
                del self._last[name]
        if token is not None:
            tables = self._held[token]
            tables -= held.keys()
            if not tables:
                del self._held[token]
        return token, held

    def clear(self) -> None:
        self._last.clear()
        self._held.clear()
