"""The demo's training loop and held-out evaluation, for any model with a train step."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

import embstore
from embstore.demo.data import Batch, CTRData
from embstore.demo.evaluation import StreamingMetrics, auc, logloss
from embstore.demo.report import LogRecord, ProgressBar, latency_window

__all__ = ["Model", "TrainResult", "evaluate", "train"]


class Model(Protocol):
    """What the loop needs from a model."""

    @property
    def group(self) -> embstore.TableGroup: ...

    def train_step(self, batch: Batch) -> npt.NDArray[np.float32]:
        """Update on ``batch``; return its click probabilities from *before* the update."""
        ...

    def predict(self, batch: Batch) -> npt.NDArray[np.float32]:
        """Click probabilities, read-only (the store is not changed)."""
        ...


@dataclass
class TrainResult:
    """Totals of a run. ``seconds`` is the time of the training steps (batching, forward,
    backward, updates), without logging and evaluation."""

    steps: int = 0
    examples: int = 0
    seconds: float = 0.0
    records: list[LogRecord] = field(default_factory=list)

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0


def train(
    model: Model,
    data: CTRData,
    *,
    epochs: int,
    batch_size: int,
    log_every: int,
    on_record: Callable[[LogRecord], None] | None = None,
    progress: ProgressBar | None = None,
) -> TrainResult:
    """Train ``epochs`` passes over ``data`` in order; every ``log_every`` steps (and at the
    end of each epoch) make a :class:`LogRecord` of the window since the previous one."""
    result = TrainResult()
    window = StreamingMetrics()
    window_examples, window_seconds = 0, 0.0
    latency_window(model.group)  # start the latency window with the training
    num_batches = data.num_batches(batch_size)
    for epoch in range(1, epochs + 1):
        for i in range(num_batches):
            start = time.perf_counter()
            batch = data.batch(i * batch_size, min((i + 1) * batch_size, len(data)))
            probabilities = model.train_step(batch)
            elapsed = time.perf_counter() - start
            window.update(batch.labels, probabilities)
            result.steps += 1
            result.examples += len(batch)
            result.seconds += elapsed
            window_examples += len(batch)
            window_seconds += elapsed
            if result.steps % log_every == 0 or i == num_batches - 1:
                window_auc, window_logloss = window.result()
                record = LogRecord(
                    step=result.steps,
                    epoch=epoch,
                    examples=result.examples,
                    auc=window_auc,
                    logloss=window_logloss,
                    examples_per_s=window_examples / window_seconds if window_seconds else 0.0,
                    latency_us=latency_window(model.group),
                )
                result.records.append(record)
                window.reset()
                window_examples, window_seconds = 0, 0.0
                if progress is not None:
                    progress.clear()
                if on_record is not None:
                    on_record(record)
            if progress is not None:
                progress.update(result.steps, _progress_note(result))
    if progress is not None:
        progress.clear()
    return result


def _progress_note(result: TrainResult) -> str:
    if not result.records:
        return ""
    last = result.records[-1]
    return f"auc={last.auc:.4f} examples/s={last.examples_per_s:.0f}"


def evaluate(model: Model, data: CTRData, batch_size: int = 4096) -> tuple[float, float]:
    """(AUC, logloss) of ``model`` on ``data``, read-only."""
    probabilities = np.concatenate([model.predict(b) for b in data.batches(batch_size)])
    return auc(data.labels, probabilities), logloss(data.labels, probabilities)
