"""embstore.torch the TorchRec way: configs, shared tables, per-table pooling, padding ids,
the lengths / jagged / KeyedJaggedTensor inputs, KeyedTensor outputs, duck-typed stores."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="embstore.torch needs torch")

from helpers import DuckKJT
from reference import per_id_grads, pool

import embstore
from embstore.torch import EmbeddingBagCollection, EmbeddingBagConfig, KeyedTensor

U = embstore.Uniform(-0.5, 0.5, seed=3)


def configs(pad: int | None = None, opt: Any = None) -> list[EmbeddingBagConfig]:
    """Table "items" (mean) read by two features, table "users" (sum) by one."""
    opt = opt if opt is not None else embstore.SGD(lr=1.0)
    return [
        EmbeddingBagConfig(
            "items", 4, 1000, ["item", "history"], pooling="mean", optimizer=opt,
            initializer=U, padding_id=pad,
        ),
        EmbeddingBagConfig("users", 3, 1000, ["user"], optimizer=opt, initializer=U),
    ]  # fmt: skip


class OffsetsOnlyKJT:
    """A KeyedJaggedTensor-like object that only offers offsets()."""

    def __init__(self, keys: list[str], values: Any, offsets: Any) -> None:
        self._keys, self._values, self._offsets = keys, values, offsets

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Any:
        return self._values

    def offsets(self) -> Any:
        return self._offsets

    def weights_or_none(self) -> None:
        return None


def csr(rng: np.random.Generator, bags: int, universe: int, pad: int | None = None) -> Any:
    counts = rng.integers(0, 5, size=bags)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    wide = pad is not None and pad >= 2**63  # uint64 keys, so the padding id fits
    keys = rng.integers(0, universe, size=int(offsets[-1])).astype(np.uint64 if wide else np.int64)
    if pad is not None and keys.size:
        keys[rng.random(keys.size) < 0.3] = pad
    return keys, offsets


def stored(table: embstore.Table, keys: Any) -> npt.NDArray[np.float32]:
    return table.lookup(np.asarray(keys, dtype=np.int64), insert=False)


# -- configs ------------------------------------------------------------------------------


def test_from_configs_builds_tables_and_reports_configs_dims_and_repr() -> None:
    ebc = EmbeddingBagCollection.from_configs(configs(pad=-1))
    assert isinstance(ebc.group, embstore.TableGroup)
    assert ebc.group.names == ["items", "users"]
    assert ebc.group["items"].dim == 4
    assert ebc.group["items"].capacity >= 1000
    assert [c.name for c in ebc.embedding_bag_configs()] == ["items", "users"]
    assert ebc.output_dims() == {"item": 4, "history": 4, "user": 3}
    assert ebc.output_dim == 11
    assert ebc.feature_names() == ["item", "history", "user"]
    assert list(ebc.parameters()) == []
    text = repr(ebc)
    assert "items: dim=4, pooling='mean', features=['item', 'history'], padding_id=-1" in text
    assert "users: dim=3, pooling='sum'" in text
    with pytest.raises(AttributeError):
        ebc.group = embstore.TableGroup({})  # type: ignore[misc]  # the ops hold the store
    ebc.group["users"].close()
    assert "users: dim=3" in repr(ebc)  # a closed table does not break the repr
    with pytest.raises(ValueError, match="mode"):
        EmbeddingBagCollection(ebc.group, mode="mean", configs=configs())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pooling": "max"}, ValueError, "pooling"),
        ({"feature_names": []}, ValueError, "feature_names"),
        ({"feature_names": "item"}, TypeError, "feature_names"),
        ({"feature_names": ["a", "a"]}, ValueError, "duplicates"),
        ({"embedding_dim": 0}, ValueError, "embedding_dim"),
        ({"num_embeddings": 1.5}, TypeError, "num_embeddings"),
        ({"padding_id": 2**64}, ValueError, "padding_id"),
        ({"padding_id": "x"}, TypeError, "padding_id"),
        ({"table_options": {"dim": 3}}, ValueError, "table_options"),
    ],
)
def test_config_validation_names_the_argument(kwargs: Any, error: Any, match: str) -> None:
    args = {"name": "t", "embedding_dim": 4, "num_embeddings": 10, "feature_names": ["a"]}
    with pytest.raises(error, match=match):
        EmbeddingBagConfig(**{**args, **kwargs})


def test_from_configs_rejects_a_feature_in_two_tables_and_duplicate_names() -> None:
    a = EmbeddingBagConfig("a", 2, 10, ["f"])
    with pytest.raises(ValueError, match="feature 'f'"):
        EmbeddingBagCollection.from_configs([a, EmbeddingBagConfig("b", 2, 10, ["f"])])
    with pytest.raises(ValueError, match="two tables"):
        EmbeddingBagCollection.from_configs([a, EmbeddingBagConfig("a", 2, 10, ["g"])])
    with pytest.raises(TypeError, match="sequence"):
        EmbeddingBagCollection.from_configs(a)  # type: ignore[arg-type]


# -- shared tables, per-table pooling, one store call each way ----------------------------


def test_shared_table_and_mixed_pooling_match_the_reference_with_one_call_each_way(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    ebc = EmbeddingBagCollection.from_configs(configs())
    group = ebc.group
    calls: list[tuple[str, list[str], str]] = []
    lookup, apply = embstore.TableGroup.lookup_sum, embstore.TableGroup.apply_gradients

    def spy_lookup(self: Any, feats: Any, **kw: Any) -> Any:
        calls.append(("lookup", list(feats), kw["mode"]))
        return lookup(self, feats, **kw)

    def spy_apply(self: Any, grads: Any, **kw: Any) -> Any:
        calls.append(("apply", list(grads), kw["mode"]))
        return apply(self, grads, **kw)

    monkeypatch.setattr(embstore.TableGroup, "lookup_sum", spy_lookup)
    monkeypatch.setattr(embstore.TableGroup, "apply_gradients", spy_apply)
    item, history, user = csr(rng, 5, 30), csr(rng, 5, 30), csr(rng, 5, 30)
    w = rng.uniform(-1, 1, size=user[0].shape[0]).astype(np.float32)
    feats = {"item": item, "history": history, "user": (*user, w)}
    out = ebc({k: tuple(map(torch.from_numpy, v)) for k, v in feats.items()})
    assert calls == [("lookup", ["items", "users"], "sum")]
    table = group["items"]
    for name, (keys, offsets) in (("item", item), ("history", history)):
        want = pool(table.initial_values(keys), offsets, mode="mean")
        np.testing.assert_array_equal(out[name].detach().numpy(), want)
        # bitwise what the table's own mean pooling gives
        got = table.lookup_sum(keys, offsets, mode="mean", insert=False)
        np.testing.assert_array_equal(out[name].detach().numpy(), got)
    want_user = pool(group["users"].initial_values(user[0]), user[1], w)
    np.testing.assert_array_equal(out["user"].detach().numpy(), want_user)

    g = {k: rng.normal(size=tuple(v.shape)).astype(np.float32) for k, v in out.items()}
    sum((out[k] * torch.from_numpy(g[k])).sum() for k in out).backward()
    assert calls[1:] == [("apply", ["items", "users"], "sum")]
    # SGD lr=1: each row minus its per-occurrence gradients (mean: c = 1 / count)
    keys = np.concatenate([item[0], history[0]])
    offsets = np.concatenate([item[1], history[1][1:] + item[1][-1]])
    grads = per_id_grads(
        keys.size, np.concatenate([g["item"], g["history"]]), offsets, None, "mean"
    )
    expect: dict[int, npt.NDArray[np.float32]] = {}
    for k, gi in zip(keys.tolist(), grads, strict=True):
        expect[k] = expect.get(k, np.zeros(4, np.float32)) + gi
    ids = sorted(expect)
    want_rows = table.initial_values(np.array(ids)) - np.stack([expect[i] for i in ids])
    np.testing.assert_allclose(stored(table, ids), want_rows, rtol=1e-6, atol=1e-6)


def test_mixed_pooling_trains_bitwise_like_the_tables_own_mean(rng: np.random.Generator) -> None:
    opt = embstore.Adagrad(lr=0.1)
    ebc = EmbeddingBagCollection.from_configs(configs(opt=opt))
    twin = embstore.Table(dim=4, capacity=1000, optimizer=opt, initializer=U)
    for _ in range(3):
        item, user = csr(rng, 6, 20), csr(rng, 6, 20)
        out = ebc({"item": item, "user": user})  # "sum" call: mean is scaled by the module
        g = rng.normal(size=(6, 4)).astype(np.float32)
        (out["item"] * torch.from_numpy(g)).sum().backward()
        pooled = twin.lookup_sum(*item, mode="mean")
        np.testing.assert_array_equal(out["item"].detach().numpy(), pooled)
        twin.apply_gradients(item[0], g, offsets=item[1], mode="mean")
    ids = np.arange(20)
    seen = twin.contains(ids)
    assert seen.any()
    np.testing.assert_array_equal(stored(ebc.group["items"], ids[seen]), stored(twin, ids[seen]))


# -- padding ids --------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pad=st.sampled_from([-1, 0, 7, 2**64 - 1]))
def test_padding_id_contributes_nothing_gets_no_row_and_no_update(seed: int, pad: int) -> None:
    rng = np.random.default_rng(seed)
    ebc = EmbeddingBagCollection.from_configs(configs(pad=pad))
    table = ebc.group["items"]
    item, history = csr(rng, 4, 12, pad), csr(rng, 3, 12, pad)
    out = ebc({"item": item, "history": history})
    grads = {}
    for name, (keys, offsets) in (("item", item), ("history", history)):
        keep = keys != keys.dtype.type(pad)
        kept = np.concatenate([[0], np.cumsum(keep)])[offsets]
        rows = table.initial_values(keys[keep])
        want = pool(rows, kept, mode="mean")  # the mean counts real ids only
        np.testing.assert_array_equal(out[name].detach().numpy(), want)
        grads[name] = (keys[keep], kept, rng.normal(size=(offsets.size - 1, 4)).astype(np.float32))
    pad_key = np.array([pad % 2**64], dtype=np.uint64)
    assert not table.contains(pad_key).any()
    loss = sum((out[k] * torch.from_numpy(g[2])).sum() for k, g in grads.items())
    loss.backward()  # type: ignore[union-attr]
    assert not table.contains(pad_key).any()
    expect: dict[int, npt.NDArray[np.float32]] = {}
    for keys, offsets, g in grads.values():
        for k, gi in zip(
            keys.tolist(), per_id_grads(keys.size, g, offsets, None, "mean"), strict=True
        ):
            expect[k] = expect.get(k, np.zeros(4, np.float32)) + gi
    if expect:
        ids = sorted(expect)
        want = table.initial_values(np.array(ids, dtype=np.uint64)) - np.stack(
            [expect[i] for i in ids]
        )
        got = table.lookup(np.array(ids, dtype=np.uint64), insert=False)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert len(table) == len(expect)


# -- input forms --------------------------------------------------------------------------


def test_every_input_form_gives_the_same_pooled_rows(rng: np.random.Generator) -> None:
    ebc = EmbeddingBagCollection.from_configs(configs()).eval()
    EmbeddingBagCollection.train(ebc)
    item, history, user = csr(rng, 4, 20), csr(rng, 4, 20), csr(rng, 4, 20)
    w = rng.uniform(0.5, 2, size=user[0].size).astype(np.float32)
    ebc({"item": item, "history": history, "user": (*user, w)})  # train-mode: insert rows
    ebc.eval()
    t = {
        k: tuple(map(torch.from_numpy, v)) for k, v in {"i": item, "h": history, "u": user}.items()
    }
    by_csr = ebc({"item": t["i"], "history": t["h"], "user": (*t["u"], torch.from_numpy(w))})
    lengths = {k: torch.from_numpy(np.diff(v[1])) for k, v in {"i": item, "u": user}.items()}
    by_lengths = ebc(
        {
            "item": {"values": t["i"][0], "lengths": lengths["i"]},
            "history": {"values": t["h"][0], "offsets": t["h"][1]},
            "user": {"values": t["u"][0], "lengths": lengths["u"], "weights": w},
        }
    )
    by_jagged = ebc({"item": DuckKJT([], t["i"][0], lengths["i"])})
    kjt_w = np.concatenate([np.ones(item[0].size + history[0].size, np.float32), w])
    values = torch.from_numpy(np.concatenate([item[0], history[0], user[0]]))
    lens = torch.from_numpy(np.concatenate([np.diff(v[1]) for v in (item, history, user)]))
    kt = ebc(DuckKJT(["item", "history", "user"], values, lens, torch.from_numpy(kjt_w)))
    assert isinstance(kt, KeyedTensor)
    assert kt.keys() == ["item", "history", "user"]
    assert kt.length_per_key() == [4, 4, 3]
    assert kt.offset_per_key() == [0, 4, 8, 11]
    assert tuple(kt.values().shape) == (4, 11)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    unweighted = ebc(
        OffsetsOnlyKJT(["item", "history"], values[: len(values) - user[0].size], offsets[:9])
    )
    for name in ("item", "history", "user"):
        want = by_csr[name]
        torch.testing.assert_close(by_lengths[name], want, rtol=0, atol=0)
        torch.testing.assert_close(kt.to_dict()[name], want, rtol=0, atol=0)
        torch.testing.assert_close(kt[name], want, rtol=0, atol=0)
    torch.testing.assert_close(by_jagged["item"], by_csr["item"], rtol=0, atol=0)
    torch.testing.assert_close(unweighted.to_dict()["history"], by_csr["history"], rtol=0, atol=0)
    torch.testing.assert_close(kt.values()[:, 8:], by_csr["user"], rtol=0, atol=0)


def test_keyed_jagged_backward_reaches_every_table(rng: np.random.Generator) -> None:
    ebc = EmbeddingBagCollection.from_configs(configs())
    values = torch.tensor([1, 2, 3, 4, 5, 6])
    kt = ebc(DuckKJT(["item", "user"], values, torch.tensor([2, 1, 1, 2])))
    before = {n: len(t) for n, t in ebc.group.items()}
    assert before == {"items": 3, "users": 3}
    init = ebc.group["users"].initial_values(np.array([4, 5, 6]))
    kt.values().sum().backward()
    np.testing.assert_allclose(stored(ebc.group["users"], [4, 5, 6]), init - 1.0, rtol=1e-6)


@pytest.mark.parametrize(
    ("feats", "error", "match"),
    [
        ({"item": {"values": [1], "lengths": [1], "offsets": [0, 1]}}, ValueError, "one of"),
        ({"item": {"lengths": [1]}}, ValueError, "'values'"),
        ({"item": [1, 2]}, ValueError, "JaggedTensor"),
        ({"item": ([1, 2], [0, 1])}, ValueError, "offsets"),
        ({"item": {"values": [1, 2], "lengths": [3]}}, ValueError, "lengths"),
        ({"item": {"values": [1, 2], "lengths": [-1, 3]}}, ValueError, ">= 0"),
        ({"nope": ([1], [0, 1])}, KeyError, "unknown feature 'nope'"),
        ({"user": ([1, 2], [0, 2], [1.0])}, ValueError, r"features\['user'\]: weights"),
        ({"item": ([1, 2], [0, 3])}, ValueError, r"features\['item'\]: offsets"),  # padded
        ({"user": ([1.5], [0, 1])}, TypeError, r"features\['user'\]: values"),
    ],
)
def test_bad_inputs_raise_naming_the_feature(feats: Any, error: Any, match: str) -> None:
    ebc = EmbeddingBagCollection.from_configs(configs(pad=-1))
    with pytest.raises(error, match=match):
        ebc(feats)
    assert all(len(t) == 0 for t in ebc.group.values())


def test_keyed_jagged_whose_bags_do_not_split_evenly_raises() -> None:
    ebc = EmbeddingBagCollection.from_configs(configs())
    with pytest.raises(ValueError, match="do not split"):
        ebc(DuckKJT(["item", "user"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1])))


# -- any store with TableGroup's interface ------------------------------------------------


class DuckStore:
    """Not a TableGroup, not a mapping: only lookup_sum and apply_gradients (as a sharded or
    remote store offers them); forwards to a TableGroup and records the calls."""

    def __init__(self, group: embstore.TableGroup) -> None:
        self.group = group
        self.calls: list[str] = []

    def lookup_sum(self, features: Any, *, mode: str = "sum", insert: bool = True) -> Any:
        self.calls.append(f"lookup insert={insert}")
        return self.group.lookup_sum(features, mode=mode, insert=insert)

    def apply_gradients(self, grads: Any, *, mode: str = "sum") -> None:
        self.calls.append("apply")
        self.group.apply_gradients(grads, mode=mode)


def test_a_duck_typed_store_plugs_in_through_from_configs() -> None:
    cfg = configs()
    group = embstore.TableGroup({c.name: c.build_table() for c in cfg})
    store = DuckStore(group)
    ebc = EmbeddingBagCollection.from_configs(cfg, backend=store)
    out = ebc({"item": (torch.tensor([1, 2]), torch.tensor([0, 2])), "user": ([3], [0, 1])})
    (out["item"].sum() + out["user"].sum()).backward()
    with torch.no_grad():
        ebc({"user": ([3], [0, 1])})
    assert store.calls == ["lookup insert=True", "apply", "lookup insert=False"]
    assert group["users"].contains(np.array([3])).all()
    with pytest.raises(TypeError, match="configs"):
        EmbeddingBagCollection(store)
    with pytest.raises(TypeError, match="lookup_sum"):
        EmbeddingBagCollection(object())
    with pytest.warns(UserWarning, match="NOT in the state_dict"):
        assert ebc.state_dict() == {}


class NumpyStore:
    """A pure-Python store with TableGroup's two calls (SGD, zero initial rows): it pickles,
    so a module over it can be deep-copied."""

    def __init__(self, dims: dict[str, int], lr: float = 1.0) -> None:
        self.dims, self.lr = dims, lr
        self.rows: dict[str, dict[int, Any]] = {name: {} for name in dims}

    def _row(self, name: str, key: int, insert: bool) -> Any:
        rows = self.rows[name]
        if key not in rows and insert:
            rows[key] = np.zeros(self.dims[name], np.float32)
        return rows.get(key, np.zeros(self.dims[name], np.float32))

    def lookup_sum(self, features: Any, *, mode: str = "sum", insert: bool = True) -> Any:
        out = {}
        for name, (keys, offsets, *w) in features.items():
            rows = [self._row(name, int(k), insert) for k in keys]
            out[name] = pool(np.array(rows).reshape(len(keys), -1), offsets, *w, mode=mode)
        return out

    def apply_gradients(self, grads: Any, *, mode: str = "sum") -> None:
        for name, (keys, offsets, g, *w) in grads.items():
            for k, gi in zip(
                keys, per_id_grads(len(keys), g, offsets, *(w or [None]), mode), strict=True
            ):
                self.rows[name][int(k)] = self._row(name, int(k), True) - self.lr * gi


def test_a_module_over_a_picklable_store_deep_copies_into_an_independent_one() -> None:
    cfg = [EmbeddingBagConfig("t", 2, 100, ["f", "g"], pooling="mean", padding_id=0)]
    ebc = EmbeddingBagCollection.from_configs(cfg, backend=NumpyStore({"t": 2}))
    twin = copy.deepcopy(ebc)
    assert twin.group is not ebc.group
    assert twin._binding.handle != ebc._binding.handle
    feats = {"f": ([1, 2, 0], [0, 2, 3]), "g": ([2], [0, 1])}
    out = twin(feats)
    (out["f"].sum() + 2 * out["g"].sum()).backward()
    assert ebc.group.rows["t"] == {}
    # f: bag {1, 2} mean (grad 1/2 each), bag {0} = padding only; g: bag {2}, grad 2
    np.testing.assert_allclose(twin.group.rows["t"][1], [-0.5, -0.5])
    np.testing.assert_allclose(twin.group.rows["t"][2], [-2.5, -2.5])
    assert 0 not in twin.group.rows["t"]


def test_the_python_blocks_of_docs_torch_md_run() -> None:
    text = (Path(__file__).parent.parent / "docs" / "torch.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) >= 2
    exec(compile("\n".join(blocks), "docs/torch.md", "exec"), {})  # noqa: S102


class VariableStrideKJT(DuckKJT):
    """A KeyedJaggedTensor whose keys have different batch sizes."""

    def __init__(self, keys: list[str], values: Any, lengths: Any, strides: list[int]) -> None:
        super().__init__(keys, values, lengths)
        self._strides = strides

    def variable_stride_per_key(self) -> bool:
        return True

    def stride_per_key(self) -> list[int]:
        return self._strides


def test_a_variable_stride_keyed_jagged_tensor_splits_by_stride_per_key() -> None:
    ebc = EmbeddingBagCollection.from_configs(configs()).eval()
    values = torch.tensor([1, 2, 3, 4, 5, 6])
    kjt = VariableStrideKJT(["item", "user"], values, torch.tensor([2, 0, 1, 2, 1]), [2, 3])
    EmbeddingBagCollection.train(ebc)(kjt)  # insert the rows
    out = ebc(kjt).to_dict()
    assert tuple(out["item"].shape) == (2, 4)
    assert tuple(out["user"].shape) == (3, 3)
    want = ebc({"item": ([1, 2], [0, 2, 2]), "user": ([3, 4, 5, 6], [0, 1, 3, 4])})
    for name in ("item", "user"):
        torch.testing.assert_close(out[name], want[name], rtol=0, atol=0)
