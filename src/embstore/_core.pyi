# Hand-written stub of the compiled module (csrc/bindings.cpp). Private: use embstore.Table.
# Arrays must already have the exact dtype, C-contiguous layout and shape (the facade in
# embstore/table.py and embstore/group.py guarantees it); otherwise TypeError/ValueError.

from typing import Any

import numpy as np
import numpy.typing as npt

class CapacityError(RuntimeError): ...

class TimerSnapshot:
    def __init__(self) -> None: ...

def latency_between(before: TimerSnapshot, now: TimerSnapshot) -> dict[str, Any]: ...

class Table:
    def __init__(
        self,
        dim: int,
        capacity: int,
        num_shards: int,
        num_threads: int,
        eviction: int,
        optimizer: int,
        lr: float,
        eps: float,
        initial_accumulator: float,
        momentum: float,
        beta1: float,
        beta2: float,
        weight_decay: float,
        ftrl_beta: float,
        l1: float,
        l2: float,
        initializer: int,
        init_a: float,
        init_b: float,
        seed: int,
        admission_min_count: int,
        admission_width: int,
        admission_depth: int,
        stage_evicted: bool,
    ) -> None: ...
    @property
    def step(self) -> int: ...
    def set_step(self, step: int) -> None: ...
    @property
    def state_width(self) -> int: ...
    @property
    def evicted_pending(self) -> int: ...
    def evict_older_than(self, step: int, with_state: bool) -> dict[str, Any]: ...
    def drain_evicted(self) -> dict[str, Any]: ...
    @property
    def dim(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def num_shards(self) -> int: ...
    @property
    def num_threads(self) -> int: ...
    def __len__(self) -> int: ...
    @property
    def lr(self) -> float: ...
    def set_lr(self, lr: float) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def reset_timers(self) -> None: ...
    def timer_snapshot(self) -> TimerSnapshot: ...
    def lookup(
        self, keys: npt.NDArray[np.uint64], insert: bool, out: npt.NDArray[np.float32]
    ) -> None: ...
    def lookup_sum(
        self,
        keys: npt.NDArray[np.uint64],
        offsets: npt.NDArray[np.int64],
        weights: npt.NDArray[np.float32] | None,
        mode: int,
        insert: bool,
        out: npt.NDArray[np.float32],
    ) -> None: ...
    def apply_gradients(
        self,
        keys: npt.NDArray[np.uint64],
        grads: npt.NDArray[np.float32],
        offsets: npt.NDArray[np.int64] | None,
        weights: npt.NDArray[np.float32] | None,
        mode: int,
    ) -> None: ...
    def contains(self, keys: npt.NDArray[np.uint64], out: npt.NDArray[np.bool_]) -> None: ...
    def erase(self, keys: npt.NDArray[np.uint64]) -> int: ...
    def initial_values(
        self, keys: npt.NDArray[np.uint64], out: npt.NDArray[np.float32]
    ) -> None: ...

def group_lookup_sum(
    tables: list[Table],
    keys: list[npt.NDArray[np.uint64]],
    offsets: list[npt.NDArray[np.int64]],
    weights: list[npt.NDArray[np.float32] | None],
    mode: int,
    insert: bool,
    outs: list[npt.NDArray[np.float32]],
    labels: list[str],
) -> None: ...
def group_apply_gradients(
    tables: list[Table],
    keys: list[npt.NDArray[np.uint64]],
    offsets: list[npt.NDArray[np.int64]],
    grads: list[npt.NDArray[np.float32]],
    weights: list[npt.NDArray[np.float32] | None],
    mode: int,
    labels: list[str],
) -> None: ...
def hardware_threads() -> int: ...
def metrics_enabled() -> bool: ...
def set_metrics_enabled(on: bool) -> None: ...
def histogram_summary(values_ns: list[int]) -> dict[str, float]: ...
