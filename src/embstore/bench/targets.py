"""The performance targets (bench/README.md), evaluated on one run's results.

Every target is a ratio of two figures measured in the same run, per ``(D, L)`` and per
embstore thread count, so that the verdict never compares medians from different runs. A
peer's figure is its best (lowest) median over the thread counts run: a peer that runs
slower on more threads (FBGEMM's CPU TBE, torch under contention) is never held to its
slower figure. The targets are stated at 2 threads, so the status is decided by the
value at ``TARGET_THREADS`` (or at the most threads run, when the run has no such count);
the other thread counts are shown for context. A target is ``n/a`` when a peer it needs was
not run (skipped). Nothing is rounded in embstore's favour: the value is the ratio of the
two medians as printed in the tables.

The targets are defined for W1 at full size (``--full``: U = 1e6); on other sizes the
verdicts are indicative only, which the report says.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Row = Mapping[str, Any]
#: (peer, D, L, threads) -> result row (as in the report's ``results``).
Index = Mapping[tuple[str, int, int, int], Row]

_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le}

#: The thread count the targets are stated at.
TARGET_THREADS = 2


def index_results(results: Sequence[Row]) -> dict[tuple[str, int, int, int], Row]:
    """Result rows by ``(peer, D, L, threads)`` (single-threaded peers appear in every
    thread group)."""
    return {(r["peer"], r["dim"], r["pooling"], r["threads"]): r for r in results}


def _ms(ix: Index, peer: str, d: int, lp: int, t: int, what: str) -> float | None:
    row = ix.get((peer, d, lp, t))
    val = None if row is None else row.get(what)
    return float(val) if val is not None and math.isfinite(val) and val > 0 else None


def _best_ms(ix: Index, peer: str, d: int, lp: int, what: str) -> float | None:
    """A peer's lowest median over the thread counts it ran at ``(D, L)``."""
    vals = [
        v
        for (p, dd, ll, t) in ix
        if (p, dd, ll) == (peer, d, lp) and (v := _ms(ix, peer, d, lp, t, what)) is not None
    ]
    return min(vals) if vals else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den is not None else None


@dataclass(frozen=True)
class Target:
    """One target: ``value(D, L, threads) op threshold(L)``."""

    key: str
    #: The ratio, as the targets table names it.
    text: str
    op: str
    threshold: Callable[[int], float]
    value: Callable[[Index, int, int, int], float | None]
    #: Peers whose rows the value reads (their ``others`` column is the target's noise).
    peers: tuple[str, ...]
    #: Whether the target applies at this L.
    applies: Callable[[int], bool] = lambda _lp: True


def _peer_over_embstore(peer: str, what: str) -> Callable[[Index, int, int, int], float | None]:
    def value(ix: Index, d: int, lp: int, t: int) -> float | None:
        return _ratio(_best_ms(ix, peer, d, lp, what), _ms(ix, "embstore", d, lp, t, what))

    return value


def _embstore_fwd_over_torch(ix: Index, d: int, lp: int, t: int) -> float | None:
    return _ratio(
        _ms(ix, "embstore", d, lp, t, "forward_ms"), _best_ms(ix, "torch", d, lp, "forward_ms")
    )


def _step_over_floor(ix: Index, d: int, lp: int, t: int) -> float | None:
    return _ratio(
        _ms(ix, "embstore", d, lp, t, "step_ms"), _ms(ix, "embstore", d, lp, t, "floor_ms")
    )


def _scaling(ix: Index, d: int, lp: int, t: int) -> float | None:
    if t == 1:
        return None
    return _ratio(
        _ms(ix, "embstore", d, lp, 1, "step_ms"), _ms(ix, "embstore", d, lp, t, "step_ms")
    )


#: The targets, in report order.
TARGETS: tuple[Target, ...] = (
    Target(
        "fbgemm",
        "FBGEMM step / embstore step",
        ">=",
        lambda _lp: 2.5,
        _peer_over_embstore("fbgemm", "step_ms"),
        ("embstore", "fbgemm"),
    ),
    Target(
        "floor",
        "embstore step / traffic floor",
        "<=",
        lambda _lp: 2.0,
        _step_over_floor,
        ("embstore",),
    ),
    Target(
        "pandas",
        "pandas step / embstore step",
        ">=",
        lambda _lp: 4.0,
        _peer_over_embstore("pandas", "step_ms"),
        ("embstore", "pandas"),
    ),
    Target(
        "torch_fwd",
        "embstore fwd / torch fwd",
        "<=",
        lambda lp: 1.5 if lp == 1 else 1.25,
        _embstore_fwd_over_torch,
        ("embstore", "torch"),
    ),
    Target(
        "scaling",
        "embstore step, 1 thread / N threads",
        ">=",
        lambda _lp: 1.8,
        _scaling,
        ("embstore",),
        applies=lambda lp: lp > 1,
    ),
)


@dataclass
class Verdict:
    """One target at one ``(D, L)``: the value at each embstore thread count, and the status
    (decided at ``judged_at`` threads)."""

    key: str
    text: str
    dim: int
    pooling: int
    op: str
    threshold: float
    values: dict[int, float | None] = field(default_factory=dict)
    status: str = "n/a"
    judged_at: int = TARGET_THREADS
    #: Largest ``others`` (cores used by other processes) of the rows the judged value reads.
    others_cores: float | None = None


def evaluate(
    results: Sequence[Row],
    dims: Sequence[int],
    poolings: Sequence[int],
    threads: Sequence[int],
    targets: Sequence[Target] = TARGETS,
) -> list[Verdict]:
    """Every target at every ``(D, L)`` of the run, in target order."""
    ix = index_results(results)
    judged_at = TARGET_THREADS if TARGET_THREADS in threads else max(threads)
    out = []
    for tg in targets:
        for d in dims:
            for lp in poolings:
                if not tg.applies(lp):
                    continue
                v = Verdict(tg.key, tg.text, d, lp, tg.op, tg.threshold(lp), judged_at=judged_at)
                for t in threads:
                    v.values[t] = tg.value(ix, d, lp, t)
                judged = v.values.get(judged_at)
                if judged is not None:
                    v.status = "PASS" if _OPS[tg.op](judged, v.threshold) else "MISS"
                    # The noise of the rows the judged value reads (a peer's at any count).
                    noise = [
                        float(row["others_cores"])
                        for (p, dd, ll, t), row in ix.items()
                        if (dd, ll) == (d, lp)
                        and p in tg.peers
                        and (
                            p != "embstore"
                            or t in ({judged_at, 1} if tg.key == "scaling" else {judged_at})
                        )
                        and row.get("others_cores") is not None
                    ]
                    v.others_cores = max(noise) if noise else None
                out.append(v)
    return out
