"""Client-side pieces of a sharded step: splitting a batch by shard, and adding the shards'
answers back into one pooled result per table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _core
from embstore._sharded import SALT

__all__ = [
    "Plan",
    "check",
    "parts_of",
    "pool_in_order",
    "pooled",
    "reduce_partials",
    "route",
    "shard_grads",
]

F32 = npt.NDArray[np.float32]


class Plan:
    """One table's batch split by shard (see ``embstore::RoutePlan``), and (``keep``)
    copies of the batch's keys, offsets and weights when the route was asked to keep them."""

    __slots__ = (
        "bag_start",
        "bags",
        "coef",
        "keep",
        "key_start",
        "keys",
        "offsets",
        "order",
        "weights",
    )

    def __init__(self, arrays: tuple[Any, ...]) -> None:
        (
            self.order,
            self.keys,
            self.weights,
            self.coef,
            self.key_start,
            self.bags,
            self.bag_start,
            self.offsets,
            self.keep,
        ) = arrays

    def part(self, shard: int) -> tuple[Any, ...]:
        """Shard ``shard``'s (keys, offsets, weights, coef), all views. (Which bags of the
        batch it holds stays with the client: ``bags``.)"""
        k0, k1 = int(self.key_start[shard]), int(self.key_start[shard + 1])
        b0, b1 = int(self.bag_start[shard]), int(self.bag_start[shard + 1])
        w = None if self.weights is None else self.weights[k0:k1]
        c = None if self.coef is None else self.coef[k0:k1]
        return (self.keys[k0:k1], self.offsets[b0 + shard : b1 + shard + 1], w, c)


def route(
    names: Sequence[str],
    batches: Sequence[tuple[Any, ...]],
    num_shards: int,
    *,
    mean: bool,
    order: bool = True,
    keep: bool = False,
) -> list[Plan]:
    """Validates ``batches`` ((keys, offsets, weights | None, grads | None) per table) as a
    group call does, then splits each by shard, in one GIL-released C++ pass. ``order``:
    whether the plans keep each id's position in its batch (``Plan.order``; only an exact
    lookup needs it), else ``Plan.order`` is None. ``keep``: ``Plan.keep`` holds copies of
    the batch's keys, offsets and weights (None for no weights), made in the same call, else
    ``Plan.keep`` is None."""
    out = _core.route_batches(list(batches), list(names), num_shards, SALT, mean, True, order, keep)
    return [Plan(a) for a in out or ()]


def check(names: Sequence[str], batches: Sequence[tuple[Any, ...]], *, mean: bool) -> None:
    """Validates ``batches`` as :func:`route` does, without splitting them."""
    _core.route_batches(list(batches), list(names), 1, SALT, mean, False)


def shard_grads(grads: dict[str, F32], plans: dict[str, Plan], shard: int) -> dict[str, F32]:
    """The bag gradients shard ``shard`` needs: each table's gradients of the bags it holds
    (all of them, the same array for every shard, when its split holds every bag)."""
    out = {}
    for name, g in grads.items():
        plan = plans[name]
        b0, b1 = int(plan.bag_start[shard]), int(plan.bag_start[shard + 1])
        # In C++ into pooled memory: numpy's take page-faulted a fresh array every call.
        out[name] = g if b1 - b0 == g.shape[0] else _core.gather_rows(g, plan.bags[b0:b1])
    return out


def parts_of(
    plan: Plan, name: str, num_bags: int, answers: Sequence[tuple[Any, Any]]
) -> list[tuple[Any, F32]]:
    """Table ``name``'s partial sums in the shards' ``answers`` (per shard: (outputs by
    table, time)) for a batch of ``num_bags`` bags, as :func:`reduce_partials` takes them:
    (bags, sums) per shard that holds any bag, bags None when it holds every bag (its bags
    are then 0..num_bags-1)."""
    parts = []
    for shard, (outs, _) in enumerate(answers):
        b0, b1 = int(plan.bag_start[shard]), int(plan.bag_start[shard + 1])
        if b1 > b0:
            parts.append((None if b1 - b0 == num_bags else plan.bags[b0:b1], outs[name]))
    return parts


def reduce_partials(tables: Sequence[tuple[int, int, list[tuple[Any, F32]]]]) -> list[F32]:
    """Every table's pooled sums, (num_bags, dim, parts) each (parts as :func:`parts_of`
    builds them): its shards' partial sums added up in shard order, in one C++ call over
    the tables with the GIL released. A part that covers every bag is added whole; the
    first such part is the accumulator when it is writeable and shares no memory with
    another part (a local shard's own output: no copy); others are scattered by their
    bags; parts of no bag are skipped."""
    return list(
        _core.reduce_partials(
            [
                (num_bags, dim, [(b, np.ascontiguousarray(s, np.float32)) for b, s in parts])
                for num_bags, dim, parts in tables
            ]
        )
    )


def pooled(
    names: Sequence[str],
    plans: Sequence[Plan],
    checked: Sequence[tuple[Any, ...]],
    answers: Sequence[tuple[Any, Any]],
    dims: dict[str, int],
    *,
    mean: bool,
    exact: bool,
) -> dict[str, F32]:
    """Each table's pooled result from the shards' ``answers`` to a lookup of the
    ``checked`` batches split by ``plans``: rows pooled in the core's order (``exact``: the
    shards sent each id's row), else every table's partial sums added in one C++ call."""
    if exact:
        outs = {}
        for name, plan, c in zip(names, plans, checked, strict=True):
            rows = np.empty((c[0].shape[0], dims[name]), dtype=np.float32)
            for shard, (parts, _) in enumerate(answers):
                k0, k1 = int(plan.key_start[shard]), int(plan.key_start[shard + 1])
                rows[plan.order[k0:k1]] = parts[name]
            weights = c[2] if len(c) == 3 else None
            outs[name] = pool_in_order(rows, c[1], weights, mean)
        return outs
    tables = []
    for name, plan, c in zip(names, plans, checked, strict=True):
        num_bags = c[1].shape[0] - 1
        tables.append((num_bags, dims[name], parts_of(plan, name, num_bags, answers)))
    sums = reduce_partials(tables)
    if mean:
        for out, c in zip(sums, checked, strict=True):
            divide_by_counts(out, c[1])
    return dict(zip(names, sums, strict=True))


def divide_by_counts(out: F32, offsets: npt.NDArray[np.int64]) -> None:
    """Mean pooling: each non-empty bag divided by its size (float32, as the core)."""
    counts = np.diff(offsets)
    nz = counts > 0
    out[nz] /= counts[nz].astype(np.float32)[:, None]


def pool_in_order(
    rows: F32, offsets: npt.NDArray[np.int64], weights: F32 | None, mean: bool
) -> F32:
    """Pooled sums exactly as the core pools (``s = 0; s = s + w_i * row_i`` in order):
    position by position, so each bag's additions happen in its ids' order."""
    num_bags = offsets.shape[0] - 1
    out = np.zeros((num_bags, rows.shape[1]), dtype=np.float32)
    counts = np.diff(offsets)
    longest = int(counts.max()) if num_bags else 0
    starts = offsets[:-1]
    for j in range(longest):
        bags = np.nonzero(counts > j)[0]
        idx = starts[bags] + j
        term = rows[idx] if weights is None else weights[idx][:, None] * rows[idx]
        out[bags] += term
    if mean:
        divide_by_counts(out, offsets)
    return out
