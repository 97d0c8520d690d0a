"""torch ``embedding_bag`` + sparse Adagrad as a peer (optional: skipped without torch)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from embstore.bench.peers import Peer, register_peer
from embstore.bench.workload import EPS, LR, Batch, F32Array, TableData


def import_torch() -> Any:
    """Import torch (lazily: it is an optional peer)."""
    return importlib.import_module("torch")


def set_torch_threads(torch: Any, threads: int | None) -> int:
    """Set torch's intra-op thread count (its OpenMP pool too) unless ``threads`` is None.

    Returns
    -------
    int
        The count before the call, for the peer's ``close`` to restore.
    """
    saved = int(torch.get_num_threads())
    if threads is not None:
        torch.set_num_threads(threads)
    return saved


def apply_omp_wait_policy(policy: str) -> str:
    """Set ``OMP_WAIT_POLICY`` for torch's OpenMP workers before torch is imported.

    ``policy`` is ``"torch-default"`` (leave the environment alone), ``"active"`` or
    ``"passive"``. Measured on the 2-core development VM, W1 at U=1e6, torch with 2
    threads: on a quiet machine the active wait (libgomp's default) is faster (L=1 step
    6.7-8.3 ms against 13.7-16.9 ms passive); when another process holds a core, an
    actively waiting worker spins through the other thread's time slice and every parallel
    region costs a scheduler tick (L=1 backward 130 ms active against 11 ms passive).

    Returns
    -------
    str
        The policy in effect, as reported in the header.
    """
    if policy in ("active", "passive"):
        if "torch" in sys.modules:
            return f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} (torch already imported)"
        os.environ["OMP_WAIT_POLICY"] = policy.upper()
    return os.environ.get("OMP_WAIT_POLICY", "unset (libgomp default: active)")


@register_peer
class TorchEmbeddingBagPeer(Peer):
    """torch ``embedding_bag(mode="sum", sparse=True)`` + ``torch.optim.Adagrad``, dense."""

    name = "torch"
    label = "torch embedding_bag + sparse Adagrad, dense"
    threaded = True
    hashed = False

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(threads)
        self._torch: Any = None
        self._weights: list[Any] = []
        self._opt: Any = None
        self._outs: list[Any] = []
        self._saved_threads: int | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            import_torch()
        except ImportError:
            return "skipped: torch not installed"
        return None

    def setup(self, tables: Sequence[TableData], dim: int) -> None:
        torch = import_torch()
        self._torch = torch
        # The default (no checks) made explicit, which also silences the warning
        # torch.optim.Adagrad would print on its first sparse step.
        torch.sparse.check_sparse_tensor_invariants.disable()
        self._saved_threads = set_torch_threads(torch, self.threads)
        for tab in tables:
            w = torch.from_numpy(tab.initial_rows(dim, seed=0))
            self._weights.append(torch.nn.Parameter(w))
        self._opt = torch.optim.Adagrad(
            self._weights, lr=LR, eps=EPS, initial_accumulator_value=0.0
        )

    def forward(self, batch: Batch) -> Sequence[Any]:
        torch = self._torch
        fn = torch.nn.functional.embedding_bag
        offsets = torch.from_numpy(batch.offsets)
        self._outs = [
            fn(torch.from_numpy(r), w, offsets, mode="sum", sparse=True, include_last_offset=True)
            for w, r in zip(self._weights, batch.rows, strict=True)
        ]
        return self._outs

    def backward(self, batch: Batch, grads: Sequence[F32Array]) -> None:
        torch = self._torch
        torch.autograd.backward(self._outs, [torch.from_numpy(g) for g in grads])
        self._opt.step()
        self._opt.zero_grad(set_to_none=True)
        self._outs = []

    def read_rows(self, table: int, batch: Batch) -> tuple[F32Array, F32Array | None]:
        r = batch.rows[table]
        w = self._weights[table]
        state = self._opt.state.get(w, {})
        acc = state.get("sum")
        return (
            w.detach().numpy()[r].copy(),
            None if acc is None else acc.numpy()[r].copy(),
        )

    def close(self) -> None:
        self._outs = []
        self._opt = None
        self._weights.clear()
        if self._torch is not None and self._saved_threads is not None:
            self._torch.set_num_threads(self._saved_threads)
