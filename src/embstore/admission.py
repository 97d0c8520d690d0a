"""Admission filters: which new ids get a row.

Long-tail ids seen once or twice would otherwise fill a table's memory and push out useful
rows. A filter counts sightings of ids that have no row yet and admits an id only once it has
been seen often enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["CountFilter"]

_MAX_COUNT = 0xFFFF  # the sketch's counters are uint16 and saturate
_MAX_DEPTH = 16
_NO_FILTER = {"admission_min_count": 0, "admission_width": 0, "admission_depth": 0}


def _int_in(name: str, value: int, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{name} must be an int, got {type(value).__name__}"
        raise TypeError(msg)
    if not low <= value <= high:
        msg = f"{name} must be in [{low}, {high}], got {value}"
        raise ValueError(msg)
    return value


@dataclass(frozen=True)
class CountFilter:
    """Admit an id once it has been seen ``min_count`` times.

    Sightings are counted in a count-min sketch of ``depth`` rows of ``width`` uint16 counters
    (``2 * width * depth`` bytes, fixed: nothing is allocated per id), with conservative
    update. A sighting is one occurrence of an id without a row in a lookup that may insert
    (``lookup``/``lookup_sum``/``TableGroup.lookup_sum`` with ``insert=True``). Until it is
    admitted, such a lookup reads zeros and inserts nothing, and ``apply_gradients`` drops the
    id's gradients (applies do not count sightings: a training step would count each id
    twice). ``stats()`` reports ``admitted`` (rows inserted) and ``rejected`` (occurrences
    kept out).

    A sketch never under-counts, so an id seen ``min_count`` times is always admitted. It may
    over-count through collisions: an id seen fewer times is admitted early with probability
    at most about ``(1 - exp(-n / width)) ** depth`` for ``n`` distinct un-admitted ids
    counted so far (:meth:`over_admission_bound`); size ``width`` to a few times the number of
    distinct long-tail ids you expect. Counts are never decayed.
    """

    min_count: int = 2
    width: int = 1 << 20
    depth: int = 4

    def __post_init__(self) -> None:
        _int_in("min_count", self.min_count, 1, _MAX_COUNT)
        _int_in("width", self.width, 1, 1 << 40)
        _int_in("depth", self.depth, 1, _MAX_DEPTH)

    def _core_args(self) -> dict[str, Any]:
        """The core constructor's admission arguments (a min_count of 1 admits every id:
        no sketch at all)."""
        if self.min_count <= 1:
            return dict(_NO_FILTER)
        return {
            "admission_min_count": self.min_count,
            "admission_width": self.width,
            "admission_depth": self.depth,
        }

    @property
    def bytes(self) -> int:
        """Memory of the sketch."""
        return 2 * self.width * self.depth

    def over_admission_bound(self, distinct_ids: int) -> float:
        """Approximate upper bound on the chance that an id seen fewer than ``min_count``
        times is admitted, after ``distinct_ids`` distinct ids were counted: the chance that
        each of its ``depth`` counters is shared with another id (plain count-min; the
        conservative update does better)."""
        load = distinct_ids / self.width
        return float((1.0 - math.exp(-load)) ** self.depth)
