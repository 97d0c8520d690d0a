"""Click-model metrics: ROC AUC and logloss, exact, and a streaming window of them."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["StreamingMetrics", "auc", "logloss"]

#: Probabilities are clipped to [EPS, 1 - EPS] in the logloss.
EPS = 1e-7


def auc(labels: npt.ArrayLike, scores: npt.ArrayLike) -> float:
    """Area under the ROC curve (ties count one half); NaN when one class is absent."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape:
        msg = f"labels and scores differ in length: {y.shape[0]} and {s.shape[0]}"
        raise ValueError(msg)
    positives = float(y.sum())
    negatives = float(y.shape[0]) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    # Mann-Whitney U with average ranks over ties.
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    average_rank = ends - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    rank_sum = float(average_rank[inverse][y > 0].sum())
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)


def logloss(labels: npt.ArrayLike, probabilities: npt.ArrayLike) -> float:
    """Mean binary cross-entropy (natural log), probabilities clipped to [1e-7, 1 - 1e-7]."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probabilities, dtype=np.float64).ravel(), EPS, 1.0 - EPS)
    if y.shape != p.shape:
        msg = f"labels and probabilities differ in length: {y.shape[0]} and {p.shape[0]}"
        raise ValueError(msg)
    if y.shape[0] == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


class StreamingMetrics:
    """AUC and logloss of the predictions made since the last :meth:`reset`.

    The trainer feeds it each batch's predictions made *before* the batch's update
    (progressive validation), so the window's figures are honest held-out estimates.
    """

    def __init__(self) -> None:
        self._labels: list[npt.NDArray[np.float32]] = []
        self._probabilities: list[npt.NDArray[np.float32]] = []

    def update(
        self, labels: npt.NDArray[np.float32], probabilities: npt.NDArray[np.float32]
    ) -> None:
        self._labels.append(np.asarray(labels, dtype=np.float32))
        self._probabilities.append(np.asarray(probabilities, dtype=np.float32))

    @property
    def count(self) -> int:
        return sum(x.shape[0] for x in self._labels)

    def result(self) -> tuple[float, float]:
        """(AUC, logloss) of the window."""
        if not self._labels:
            return float("nan"), float("nan")
        y = np.concatenate(self._labels)
        p = np.concatenate(self._probabilities)
        return auc(y, p), logloss(y, p)

    def reset(self) -> None:
        self._labels.clear()
        self._probabilities.clear()
