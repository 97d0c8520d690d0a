"""FBGEMM's CPU TBE (table-batched embedding bags, fused Adagrad) as a peer.

``SplitTableBatchedEmbeddingBagsCodegen`` is the state of the art for this step on CPU: one
module holds all ``T`` tables, the forward is one kernel call for all of them
(``at::parallel_for`` over the batch, so it follows torch's thread count), and the
backward applies the optimizer in place (no gradient tensor is materialised). Its exact
(element-wise) Adagrad backward on CPU is a serial loop over the distinct rows of each
table.

Optional: the peer is skipped (and says how to install it) when ``fbgemm_gpu`` cannot be
imported. The CPU wheel must match the installed torch, and its pip metadata pins other
versions of torch's dependencies, hence ``--no-deps`` (:data:`FBGEMM_INSTALL`).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from embstore.bench.peer_torch import import_torch, set_torch_threads
from embstore.bench.peers import Peer, register_peer
from embstore.bench.workload import EPS, LR, Batch, F32Array, I64Array, TableData

#: How to install the peer (a pip extra cannot say ``--no-deps``). 1.8.0 is the CPU build
#: that matches torch 2.13.
FBGEMM_INSTALL = "pip install --no-deps fbgemm-gpu-cpu==1.8.0"


def import_fbgemm() -> dict[str, Any]:
    """The FBGEMM names the peer uses (imported lazily: FBGEMM is optional).

    Warnings raised while importing are silenced: fbgemm_gpu 1.8's CPU wheel warns that
    its SSD (GPU-only) optimizer invokers fail to import, which is irrelevant here.

    Raises
    ------
    ImportError
        Also when the wheel is installed but does not load (a torch it was not built
        for: undefined symbols surface as ``OSError`` / ``RuntimeError`` at import).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            training = importlib.import_module(
                "fbgemm_gpu.split_table_batched_embeddings_ops_training"
            )
            common = importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_common")
            configs = importlib.import_module("fbgemm_gpu.split_embedding_configs")
    except ImportError:
        raise
    except Exception as exc:  # a broken native library is reported as missing
        msg = f"fbgemm_gpu does not load: {type(exc).__name__}: {exc}"
        raise ImportError(msg) from exc
    return {
        "TBE": training.SplitTableBatchedEmbeddingBagsCodegen,
        "ComputeDevice": common.ComputeDevice,
        "EmbeddingLocation": common.EmbeddingLocation,
        "PoolingMode": common.PoolingMode,
        "BoundsCheckMode": common.BoundsCheckMode,
        "OptimType": configs.EmbOptimType,
        "SparseType": configs.SparseType,
    }


def tbe_inputs(batch: Batch) -> tuple[I64Array, I64Array]:
    """A batch as TBE's input: table-major concatenated rows and ``T * B + 1`` offsets.

    ``indices`` is ``rows[0] ++ rows[1] ++ ...``; bag ``b`` of table ``t`` is
    ``indices[offsets[t * B + b] : offsets[t * B + b + 1]]``.
    """
    indices = np.concatenate(batch.rows).astype(np.int64, copy=False)
    num_tables, n = len(batch.rows), batch.batch_size * batch.pooling
    bags = batch.offsets[1:].astype(np.int64, copy=False)
    offsets = np.empty(num_tables * batch.batch_size + 1, dtype=np.int64)
    offsets[0] = 0
    for t in range(num_tables):
        offsets[1 + t * batch.batch_size : 1 + (t + 1) * batch.batch_size] = bags + t * n
    return indices, offsets


