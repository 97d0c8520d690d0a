"""torch.compile(fullgraph=True) over EmbeddingBagCollection, and embstore.torch without torch.

The compiled runs use backend="aot_eager": it traces the forward and the backward through
the custom ops exactly as inductor would, without a C++ compile on a 2-core machine."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="embstore.torch needs torch")

from helpers import DuckKJT, bce_step, group_export

import embstore
from embstore.torch import EmbeddingBagCollection, EmbeddingBagConfig, KeyedTensor


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection.from_configs(
            [
                EmbeddingBagConfig(
                    "items", 4, 1000, ["item", "history"], pooling="mean",
                    optimizer=embstore.Adagrad(lr=0.1), padding_id=-1,
                    initializer=embstore.Normal(std=0.3, seed=1),
                ),
                EmbeddingBagConfig(
                    "users", 4, 1000, ["user"], optimizer=embstore.Adam(lr=0.05),
                    initializer=embstore.Normal(std=0.3, seed=2),
                ),
            ]
        )  # fmt: skip
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )

    def forward(self, feats: Any) -> Any:
        out = self.ebc(feats)
        if isinstance(out, KeyedTensor):
            x = out.values()
        else:
            x = torch.cat([out["item"], out["history"], out["user"]], dim=1)
        return self.mlp(x).squeeze(1)


def batches(n: int, keyed: bool) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(11)
    out = []
    for k in range(n):
        size = 8 + k % 3  # batch sizes vary: shapes become dynamic
        parts = {}
        for name in ("item", "history", "user"):
            counts = rng.integers(0, 4, size=size)
            keys = rng.integers(-1 if name != "user" else 0, 50, size=int(counts.sum()))
            parts[name] = (keys, counts)
        if keyed:
            values = torch.from_numpy(np.concatenate([p[0] for p in parts.values()]))
            lengths = torch.from_numpy(np.concatenate([p[1] for p in parts.values()]))
            feats: Any = DuckKJT(list(parts), values, lengths)
        else:
            feats = {
                name: {"values": torch.from_numpy(keys), "lengths": torch.from_numpy(counts)}
                for name, (keys, counts) in parts.items()
            }
        labels = torch.from_numpy(rng.integers(0, 2, size=size).astype(np.float32))
        out.append((feats, labels))
    return out


def run(model: Any, params: Any, data: list[Any]) -> list[float]:
    opt = torch.optim.Adam(params, lr=0.01)
    return [bce_step(model, opt, feats, labels) for feats, labels in data]


def tables(model: Model) -> dict[str, dict[str, bytes]]:
    return {
        name: {k: v.tobytes() for k, v in rows.items()}
        for name, rows in group_export(model.ebc.group).items()
    }


@pytest.mark.parametrize("keyed", [False, True], ids=["lengths_dict", "keyed_jagged"])
def test_compiled_fullgraph_trains_exactly_like_eager(keyed: bool) -> None:
    torch._dynamo.reset()
    data = batches(20, keyed)
    eager, compiled = Model(), Model()
    compiled_fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    losses_eager = run(eager, eager.parameters(), data)
    losses_compiled = run(compiled_fn, compiled.parameters(), data)
    assert losses_compiled == losses_eager
    assert tables(compiled) == tables(eager)
    assert len(eager.ebc.group["items"]) > 20  # the rows did train
    # eval and no_grad stay read-only when compiled: nothing inserted, nothing written
    before = tables(compiled)
    compiled.eval()
    unseen = {"user": {"values": torch.tensor([10_001, 10_002]), "lengths": torch.tensor([2])}}
    with torch.no_grad():
        compiled_fn(data[0][0])
    out = torch.compile(compiled.ebc, fullgraph=True, backend="aot_eager")(unseen)
    assert out["user"].grad_fn is None
    assert not out["user"].any()
    assert tables(compiled) == before


def test_import_without_torch_says_how_to_install_the_extra() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import embstore\n"
        "try:\n"
        "    import embstore.torch\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'pip install "embstore[torch]"' in out.stdout
