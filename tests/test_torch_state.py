"""EmbeddingBagCollection.state_dict / load_state_dict: the tables' rows and optimizer state
as tensors, a bit-for-bit training continuation, torch's strict / non-strict semantics."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="embstore.torch needs torch")

from helpers import bce_step, group_export

import embstore
from embstore.torch import EmbeddingBagCollection, EmbeddingBagConfig


def configs(dim_users: int = 3) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            "items", 4, 1000, ["item", "history"], pooling="mean",
            optimizer=embstore.Adam(lr=0.05), initializer=embstore.Normal(std=0.2, seed=1),
            padding_id=-1,
        ),
        EmbeddingBagConfig(
            "users", dim_users, 1000, ["user"], optimizer=embstore.Adagrad(lr=0.1),
            initializer=embstore.Uniform(-0.3, 0.3, seed=2),
        ),
    ]  # fmt: skip


class Model(torch.nn.Module):
    def __init__(self, dim_users: int = 3) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection.from_configs(configs(dim_users))
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(8 + dim_users, 1)

    def forward(self, feats: Any) -> Any:
        out = self.ebc(feats)
        return self.dense(torch.cat([out["item"], out["history"], out["user"]], 1)).squeeze(1)


def batches(seed: int, n: int) -> list[tuple[dict[str, Any], Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        feats = {}
        for name, universe in (("item", 40), ("history", 40), ("user", 30)):
            counts = rng.integers(0, 4, size=8)
            offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]))
            keys = rng.integers(-1, universe, size=int(offsets[-1]))  # -1: padding for items
            feats[name] = (torch.from_numpy(keys), offsets)
        out.append((feats, torch.from_numpy(rng.integers(0, 2, size=8).astype(np.float32))))
    return out


def train(model: Model, data: list[Any], first_step: int) -> list[float]:
    opt = torch.optim.SGD(model.dense.parameters(), lr=0.1)  # stateless: nothing to save
    losses = []
    for k, (feats, labels) in enumerate(data):
        model.ebc.group.set_step(first_step + k)
        losses.append(bce_step(model, opt, feats, labels))
    return losses


def assert_same_tables(a: Model, b: Model) -> None:
    ea, eb = group_export(a.ebc.group), group_export(b.ebc.group)
    for name in ea:
        assert sorted(ea[name]) == sorted(eb[name])
        for key in ea[name]:
            assert ea[name][key].tobytes() == eb[name][key].tobytes(), (name, key)
        assert a.ebc.group[name].step == b.ebc.group[name].step
        assert a.ebc.group[name].optimizer == b.ebc.group[name].optimizer


def test_state_dict_holds_every_table_as_tensors_and_no_parameters() -> None:
    model = Model()
    train(model, batches(1, 2), 0)
    sd = model.state_dict()
    items = sorted(k for k in sd if k.startswith("ebc.tables.items."))
    assert items == sorted(
        f"ebc.tables.items.{s}"
        for s in (
            *("ids", "values", "optimizer.m", "optimizer.v", "optimizer.step"),
            *("last_step", "step", "lr"),
        )
    )
    assert "ebc.tables.users.optimizer.accumulator" in sd
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    n = len(model.ebc.group["items"])
    assert n > 0
    assert tuple(sd["ebc.tables.items.values"].shape) == (n, 4)
    assert sd["ebc.tables.items.ids"].dtype == torch.int64
    assert sd["ebc.tables.items.optimizer.step"].dtype == torch.int64
    assert int(sd["ebc.tables.items.optimizer.step"].max()) >= 1
    assert [name for name, _ in model.named_parameters()] == ["dense.weight", "dense.bias"]


def test_checkpoint_then_load_into_a_fresh_model_continues_bit_for_bit() -> None:
    data = batches(7, 10)
    original = Model()
    train(original, data[:5], 0)
    original.ebc.group["users"].set_lr(0.03)  # a schedule changed the lr: restored too
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = Model()
    result = restored.load_state_dict(torch.load(buffer))
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    assert_same_tables(original, restored)
    assert restored.ebc.group["users"].optimizer.lr == 0.03
    assert train(original, data[5:], 5) == train(restored, data[5:], 5)
    assert_same_tables(original, restored)


def test_loading_replaces_the_rows_of_a_trained_model() -> None:
    source, target = Model(), Model()
    train(source, batches(3, 2), 0)
    train(target, batches(4, 3), 0)  # rows the source never saw
    target.load_state_dict(source.state_dict())
    assert_same_tables(source, target)


def test_missing_and_unexpected_table_keys_follow_torch_strictness() -> None:
    source, target = Model(), Model()
    train(source, batches(5, 2), 0)
    sd = {k: v for k, v in source.state_dict().items() if ".users." not in k}
    sd["ebc.tables.ghost.ids"] = torch.zeros(1, dtype=torch.int64)
    sd["ebc.tables.items.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="Missing key") as info:
        target.load_state_dict(sd)
    assert "ebc.tables.users.ids" in str(info.value)
    assert "ebc.tables.ghost.ids" in str(info.value)
    result = Model().load_state_dict(sd, strict=False)
    assert "ebc.tables.users.values" in result.missing_keys
    assert sorted(result.unexpected_keys) == ["ebc.tables.ghost.ids", "ebc.tables.items.extra"]
    fresh = Model()
    fresh.load_state_dict(sd, strict=False)
    assert len(fresh.ebc.group["items"]) == len(source.ebc.group["items"])  # loaded
    assert len(fresh.ebc.group["users"]) == 0  # its keys were missing: left as it was


def test_a_table_that_does_not_fit_raises_and_is_left_unchanged() -> None:
    source, target = Model(dim_users=3), Model(dim_users=5)
    train(source, batches(6, 2), 0)
    train(target, batches(6, 1), 0)
    before = target.ebc.group["users"].export()
    sd = source.state_dict()
    del sd["dense.weight"]  # another shape: torch's own check is not what is tested
    with pytest.raises(RuntimeError, match=r"size mismatch for ebc.tables.users.values"):
        target.load_state_dict(sd, strict=False)
    after = target.ebc.group["users"].export()
    for key in before:
        assert before[key].tobytes() == after[key].tobytes()
