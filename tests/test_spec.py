"""TableSpec: a table's settings as one frozen value, and the layering it makes possible."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import pickle
from typing import Any

import numpy as np
import pytest
from helpers import u64

import embstore

SETTINGS: list[dict[str, Any]] = [
    {},
    {"optimizer": embstore.SGD(lr=0.5, momentum=0.5)},
    {"optimizer": embstore.RowWiseAdagrad(lr=0.2, eps=1e-6, initial_accumulator=0.1)},
    {"optimizer": embstore.Adam(lr=0.01, beta1=0.8, weight_decay=0.01)},
    {"optimizer": embstore.FTRL(alpha=0.1, beta=0.5, l1=0.01, l2=0.1)},
    {"initializer": embstore.Uniform(-1.0, 1.0, seed=5), "num_shards": 4, "eviction": "none"},
    {"initializer": embstore.TruncatedNormal(std=0.5, seed=9), "num_threads": 2},
    {"initializer": embstore.Zeros(), "name": "users"},
    {"admission": embstore.CountFilter(min_count=2, width=64, depth=2)},
]


def test_table_keywords_and_spec_fields_are_the_same() -> None:
    """Every keyword of Table is a field of TableSpec, in the same order, of the same kind
    (positional or keyword-only), with the same default."""
    table_params = inspect.signature(embstore.Table).parameters
    fields = {f.name: f for f in dataclasses.fields(embstore.TableSpec)}
    assert list(table_params) == list(fields)
    spec_params = inspect.signature(embstore.TableSpec).parameters
    assert [p.kind for p in spec_params.values()] == [p.kind for p in table_params.values()]
    spec = embstore.TableSpec(dim=3, capacity=10)
    for name, param in table_params.items():
        if param.default is inspect.Parameter.empty:
            continue
        if name in ("optimizer", "initializer"):  # None: the spec's default object
            assert param.default is None
            continue
        assert getattr(spec, name) == param.default, name


@pytest.mark.parametrize("settings", SETTINGS)
def test_table_from_spec_equals_table_from_keywords(settings: dict[str, Any]) -> None:
    """Table(**kw) and Table.from_spec(TableSpec(**kw)) have equal specs and compute the
    same bits; the spec pickles to an equal spec."""
    spec = embstore.TableSpec(dim=3, capacity=64, **settings)
    a = embstore.Table(dim=3, capacity=64, **settings)
    b = embstore.Table.from_spec(spec)
    assert a.spec == spec == b.spec
    assert pickle.loads(pickle.dumps(spec)) == spec
    rng = np.random.default_rng(0)
    for _ in range(3):
        keys = u64(rng.integers(0, 40, size=30))
        off = np.array([0, 10, 30])
        g = rng.normal(size=(2, 3)).astype(np.float32)
        np.testing.assert_array_equal(a.lookup_sum(keys, off), b.lookup_sum(keys, off))
        a.apply_gradients(keys, g, offsets=off)
        b.apply_gradients(keys, g, offsets=off)
    probe = u64(range(40))
    np.testing.assert_array_equal(a.lookup(probe, insert=False), b.lookup(probe, insert=False))
    assert a.stats()["size"] == b.stats()["size"]


def test_spec_defaults_and_current_settings() -> None:
    """None means the default optimizer and initializer; the spec follows set_lr and a
    group's name for an unnamed table, and keeps a given name."""
    spec = embstore.TableSpec(dim=2, capacity=8, optimizer=None, initializer=None)
    assert spec.optimizer == embstore.Adagrad(lr=0.01)
    assert spec.initializer == embstore.Normal(std=0.01, seed=0)
    t = embstore.Table(dim=2, capacity=8)
    named = embstore.Table(dim=2, capacity=8, name="mine")
    t.set_lr(0.5)
    assert t.spec.optimizer == embstore.Adagrad(lr=0.5)
    assert t.spec.name is None
    assert t.name.startswith("table")
    embstore.TableGroup({"users": t, "items": named})
    assert t.spec.name == "users" == t.name
    assert named.spec.name == "mine" == named.name


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"dim": 0}, ValueError, "dim"),
        ({"capacity": 2.5}, TypeError, "capacity"),
        ({"optimizer": "sgd"}, TypeError, "optimizer"),
        ({"initializer": 1.0}, TypeError, "initializer"),
        ({"num_shards": 3}, ValueError, "num_shards"),
        ({"num_shards": 32}, ValueError, "num_shards"),
        ({"eviction": "lru"}, ValueError, "eviction"),
        ({"num_threads": 0}, ValueError, "num_threads"),
        ({"name": 3}, TypeError, "name"),
        ({"admission": 2}, TypeError, "admission"),
        ({"on_evict": 5}, TypeError, "on_evict"),
    ],
)
def test_bad_spec_names_the_argument(kwargs: dict[str, Any], exc: type, match: str) -> None:
    """A spec is checked when made, and Table(**kwargs) raises the same errors."""
    args: dict[str, Any] = {"dim": 2, "capacity": 16, **kwargs}
    with pytest.raises(exc, match=match):
        embstore.TableSpec(**args)
    with pytest.raises(exc, match=match):
        embstore.Table(**args)


def test_spec_is_frozen() -> None:
    spec = embstore.TableSpec(dim=2, capacity=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dim = 3  # type: ignore[misc]


SRC = pathlib.Path(embstore.__file__).parent
FACADE = {"embstore.table", "embstore.group", "embstore"}


def _imports(path: pathlib.Path) -> set[str]:
    """The embstore modules a file imports (``from embstore import x`` counts as
    ``embstore.x`` when x is a module, else as the package itself)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "embstore":
                for a in node.names:
                    is_module = any(SRC.glob(f"{a.name}.*")) or (SRC / a.name).is_dir()
                    found.add(f"embstore.{a.name}" if is_module else "embstore")
            else:
                found.add(node.module)
    return {m for m in found if m == "embstore" or m.startswith("embstore.")}


@pytest.mark.parametrize(
    "path",
    [
        *sorted([*(SRC / "_persist").glob("*.py"), SRC / "_internals.py", SRC / "spec.py"]),
        SRC / "metrics.py",
    ],
    ids=lambda p: p.name,
)
def test_persistence_and_internals_never_import_the_facade(path: pathlib.Path) -> None:
    """The facade (table.py, group.py, the package) sits above persistence, the internals,
    the spec and metrics: none of them imports it, not even for type checking."""
    assert not _imports(path) & FACADE