@register_peer
class FbgemmTbePeer(Peer):
    """FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen``: HOST/CPU, EXACT_ADAGRAD, SUM.

    Dense tables (rows precomputed, no hashing), one module for all tables
    (``feature_table_map = [0, 1, ..., T - 1]``), fp32 weights and outputs, the rows the
    other dense peers start from (copied in through ``split_embedding_weights()``), no
    bounds check (the indices are valid by construction; FBGEMM's default would check
    every index on every forward). A step is ``out = tbe(indices, offsets)`` and
    ``out.backward(grad)``, which runs the fused Adagrad update.
    """

    name = "fbgemm"
    label = "FBGEMM CPU TBE, EXACT_ADAGRAD, dense"
    threaded = True
    hashed = False

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(threads)
        self._torch: Any = None
        self._tbe: Any = None
        self._dim = 0
        self._weights: list[Any] = []
        self._out: Any = None
        self._saved_threads: int | None = None
        #: id(batch) -> (batch, indices tensor, offsets tensor), filled by prepare().
        self._inputs: dict[int, tuple[Batch, Any, Any]] = {}
        #: (the grads list, its [B, T * D] concatenation as a tensor).
        self._grad: tuple[Sequence[F32Array], Any] | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            import_torch()
        except ImportError:
            return f"skipped: torch not installed (needed by FBGEMM; then {FBGEMM_INSTALL})"
        try:
            import_fbgemm()
        except ImportError as exc:
            return f"skipped: fbgemm_gpu not importable ({exc}); install it with {FBGEMM_INSTALL}"
        return None

    @classmethod
    def memory_bytes(cls, tables: Sequence[TableData], dim: int) -> int:
        # Dense rows, plus one table's initial rows while they are copied in.
        dense = super().memory_bytes(tables, dim)
        return dense + max((tab.universe for tab in tables), default=0) * 4 * dim

    def setup(self, tables: Sequence[TableData], dim: int) -> None:
        torch = import_torch()
        fb = import_fbgemm()
        self._torch = torch
        self._dim = dim
        self._saved_threads = set_torch_threads(torch, self.threads)
        host, cpu = fb["EmbeddingLocation"].HOST, fb["ComputeDevice"].CPU
        self._tbe = fb["TBE"](
            embedding_specs=[(tab.universe, dim, host, cpu) for tab in tables],
            feature_table_map=list(range(len(tables))),
            optimizer=fb["OptimType"].EXACT_ADAGRAD,
            learning_rate=LR,
            eps=EPS,
            pooling_mode=fb["PoolingMode"].SUM,
            weights_precision=fb["SparseType"].FP32,
            output_dtype=fb["SparseType"].FP32,
            bounds_check_mode=fb["BoundsCheckMode"].NONE,
        )
        self._weights = list(self._tbe.split_embedding_weights())
        with torch.no_grad():
            for w, tab in zip(self._weights, tables, strict=True):
                w.copy_(torch.from_numpy(tab.initial_rows(dim, seed=0)))
        # Adagrad's accumulators start at 0 (EXACT_ADAGRAD's momentum1 is zero-filled);
        # fill them explicitly so that every page is resident before timing.
        for states in self._tbe.split_optimizer_states():
            states[0].fill_(0.0)

    def prepare(self, batches: Sequence[Batch], grads: Sequence[F32Array]) -> None:
        torch = self._torch
        self._inputs = {}
        for batch in batches:
            indices, offsets = tbe_inputs(batch)
            self._inputs[id(batch)] = (batch, torch.from_numpy(indices), torch.from_numpy(offsets))
        self._grad_tensor(grads)

    def _batch_inputs(self, batch: Batch) -> tuple[Any, Any]:
        hit = self._inputs.get(id(batch))
        if hit is not None and hit[0] is batch:
            return hit[1], hit[2]
        indices, offsets = tbe_inputs(batch)  # not prepared: convert now
        return self._torch.from_numpy(indices), self._torch.from_numpy(offsets)

    def _grad_tensor(self, grads: Sequence[F32Array]) -> Any:
        if self._grad is None or self._grad[0] is not grads:
            cat = np.ascontiguousarray(np.concatenate(list(grads), axis=1), dtype=np.float32)
            self._grad = (grads, self._torch.from_numpy(cat))
        return self._grad[1]

    def forward(self, batch: Batch) -> Sequence[Any]:
        indices, offsets = self._batch_inputs(batch)
        self._out = self._tbe(indices, offsets)
        d = self._dim
        return [self._out[:, t * d : (t + 1) * d] for t in range(len(batch.rows))]

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        self._out.backward(self._grad_tensor(grads))
        self._out = None

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        r = batch.rows[table]
        acc = self._tbe.split_optimizer_states()[table][0]
        return (
            self._weights[table].numpy()[r].copy(),
            acc.detach().numpy().reshape(-1, self._dim)[r].copy(),
        )

    def close(self) -> None:
        self._out = None
        self._inputs = {}
        self._grad = None
        self._weights.clear()
        self._tbe = None
        if self._torch is not None and self._saved_threads is not None:
            self._torch.set_num_threads(self._saved_threads)
