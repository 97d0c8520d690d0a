"""The demo's in-memory CTR data set and its mini-batches.

Every example has a label and, per field, at most one feature: a ``uint64`` id and a
value (1 unless the source says otherwise). Each field is one embstore table, so a batch
is one bag per example per field: ``{field: (keys, offsets[, weights])}``, the input of
:meth:`embstore.TableGroup.lookup_sum`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Batch", "CTRData", "DataError", "Feature"]


class DataError(ValueError):
    """Data that cannot be used: an unreadable file (the message names the file, the line
    and why), or too few examples."""


Feature = (
    tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]
    | tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64], npt.NDArray[np.float32]]
)


@dataclass(frozen=True)
class Batch:
    """One mini-batch: labels ``[B]`` and the per-field bags of its examples."""

    labels: npt.NDArray[np.float32]
    features: dict[str, Feature]

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class CTRData:
    """Labelled examples, field-major.

    Attributes
    ----------
    labels : float32 [N]
        0 or 1.
    ids : uint64 [F, N]
        ``ids[f, i]``: example ``i``'s id in field ``f``.
    fields : tuple of str
        The F field (= table) names.
    values : float32 [F, N] or None
        Feature values (the per-id weights of the pooled lookup); None means all 1.
    present : bool [F, N] or None
        Whether example ``i`` has a feature in field ``f`` (an absent one is an empty
        bag); None means every feature is present.
    """

    labels: npt.NDArray[np.float32]
    ids: npt.NDArray[np.uint64]
    fields: tuple[str, ...]
    values: npt.NDArray[np.float32] | None = None
    present: npt.NDArray[np.bool_] | None = None

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        shape = (len(self.fields), n)
        if self.labels.ndim != 1:
            msg = f"labels must be 1-D, got shape {self.labels.shape}"
            raise ValueError(msg)
        for name, arr in (("ids", self.ids), ("values", self.values), ("present", self.present)):
            if arr is not None and arr.shape != shape:
                msg = f"{name} must have shape {shape} (fields, examples), got {arr.shape}"
                raise ValueError(msg)
        if len(set(self.fields)) != len(self.fields):
            msg = f"field names must be distinct, got {self.fields}"
            raise ValueError(msg)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_fields(self) -> int:
        return len(self.fields)

    def take(self, start: int, stop: int) -> CTRData:
        """Examples ``start:stop`` (views, no copy)."""
        return CTRData(
            labels=self.labels[start:stop],
            ids=self.ids[:, start:stop],
            fields=self.fields,
            values=None if self.values is None else self.values[:, start:stop],
            present=None if self.present is None else self.present[:, start:stop],
        )

    def split(self, test_fraction: float) -> tuple[CTRData, CTRData]:
        """(first part, last ``test_fraction``): the held-out part is the end of the data."""
        if not 0.0 < test_fraction < 1.0:
            msg = f"test_fraction must be in (0, 1), got {test_fraction}"
            raise ValueError(msg)
        cut = len(self) - round(len(self) * test_fraction)
        if cut <= 0 or cut >= len(self):
            msg = f"{len(self)} examples are too few to hold out {test_fraction:.0%}"
            raise DataError(msg)
        return self.take(0, cut), self.take(cut, len(self))

    def distinct_ids(self) -> list[int]:
        """Distinct present ids per field."""
        counts = []
        for f in range(self.num_fields):
            ids = self.ids[f] if self.present is None else self.ids[f][self.present[f]]
            counts.append(int(np.unique(ids).shape[0]))
        return counts

    def batch(self, start: int, stop: int) -> Batch:
        """Examples ``start:stop`` as bags, one per example per field."""
        b = stop - start
        dense_offsets = np.arange(b + 1, dtype=np.int64)
        features: dict[str, Feature] = {}
        for f, name in enumerate(self.fields):
            keys = self.ids[f, start:stop]
            weights = None if self.values is None else self.values[f, start:stop]
            offsets = dense_offsets
            if self.present is not None:
                mask = self.present[f, start:stop]
                if not mask.all():
                    keys = keys[mask]
                    weights = None if weights is None else weights[mask]
                    offsets = np.zeros(b + 1, dtype=np.int64)
                    np.cumsum(mask, out=offsets[1:])
            features[name] = (keys, offsets) if weights is None else (keys, offsets, weights)
        return Batch(labels=self.labels[start:stop], features=features)

    def batches(self, batch_size: int) -> Iterator[Batch]:
        """Consecutive batches of ``batch_size`` examples (the last one may be smaller)."""
        for start in range(0, len(self), batch_size):
            yield self.batch(start, min(start + batch_size, len(self)))

    def num_batches(self, batch_size: int) -> int:
        return -(-len(self) // batch_size)
