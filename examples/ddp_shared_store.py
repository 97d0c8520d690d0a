"""Two training processes, one embedding store: the dense part of the model under
DistributedDataParallel (gloo, CPU), the embeddings in ONE embstore parameter server that
both processes call.

    PYTHONPATH=src python examples/ddp_shared_store.py [--world-size 2] [--steps 10]

Without ``--ps HOST:PORT`` the script serves the tables itself, on 127.0.0.1, from this
process. Needs the torch and ps extras: ``pip install "embstore[torch,ps]"``. The recipe is
described in docs/torch.md ("Multi-process training with DDP").
"""

from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import embstore
from embstore import ps
from embstore.torch import EmbeddingBagCollection, EmbeddingBagConfig

BATCH = 16  # examples per process and step
SHARED_IDS = 24  # ids 1..SHARED_IDS may be drawn by every process


def configs() -> list[EmbeddingBagConfig]:
    """The tables: every process builds its module from the same configs."""
    return [
        EmbeddingBagConfig(
            "items",
            8,
            10_000,
            ["item", "history"],
            pooling="mean",
            optimizer=embstore.Adam(lr=0.01),
        ),
        EmbeddingBagConfig("users", 4, 10_000, ["user"], optimizer=embstore.SGD(lr=0.05)),
    ]


def tables() -> embstore.TableGroup:
    """The one store, built where it is served (capacity: no eviction in this short run)."""
    return embstore.TableGroup({c.name: c.build_table() for c in configs()})


class Model(torch.nn.Module):
    def __init__(self, store: Any) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection.from_configs(configs(), backend=store)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(self.ebc.output_dim, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, features: dict[str, Any]) -> torch.Tensor:
        out = self.ebc(features)
        x = torch.cat([out["item"], out["history"], out["user"]], 1)
        return self.mlp(x).squeeze(1)


def batch(rank: int, step: int) -> tuple[dict[str, Any], torch.Tensor]:
    """A synthetic batch: ids 1..SHARED_IDS are drawn by every rank, the rest are the
    rank's own (10_000 * (rank + 1) + ...), so both shared and private rows get updates."""
    rng = np.random.default_rng([rank, step])

    def ids(n: int) -> torch.Tensor:
        own = 10_000 * (rank + 1) + rng.integers(0, 100, n)
        shared = rng.integers(1, SHARED_IDS + 1, n)
        return torch.from_numpy(np.where(rng.random(n) < 0.5, shared, own))

    history_len = torch.from_numpy(rng.integers(1, 4, BATCH))
    features = {
        "item": (ids(BATCH), torch.arange(BATCH + 1)),
        "history": {"values": ids(int(history_len.sum())), "lengths": history_len},
        "user": (ids(BATCH), torch.arange(BATCH + 1)),
    }
    labels = torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32))
    return features, labels


class RecordingStore:
    """The store, plus a copy of every gradient push that returned (to check afterwards
    that each arrived exactly once). Not needed for training."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.pushes: list[tuple[str, dict[str, tuple[np.ndarray, ...]]]] = []

    def lookup_sum(self, features: Any, *, mode: str = "sum", insert: bool = True) -> Any:
        return self.store.lookup_sum(features, mode=mode, insert=insert)

    def apply_gradients(self, grads: Any, *, mode: str = "sum") -> None:
        self.store.apply_gradients(grads, mode=mode)
        copied = {name: tuple(np.array(a) for a in entry) for name, entry in grads.items()}
        self.pushes.append((mode, copied))


def worker(
    rank: int, world_size: int, ps_address: str, init_method: str, steps: int, record: str | None
) -> None:
    """One training process: DDP for the dense part, the PS client for the embeddings."""
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        torch.manual_seed(rank)  # different on purpose: DDP broadcasts rank 0's parameters
        client = ps.Client(ps_address, timeout=60)
        store: Any = client if record is None else RecordingStore(client)
        model = DistributedDataParallel(Model(store))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)  # the dense part only
        losses = []
        for step in range(steps):
            features, labels = batch(rank, step)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(features), labels)
            opt.zero_grad()
            loss.backward()  # all-reduces the dense gradients; pushes the rows' to the PS
            opt.step()
            losses.append(loss.item())
        print(f"rank={rank} steps={steps} first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f}")
        if record is not None:
            dense = {k: v.detach().clone() for k, v in model.module.named_parameters()}
            out = {"pushes": store.pushes, "dense": dense, "losses": losses}
            with open(os.path.join(record, f"rank{rank}.pkl"), "wb") as f:
                pickle.dump(out, f)
        client.close()
    finally:
        dist.destroy_process_group()


def launch(
    ps_address: str,
    *,
    world_size: int = 2,
    steps: int = 10,
    record: str | None = None,
    timeout: float = 120.0,
) -> None:
    """Start ``world_size`` workers on this machine and wait for them (at most ``timeout``
    seconds: then every worker is killed and ``TimeoutError`` raised)."""
    with tempfile.TemporaryDirectory() as rendezvous:
        init_method = "file://" + os.path.join(rendezvous, "init")
        args = (world_size, ps_address, init_method, steps, record)
        context = mp.spawn(worker, args=args, nprocs=world_size, join=False)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"workers still running after {timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ps", help="HOST:PORT of a running embstore PS with configs()' tables")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo on loopback
    if args.ps:
        launch(args.ps, world_size=args.world_size, steps=args.steps)
        return
    group = tables()
    with ps.serve(group, port=0, host="127.0.0.1") as server:
        launch(f"127.0.0.1:{server.port}", world_size=args.world_size, steps=args.steps)
    print({name: len(group[name]) for name in group.names}, "rows in the shared store")


if __name__ == "__main__":
    main()
