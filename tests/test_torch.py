"""embstore.torch.EmbeddingBagCollection: autograd wiring, eval safety, equivalence with torch."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

torch = pytest.importorskip("torch")

import embstore
from embstore.torch import EmbeddingBagCollection
from embstore.torch._packing import grad_array as _grad_array

# torch.optim.Adagrad on sparse gradients warns once per process about sparse invariant checks.
SPARSE_WARNING = "ignore:Sparse invariant checks:UserWarning"


def make_group(optimizer: Any = None, dims: tuple[int, int] = (4, 3)) -> embstore.TableGroup:
    opt = optimizer if optimizer is not None else embstore.SGD(lr=1.0)
    return embstore.TableGroup(
        {
            "a": embstore.Table(
                dim=dims[0],
                capacity=1000,
                optimizer=opt,
                initializer=embstore.Uniform(-0.5, 0.5, seed=1),
            ),
            "b": embstore.Table(
                dim=dims[1],
                capacity=1000,
                optimizer=opt,
                initializer=embstore.Uniform(-0.5, 0.5, seed=2),
            ),
        }
    )


def features(numpy: bool = False) -> dict[str, tuple[Any, ...]]:
    """Three bags per table: a has a duplicate id and an empty bag; b has weights."""
    a = (np.array([1, 2, 2, 5], dtype=np.int64), np.array([0, 3, 3, 4], dtype=np.int64))
    b = (
        np.array([7, 8, 9], dtype=np.int64),
        np.array([0, 1, 2, 3], dtype=np.int64),
        np.array([0.5, 2.0, -1.0], dtype=np.float32),
    )
    if numpy:
        return {"a": a, "b": b}
    return {"a": tuple(map(torch.from_numpy, a)), "b": tuple(map(torch.from_numpy, b))}


def rows(group: embstore.TableGroup, name: str, ids: list[int]) -> npt.NDArray[np.float32]:
    """The stored rows (read-only lookup: inserts nothing, writes nothing)."""
    return group[name].lookup(np.array(ids, dtype=np.uint64), insert=False)


IDS = {"a": [1, 2, 5], "b": [7, 8, 9]}


def snapshot(group: embstore.TableGroup) -> dict[str, bytes]:
    return {name: rows(group, name, ids).tobytes() for name, ids in IDS.items()}


def train_step(module: EmbeddingBagCollection, feats: dict[str, tuple[Any, ...]]) -> None:
    out = module(feats)
    (out["a"].sum() + (2.0 * out["b"]).sum()).backward()


# -- construction -------------------------------------------------------------------------


def test_module_holds_no_parameters_and_validates_arguments() -> None:
    group = make_group()
    module = EmbeddingBagCollection(group)
    assert list(module.parameters()) == []
    assert "a: dim=4" in repr(module)
    assert "features=['b']" in repr(module)
    with pytest.raises(TypeError, match="TableGroup"):
        EmbeddingBagCollection({"a": group["a"]})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        EmbeddingBagCollection(group, mode="max")
    with pytest.raises(TypeError, match="mapping"):
        module([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keys, offsets"):
        module({"a": (torch.tensor([1]),)})
    with pytest.raises(KeyError, match="unknown feature"):
        module({"zz": (torch.tensor([1]), torch.tensor([0, 1]))})


def test_weights_that_require_grad_raise() -> None:
    module = EmbeddingBagCollection(make_group())
    w = torch.ones(1, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        module({"a": (torch.tensor([1]), torch.tensor([0, 1]), w)})


# -- forward ------------------------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False])
def test_outputs_share_memory_with_the_store_output(
    training: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = make_group()
    module = EmbeddingBagCollection(group).train(training)
    produced: list[dict[str, npt.NDArray[np.float32]]] = []
    original = embstore.TableGroup.lookup_sum

    def spy(self: embstore.TableGroup, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        produced.append(result)
        return result

    monkeypatch.setattr(embstore.TableGroup, "lookup_sum", spy)
    out = module(features())
    assert len(produced) == 1  # one crossing for all tables
    for name, tensor in out.items():
        array = produced[0][name]
        assert tensor.data_ptr() == array.ctypes.data
        assert tensor.shape == array.shape
        assert tensor.dtype == torch.float32
        assert np.shares_memory(tensor.detach().numpy(), array)
    assert (out["a"].grad_fn is not None) == training


def test_numpy_and_tensor_inputs_give_the_same_pooled_rows() -> None:
    group = make_group()
    module = EmbeddingBagCollection(group).eval()
    by_numpy = module(features(numpy=True))
    train_step(EmbeddingBagCollection(group), features())  # insert the rows
    by_numpy = module(features(numpy=True))
    by_tensor = module(features())
    for name in ("a", "b"):
        torch.testing.assert_close(by_numpy[name], by_tensor[name], rtol=0, atol=0)
        feature = features(numpy=True)[name]
        expected = group[name].lookup_sum(
            feature[0], feature[1], weights=feature[2] if len(feature) == 3 else None
        )
        np.testing.assert_array_equal(by_tensor[name].numpy(), expected)
    # uint64 numpy keys, int32 offsets, a non-contiguous key tensor
    keys = torch.tensor([9, 1, 9, 2, 9, 5])[1::2]
    out = module({"a": (keys, np.array([0, 1, 3], dtype=np.int32))})
    expected = group["a"].lookup_sum(np.array([1, 2, 5], dtype=np.uint64), np.array([0, 1, 3]))
    np.testing.assert_array_equal(out["a"].numpy(), expected)


def test_mean_mode_pools_the_mean() -> None:
    group = make_group()
    module = EmbeddingBagCollection(group, mode="mean").eval()
    train_step(EmbeddingBagCollection(group), features())
    out = module(features())
    r = rows(group, "a", [1, 2, 5])
    np.testing.assert_allclose(out["a"].numpy()[0], (r[0] + 2 * r[1]) / 3, rtol=1e-6)
    np.testing.assert_array_equal(out["a"].numpy()[1], np.zeros(4, np.float32))


# -- eval safety --------------------------------------------------------------------------


@pytest.mark.parametrize("context", ["eval", "no_grad", "inference_mode", "eval_no_grad"])
def test_eval_forward_never_inserts_or_writes(context: str) -> None:
    group, twin = make_group(embstore.Adagrad(lr=0.3)), make_group(embstore.Adagrad(lr=0.3))
    for g in (group, twin):
        train_step(EmbeddingBagCollection(g), features())
    before = snapshot(group)
    sizes = {name: len(t) for name, t in group.items()}
    inserts = {name: t.stats()["inserts"] for name, t in group.items()}

    module = EmbeddingBagCollection(group)
    if context.startswith("eval"):
        module.eval()
    new_ids = {
        "a": (torch.tensor([1, 1000, 1001]), torch.tensor([0, 2, 3])),
        "b": (torch.tensor([7, 2000]), torch.tensor([0, 1, 2]), torch.tensor([1.0, 3.0])),
    }
    for feats in (features(), new_ids, features(numpy=True)):
        if context in ("no_grad", "eval_no_grad"):
            with torch.no_grad():
                out = module(feats)
        elif context == "inference_mode":
            with torch.inference_mode():
                out = module(feats)
        else:
            out = module(feats)
        assert all(t.grad_fn is None and not t.requires_grad for t in out.values())
        if context == "eval":
            with pytest.raises(RuntimeError):  # nothing to backpropagate into
                out["a"].sum().backward()
    # unknown ids pool as zeros: bag 1 of "a" holds only id 1001
    np.testing.assert_array_equal(out["a"].numpy()[1], np.zeros(4, np.float32))
    assert {name: len(t) for name, t in group.items()} == sizes
    assert {name: t.stats()["inserts"] for name, t in group.items()} == inserts
    assert not group["a"].contains(np.array([1000, 1001])).any()
    assert snapshot(group) == before
    # the optimizer state is untouched too: one more training step matches a twin that
    # never saw the eval forwards, bit for bit
    for g in (group, twin):
        train_step(EmbeddingBagCollection(g), features())
    assert snapshot(group) == snapshot(twin)


def test_training_forward_inserts_missing_ids() -> None:
    group = make_group()
    EmbeddingBagCollection(group)(features())
    assert group["a"].contains(np.array([1, 2, 5])).all()
    assert len(group["b"]) == 3


# -- backward -----------------------------------------------------------------------------


def test_forward_without_backward_applies_nothing() -> None:
    group = make_group()
    module = EmbeddingBagCollection(group)
    out = module(features())
    initial = snapshot(group)  # the forward inserted the initial rows
    assert snapshot(group) == initial
    del out
    gc.collect()
    assert snapshot(group) == initial
    np.testing.assert_array_equal(
        rows(group, "a", [1, 2, 5]), group["a"].initial_values(np.array([1, 2, 5]))
    )


def test_backward_applies_once_in_one_group_call(monkeypatch: pytest.MonkeyPatch) -> None:
    group = make_group()  # SGD lr=1: row -= pooled gradient (times the id's weight)
    calls: list[set[str]] = []
    original = embstore.TableGroup.apply_gradients

    def spy(self: embstore.TableGroup, grads: Any, **kwargs: Any) -> None:
        calls.append(set(grads))
        original(self, grads, **kwargs)

    monkeypatch.setattr(embstore.TableGroup, "apply_gradients", spy)
    module = EmbeddingBagCollection(group)
    init_a = group["a"].initial_values(np.array([1, 2, 5]))
    init_b = group["b"].initial_values(np.array([7, 8, 9]))
    train_step(module, features())
    assert calls == [{"a", "b"}]
    # a: bag 0 = {1, 2, 2} with grad 1, bag 2 = {5} with grad 1: id 2 gets 2
    np.testing.assert_allclose(rows(group, "a", [1, 2, 5]), init_a - [[1], [2], [1]], rtol=1e-6)
    # b: weights (0.5, 2, -1), pooled grad 2
    np.testing.assert_allclose(
        rows(group, "b", [7, 8, 9]), init_b - 2.0 * np.array([[0.5], [2.0], [-1.0]]), rtol=1e-6
    )


def test_unused_output_gets_no_update(monkeypatch: pytest.MonkeyPatch) -> None:
    group = make_group()
    applied: list[set[str]] = []
    original = embstore.TableGroup.apply_gradients

    def spy(self: embstore.TableGroup, grads: Any, **kwargs: Any) -> None:
        applied.append(set(grads))
        original(self, grads, **kwargs)

    monkeypatch.setattr(embstore.TableGroup, "apply_gradients", spy)
    out = EmbeddingBagCollection(group)(features())
    b_before = rows(group, "b", [7, 8, 9]).tobytes()
    out["a"].sum().backward()
    assert applied == [{"a"}]
    assert rows(group, "b", [7, 8, 9]).tobytes() == b_before


@pytest.mark.parametrize("how", ["retain_graph", "no_saved_tensors", "one_output_each"])
def test_second_backward_raises_and_applies_nothing(how: str) -> None:
    group = make_group()
    out = EmbeddingBagCollection(group)(features())
    if how == "retain_graph":
        loss = (out["a"] * out["a"]).sum() + out["b"].sum()  # saved tensors: retain needed
        loss.backward(retain_graph=True)
        after = snapshot(group)
        with pytest.raises(RuntimeError, match="second backward"):
            loss.backward()
    elif how == "no_saved_tensors":
        loss = out["a"].sum() + out["b"].sum()  # the store op saved its keys: torch raises
        loss.backward()
        after = snapshot(group)
        with pytest.raises(RuntimeError, match="a second time"):
            loss.backward()
    else:
        out["a"].sum().backward()
        after = snapshot(group)
        with pytest.raises(RuntimeError, match="a second time"):
            out["b"].sum().backward()
    assert snapshot(group) == after


def test_keys_modified_in_place_before_backward_raise() -> None:
    group = make_group()
    feats = features()
    out = EmbeddingBagCollection(group)(feats)
    before = snapshot(group)
    feats["a"][0][0] = 99
    with pytest.raises(RuntimeError, match="inplace operation"):
        out["a"].sum().backward()
    assert snapshot(group) == before


GradMaker = Callable[[Any], Any]


@pytest.mark.parametrize(
    "loss_of",
    [
        pytest.param(lambda x: (x.t() * torch.arange(1.0, 4.0)[None, :]).sum(), id="transposed"),
        pytest.param(lambda x: (x.double() * 3.0).sum(), id="float64"),
        pytest.param(lambda x: x[:, ::2].sum() * 3.0 + x[:, 1::2].sum() * 3.0, id="sliced"),
        pytest.param(lambda x: x.sum() * 3.0, id="expanded"),
    ],
)
def test_any_gradient_layout_is_applied_exactly(loss_of: GradMaker) -> None:
    group = make_group(dims=(4, 3))
    out = EmbeddingBagCollection(group)(features())
    probe = out["a"].detach().clone().requires_grad_()
    loss_of(probe).backward()  # the pooled gradient, computed by torch on a plain tensor
    g = probe.grad.numpy().astype(np.float32)
    init = group["a"].initial_values(np.array([1, 2, 5]))
    loss_of(out["a"]).backward()
    expected = init - np.stack([g[0], 2 * g[0], g[2]])
    np.testing.assert_allclose(rows(group, "a", [1, 2, 5]), expected, rtol=1e-6, atol=1e-7)


def test_grad_array_converts_once_to_contiguous_float32() -> None:
    g = torch.arange(12.0, dtype=torch.float64).reshape(3, 4).t()
    arr = _grad_array(g)
    assert arr.dtype == np.float32
    assert arr.flags.c_contiguous
    np.testing.assert_array_equal(arr, g.numpy().astype(np.float32))
    dense = torch.ones(2, 3)
    assert np.shares_memory(_grad_array(dense), dense.numpy())  # no copy when already right


def test_non_finite_gradient_raises_and_applies_nothing() -> None:
    group = make_group()
    out = EmbeddingBagCollection(group)(features())
    before = snapshot(group)
    with pytest.raises(ValueError, match=r"finite|NaN|Inf"):
        (out["a"].sum() * float("nan")).backward()
    assert snapshot(group) == before


# -- equivalence with torch.nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad ---------------


def _batches(rng: np.random.Generator, universe: dict[str, npt.NDArray[np.uint64]], weighted: bool):
    """20 batches of 16 bags per table: 0..4 ids per bag, duplicates and empty bags."""
    out = []
    for _ in range(20):
        batch = {}
        for name, ids in universe.items():
            counts = rng.integers(0, 5, size=16)
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            idx = rng.integers(0, len(ids), size=int(offsets[-1]))
            w = rng.uniform(-1.5, 1.5, size=idx.shape[0]).astype(np.float32) if weighted else None
            batch[name] = (idx, offsets, w)
        labels = rng.integers(0, 2, size=16).astype(np.float32)
        out.append((batch, labels))
    return out


@pytest.mark.filterwarnings(SPARSE_WARNING)
@pytest.mark.parametrize(("mode", "weighted"), [("sum", False), ("mean", False), ("sum", True)])
def test_training_matches_torch_embedding_bag_with_sparse_adagrad(
    mode: str, weighted: bool, rng: np.random.Generator
) -> None:
    lr, eps = 0.05, 1e-8
    dims = {"user": 8, "item": 4}
    universe = {
        name: rng.integers(0, 2**63, size=n, dtype=np.int64).astype(np.uint64)
        for name, n in (("user", 40), ("item", 25))
    }
    group = embstore.TableGroup(
        {
            name: embstore.Table(
                dim=dims[name],
                capacity=1000,
                optimizer=embstore.Adagrad(lr=lr, eps=eps),
                initializer=embstore.Normal(std=0.3, seed=k),
            )
            for k, name in enumerate(dims)
        }
    )
    torch.manual_seed(0)
    dense_a = torch.nn.Linear(12, 1)
    dense_b = torch.nn.Linear(12, 1)
    dense_b.load_state_dict(dense_a.state_dict())
    bags = {
        name: torch.nn.EmbeddingBag(len(ids), dims[name], mode=mode, sparse=True)
        for name, ids in universe.items()
    }
    with torch.no_grad():
        for name, bag in bags.items():
            bag.weight.copy_(torch.from_numpy(group[name].initial_values(universe[name])))
    ebc = EmbeddingBagCollection(group, mode=mode)
    opt_dense_a = torch.optim.SGD(dense_a.parameters(), lr=0.1)
    opt_torch = torch.optim.SGD(dense_b.parameters(), lr=0.1)
    opt_sparse = torch.optim.Adagrad(
        [b.weight for b in bags.values()], lr=lr, eps=eps, initial_accumulator_value=0.0
    )
    loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
    for batch, labels in _batches(rng, universe, weighted):
        y = torch.from_numpy(labels)
        feats = {
            name: (universe[name][idx], off) if w is None else (universe[name][idx], off, w)
            for name, (idx, off, w) in batch.items()
        }
        out = ebc(feats)
        loss_a = loss_fn(dense_a(torch.cat([out["user"], out["item"]], 1)).squeeze(1), y)
        opt_dense_a.zero_grad()
        loss_a.backward()
        opt_dense_a.step()

        pooled = [
            bags[name](
                torch.from_numpy(idx),
                torch.from_numpy(off[:-1]),
                per_sample_weights=None if w is None else torch.from_numpy(w),
            )
            for name, (idx, off, w) in batch.items()
        ]
        loss_b = loss_fn(dense_b(torch.cat(pooled, 1)).squeeze(1), y)
        opt_torch.zero_grad()
        opt_sparse.zero_grad()
        loss_b.backward()
        opt_torch.step()
        opt_sparse.step()
        assert abs(loss_a.item() - loss_b.item()) < 1e-5
    for name, ids in universe.items():
        seen = group[name].contains(ids)
        stored = group[name].lookup(ids[seen], insert=False)
        np.testing.assert_allclose(
            stored, bags[name].weight.detach().numpy()[seen], rtol=0, atol=1e-5
        )
        moved = np.abs(stored - group[name].initial_values(ids[seen])).max()
        assert moved > 0.05  # the rows did train
        # rows never looked up stay at their initial values on the torch side
        np.testing.assert_array_equal(
            bags[name].weight.detach().numpy()[~seen], group[name].initial_values(ids[~seen])
        )
    for pa, pb in zip(dense_a.parameters(), dense_b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-5)
