"""TableGroup: one call over several tables equals the per-table calls, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import Config, assert_rows_equal, assert_unchanged, random_offsets, snapshot, u64
from reference import AdagradSpec, SGDSpec, UniformSpec

import embstore

CONFIGS = {
    "user": Config(dim=4, capacity=5000, optimizer=AdagradSpec(lr=0.1), num_shards=4),
    "item": Config(
        dim=7,
        capacity=5000,
        optimizer=SGDSpec(lr=0.3),
        initializer=UniformSpec(-1.0, 1.0, seed=3),
        num_shards=1,
    ),
    # One shard: eviction through the group is exact (multi-shard eviction determinism has
    # its own test in test_eviction.py).
    "ctx": Config(dim=1, capacity=50, optimizer=SGDSpec(lr=0.05), num_shards=1),
}


def _group() -> tuple[embstore.TableGroup, dict[str, embstore.Table]]:
    """A group and an identically configured set of independent twin tables."""
    group = embstore.TableGroup({name: cfg.table() for name, cfg in CONFIGS.items()})
    twins = {name: cfg.table() for name, cfg in CONFIGS.items()}
    return group, twins


def _batch(rng: np.random.Generator, name: str, bags: int) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(0, 4 * bags + 1))
    keys = rng.integers(0, 80 if name != "ctx" else 200, size=n).astype(np.uint64)
    return keys, random_offsets(rng, n, bags)


def test_mapping_interface() -> None:
    """g[name] returns the table; iteration/names keep insertion order; unknown -> KeyError."""
    group, _ = _group()
    assert list(group) == ["user", "item", "ctx"]
    assert group.names == ["user", "item", "ctx"]
    assert group["item"].dim == 7
    assert isinstance(group["user"], embstore.Table)
    with pytest.raises(KeyError):
        group["nope"]


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_group_matches_per_table_calls(mode: str, rng: np.random.Generator) -> None:
    """Several rounds of group lookup_sum + apply_gradients (with and without weights, tables
    of different dims and optimizers, evicting 'ctx') equal the per-table calls bitwise."""
    group, twins = _group()
    for rnd in range(6):
        bags = int(rng.integers(0, 12))
        feats: dict[str, tuple[Any, ...]] = {}
        for name in CONFIGS:
            keys, off = _batch(rng, name, bags)
            if name == "item" or rnd % 2:
                feats[name] = (
                    keys,
                    off,
                    np.asarray(rng.uniform(-2, 2, size=keys.shape[0]), np.float32),
                )
            else:
                feats[name] = (keys, off)
        out = group.lookup_sum(feats, mode=mode, insert=True)
        assert set(out) == set(CONFIGS)
        for name, f in feats.items():
            w = f[2] if len(f) == 3 else None
            want = twins[name].lookup_sum(f[0], f[1], weights=w, mode=mode)
            assert out[name].shape == (bags, CONFIGS[name].dim)
            assert_rows_equal(out[name], want)
        grads: dict[str, tuple[Any, ...]] = {}
        for name, f in feats.items():
            g = rng.normal(size=(bags, CONFIGS[name].dim)).astype(np.float32)
            grads[name] = (f[0], f[1], g, f[2]) if len(f) == 3 else (f[0], f[1], g)
        group.apply_gradients(grads, mode=mode)
        for name, e in grads.items():
            w = e[3] if len(e) == 4 else None
            twins[name].apply_gradients(e[0], e[2], offsets=e[1], weights=w, mode=mode)
    for name in CONFIGS:
        universe = np.arange(200, dtype=np.uint64)
        a, b = group[name], twins[name]
        assert np.array_equal(a.contains(universe), b.contains(universe))
        assert_rows_equal(a.lookup(universe, insert=False), b.lookup(universe, insert=False))
        sa, sb = a.stats(), b.stats()
        for k in ("size", "hits", "misses", "inserts", "evictions"):
            assert sa[k] == sb[k], (name, k, sa[k], sb[k])


def test_group_insert_false_and_subset() -> None:
    """insert=False through the group inserts nothing; a call may name a subset of tables."""
    group, twins = _group()
    keys, off = u64([1, 2, 3]), np.array([0, 1, 3])
    out = group.lookup_sum({"user": (keys, off)}, insert=False)
    assert set(out) == {"user"}
    assert np.array_equal(out["user"], np.zeros((2, 4), np.float32))
    assert len(group["user"]) == 0
    out = group.lookup_sum({"item": (keys, off)})
    assert_rows_equal(out["item"], twins["item"].lookup_sum(keys, off))
    assert len(group["user"]) == 0


BAD_GROUP_CALLS: list[Any] = [
    ("unknown_lookup", lambda g: g.lookup_sum({"nope": (u64([1]), [0, 1])}), KeyError, "nope"),
    (
        "unknown_apply",
        lambda g: g.apply_gradients({"nope": (u64([1]), [0, 1], np.ones((1, 4), np.float32))}),
        KeyError,
        "nope",
    ),
    (
        "unknown_after_valid",
        lambda g: g.lookup_sum({"user": (u64([5]), [0, 1]), "nope": (u64([1]), [0, 1])}),
        KeyError,
        "nope",
    ),
    ("tuple_too_short", lambda g: g.lookup_sum({"user": (u64([1]),)}), ValueError, "user"),
    (
        "tuple_too_long",
        lambda g: g.lookup_sum({"user": (u64([1]), [0, 1], np.ones(1), np.ones(1))}),
        ValueError,
        "user",
    ),
    (
        "apply_tuple_short",
        lambda g: g.apply_gradients({"user": (u64([1]), [0, 1])}),
        ValueError,
        "user",
    ),
    (
        "grads_wrong_dim",
        lambda g: g.apply_gradients({"item": (u64([5]), [0, 1], np.ones((1, 4), np.float32))}),
        ValueError,
        "grads",
    ),
    (
        "grads_wrong_bags",
        lambda g: g.apply_gradients({"user": (u64([5, 6]), [0, 2], np.ones((2, 4), np.float32))}),
        ValueError,
        "grads",
    ),
    (
        "weights_wrong_length",
        lambda g: g.lookup_sum({"item": (u64([5, 6]), [0, 2], np.ones(3, np.float32))}),
        ValueError,
        "weights",
    ),
    (
        "offsets_bad_second_table",
        lambda g: g.lookup_sum({"user": (u64([5]), [0, 1]), "item": (u64([5, 6]), [0, 3])}),
        ValueError,
        "offsets",
    ),
    (
        "nan_grads_second_table",
        lambda g: g.apply_gradients(
            {
                "user": (u64([5]), [0, 1], np.ones((1, 4), np.float32)),
                "item": (u64([6]), [0, 1], np.full((1, 7), np.nan, np.float32)),
            }
        ),
        ValueError,
        "grads",
    ),
    (
        "keys_float",
        lambda g: g.lookup_sum({"user": (np.array([1.0]), [0, 1])}),
        TypeError,
        "keys",
    ),
    (  # arrays the core takes as they are: its own check of the offsets raises
        "offsets_bad_as_arrays",
        lambda g: g.lookup_sum(
            {
                "user": (u64([5]), np.array([0, 1], np.int64)),
                "item": (u64([5, 6]), np.array([0, 3], np.int64)),
            }
        ),
        ValueError,
        "offsets",
    ),
    (
        "grads_wrong_dim_as_arrays",
        lambda g: g.apply_gradients(
            {"item": (u64([5]), np.array([0, 1], np.int64), np.ones((1, 4), np.float32))}
        ),
        ValueError,
        "grads",
    ),
    (
        "bad_mode",
        lambda g: g.lookup_sum({"user": (u64([5]), [0, 1])}, mode="max"),
        ValueError,
        "mode",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "match"), [b[1:] for b in BAD_GROUP_CALLS], ids=[b[0] for b in BAD_GROUP_CALLS]
)
def test_bad_group_calls_change_nothing(call: Any, exc: type[Exception], match: str) -> None:
    """Unknown names raise KeyError, mismatched inputs TypeError/ValueError naming the
    argument (or table); no table of the group changes, not even the valid ones."""
    group, _ = _group()
    group["user"].lookup(u64([1, 2]))
    group["item"].lookup(u64([1]))
    probe = u64(range(10))
    before = {name: snapshot(group[name], probe) for name in CONFIGS}
    with pytest.raises(exc, match=match):
        call(group)
    for name in CONFIGS:
        assert_unchanged(before[name], snapshot(group[name], probe))


_OK = (u64([5]), np.array([0, 1], np.int64))  # a valid "user" entry
_G4 = np.ones((1, 4), np.float32)
_G7 = np.ones((1, 7), np.float32)


def _both(item: tuple[Any, ...]) -> dict[str, tuple[Any, ...]]:
    """A lookup with a valid first table and ``item`` for the second."""
    return {"user": _OK, "item": item}


def _both_apply(item: tuple[Any, ...]) -> dict[str, tuple[Any, ...]]:
    return {"user": (*_OK, _G4), "item": item}


def _close_item(g: embstore.TableGroup) -> None:
    g["item"].close()
    g.lookup_sum(_both((u64([1]), [0, 1])))


# (id, call, exception, what the message names besides the table "item")
ERRORS_NAMING_THE_TABLE: list[Any] = [
    ("keys_float", lambda g: g.lookup_sum(_both((np.array([1.0]), [0, 1]))), TypeError, "keys"),
    ("keys_2d", lambda g: g.lookup_sum(_both((u64([[1]]), [0, 1]))), ValueError, "keys"),
    ("offsets_float", lambda g: g.lookup_sum(_both((u64([1]), [0.0, 1.0]))), TypeError, "offsets"),
    (
        "offsets_empty",
        lambda g: g.lookup_sum(_both((u64([1]), np.zeros(0, np.int64)))),
        ValueError,
        "offsets",
    ),
    ("offsets_end", lambda g: g.lookup_sum(_both((u64([1]), [0, 2]))), ValueError, "offsets"),
    ("offsets_order", lambda g: g.lookup_sum(_both((u64([1]), [0, 2, 1]))), ValueError, "offsets"),
    (
        "weights_length",
        lambda g: g.lookup_sum(_both((u64([1]), [0, 1], np.ones(2, np.float32)))),
        ValueError,
        "weights",
    ),
    (
        "weights_dtype",
        lambda g: g.lookup_sum(_both((u64([1]), [0, 1], np.array(["a"])))),
        TypeError,
        "weights",
    ),
    ("tuple_length", lambda g: g.lookup_sum(_both((u64([1]),))), ValueError, "keys, offsets"),
    (
        "apply_keys_dtype",
        lambda g: g.apply_gradients(_both_apply((np.array([1.5]), [0, 1], _G7))),
        TypeError,
        "keys",
    ),
    (
        "grads_shape",
        lambda g: g.apply_gradients(_both_apply((u64([1]), [0, 1], _G4))),
        ValueError,
        "grads",
    ),
    (
        "grads_int",
        lambda g: g.apply_gradients(_both_apply((u64([1]), [0, 1], np.ones((1, 7), np.int64)))),
        TypeError,
        "grads",
    ),
    (
        "grads_nan",
        lambda g: g.apply_gradients(_both_apply((u64([1]), [0, 1], np.full((1, 7), np.nan)))),
        ValueError,
        "grads",
    ),
    (
        "apply_weights_length",
        lambda g: g.apply_gradients(_both_apply((u64([1]), [0, 1], _G7, np.ones(3)))),
        ValueError,
        "weights",
    ),
    (
        "apply_tuple_length",
        lambda g: g.apply_gradients(_both_apply((u64([1]), [0, 1]))),
        ValueError,
        "keys, offsets, grads",
    ),
    ("closed", _close_item, ValueError, "closed"),
]


@pytest.mark.parametrize(
    ("call", "exc", "names"),
    [e[1:] for e in ERRORS_NAMING_THE_TABLE],
    ids=[e[0] for e in ERRORS_NAMING_THE_TABLE],
)
def test_every_group_error_names_the_table(call: Any, exc: type[Exception], names: str) -> None:
    """Any bad entry (dtype, shape, length, values, NaN, a closed table) raises an error
    naming its table and the argument; the valid table before it does not change."""
    group, _ = _group()
    group["user"].lookup(u64([1, 2, 5]))
    probe = u64(range(10))
    before = snapshot(group["user"], probe)
    with pytest.raises(exc) as info:
        call(group)
    assert "'item'" in str(info.value)
    assert names in str(info.value)
    assert_unchanged(before, snapshot(group["user"], probe))


@pytest.mark.parametrize(
    "call",
    [
        lambda g: g.lookup_sum([("user", _OK)]),
        lambda g: g.lookup_sum(None),
        lambda g: g.apply_gradients([("user", (*_OK, _G4))]),
        lambda g: g.apply_gradients((("user", (*_OK, _G4)),)),
    ],
    ids=["lookup_list_of_pairs", "lookup_none", "apply_list_of_pairs", "apply_tuple_of_pairs"],
)
def test_a_non_mapping_raises_type_error_naming_the_argument(call: Any) -> None:
    """features / grads must be mappings (issue 27: a list of pairs was an AttributeError)."""
    group, _ = _group()
    group["user"].lookup(u64([1, 2, 5]))
    before = snapshot(group["user"], u64(range(10)))
    with pytest.raises(TypeError, match=r"^(features|grads) must be a mapping"):
        call(group)
    assert_unchanged(before, snapshot(group["user"], u64(range(10))))


def _as_given(feats: dict[str, tuple[Any, ...]], form: str) -> Any:
    """The same batch as a caller might hand it over in `form`."""

    def convert(k: np.ndarray, off: np.ndarray, *rest: np.ndarray) -> tuple[Any, ...]:
        if form == "int64_keys":
            return (k.astype(np.int64), off, *rest)
        if form == "strided_keys":
            return (np.repeat(k, 2)[::2], off, *rest)
        if form == "int32_offsets":
            return (k, off.astype(np.int32), *rest)
        if form == "lists":
            return (k.tolist(), off.tolist(), *rest)
        if form == "float64":
            return (k, off, *(np.asarray(a, np.float64) for a in rest))
        if form == "fortran":
            return (k, off, *(np.asfortranarray(a) for a in rest))
        if form == "byteswapped":
            return tuple(a.astype(a.dtype.newbyteorder(">")) for a in (k, off, *rest))
        if form.startswith("none_weights") and (len(rest) == 0 or rest[-1].ndim == 2):
            if form == "none_weights_converted":
                off = off.astype(np.int32)
            return (k, off, *rest, None)  # an explicit None: no weights
        return (k, off, *rest)

    converted = {name: convert(*f) for name, f in feats.items()}
    if form == "mapping":
        import types

        return types.MappingProxyType(converted)
    return converted


FORMS = [
    "int64_keys",
    "strided_keys",
    "int32_offsets",
    "lists",
    "float64",
    "fortran",
    "mapping",
    "byteswapped",
    "none_weights",
    "none_weights_converted",
]


@pytest.mark.parametrize("form", FORMS)
def test_group_inputs_in_any_accepted_form_match_core_arrays(
    form: str, rng: np.random.Generator
) -> None:
    """Arrays already in the core's dtypes and layout go to it as they are; every other
    accepted form (int64 ids, strided, int32 offsets, lists, float64 weights and grads,
    Fortran order, a read-only mapping, big-endian arrays, an explicit None for weights) is
    converted first: both give the same bits."""
    group, twins = _group()
    canonical_twin = embstore.TableGroup(twins)
    for _ in range(4):
        bags = int(rng.integers(1, 12))
        feats: dict[str, tuple[Any, ...]] = {}
        grads: dict[str, tuple[Any, ...]] = {}
        for name, cfg in CONFIGS.items():
            keys, off = _batch(rng, name, bags)
            w = np.asarray(rng.uniform(-2, 2, size=keys.shape[0]), np.float32)
            g = rng.normal(size=(bags, cfg.dim)).astype(np.float32)
            feats[name] = (keys, off, w) if name != "user" else (keys, off)
            grads[name] = (keys, off, g, w) if name != "user" else (keys, off, g)
        got = group.lookup_sum(_as_given(feats, form))
        want = canonical_twin.lookup_sum(feats)
        assert list(got) == list(want)
        for name in CONFIGS:
            assert_rows_equal(got[name], want[name])
        group.apply_gradients(_as_given(grads, form))
        canonical_twin.apply_gradients(grads)
    universe = np.arange(200, dtype=np.uint64)
    for name in CONFIGS:
        assert_rows_equal(
            group[name].lookup(universe, insert=False), twins[name].lookup(universe, insert=False)
        )


def test_one_entry_to_convert_sends_the_whole_call_through_the_checks(
    rng: np.random.Generator,
) -> None:
    """A call goes to the core as it is when every entry is in the core's formats; one entry
    that is not (here: int32 offsets) makes the core do nothing and the call is converted
    and sent again, so no table is looked up or updated twice."""
    group, twins = _group()
    canonical_twin = embstore.TableGroup(twins)
    for _ in range(3):
        feats = {name: _batch(rng, name, 5) for name in CONFIGS}
        grads = {
            n: (k, off, rng.normal(size=(5, CONFIGS[n].dim)).astype(np.float32))
            for n, (k, off) in feats.items()
        }
        mixed = dict(feats, item=(feats["item"][0], feats["item"][1].astype(np.int32)))
        mixed_grads = dict(grads, ctx=(*grads["ctx"][:2], grads["ctx"][2].astype(np.float64)))
        got = group.lookup_sum(mixed)
        want = canonical_twin.lookup_sum(feats)
        for name in CONFIGS:
            assert_rows_equal(got[name], want[name])
        group.apply_gradients(mixed_grads)
        canonical_twin.apply_gradients(grads)
    universe = np.arange(200, dtype=np.uint64)
    for name in CONFIGS:
        for counter in ("hits", "misses", "inserts", "reused_rows"):
            assert group[name].stats()[counter] == twins[name].stats()[counter], counter
        assert_rows_equal(
            group[name].lookup(universe, insert=False), twins[name].lookup(universe, insert=False)
        )


@pytest.mark.parametrize("converted", [False, True])
def test_entries_go_to_their_own_tables_whatever_order_a_mapping_iterates_in(
    rng: np.random.Generator, converted: bool
) -> None:
    """A dict subclass may iterate its names in another order than its values: every entry
    still reaches its own table, on the direct path and on the one that converts entries
    first (here offsets given as lists): both pair names and entries by name."""

    class Reversed(dict):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(reversed(list(super().__iter__())))

    group, twins = _group()
    canonical_twin = embstore.TableGroup(twins)
    feats = {name: _batch(rng, name, 4) for name in CONFIGS}
    grads = {
        n: (k, off, rng.normal(size=(4, CONFIGS[n].dim)).astype(np.float32))
        for n, (k, off) in feats.items()
    }
    given_feats: dict[str, Any] = dict(feats)
    given_grads: dict[str, Any] = dict(grads)
    if converted:
        given_feats = {n: (k, off.tolist()) for n, (k, off) in feats.items()}
        given_grads = {n: (k, off.tolist(), g) for n, (k, off, g) in grads.items()}
    got = group.lookup_sum(Reversed(given_feats))
    want = canonical_twin.lookup_sum(feats)
    for name in CONFIGS:
        assert_rows_equal(got[name], want[name])
    group.apply_gradients(Reversed(given_grads))
    canonical_twin.apply_gradients(grads)
    universe = np.arange(200, dtype=np.uint64)
    for name in CONFIGS:
        assert len(group[name]) == len(twins[name])
        assert_rows_equal(
            group[name].lookup(universe, insert=False), twins[name].lookup(universe, insert=False)
        )


def test_core_group_calls_not_strict_do_nothing_on_an_entry_to_convert() -> None:
    """The binding's strict=False: an entry not in the core's formats makes the whole call
    return None (lookup) or False (apply) before any table is touched; strict (the default)
    raises TypeError naming the table."""
    from embstore import _core

    t = embstore.Table(dim=2, capacity=100)
    core = t._internals().live()
    good = (u64([1, 2]), np.array([0, 2], np.int64))
    bad = (u64([3]), np.array([0, 1], np.int32))
    g = np.ones((1, 2), np.float32)
    assert _core.group_lookup_sum([core, core], [good, bad], 0, True, ["a", "b"], False) is None
    assert not _core.group_apply_gradients([core], [(*bad, g)], 0, ["b"], False)
    assert len(t) == 0
    with pytest.raises(TypeError, match="table 'b': offsets"):
        _core.group_lookup_sum([core, core], [good, bad], 0, True, ["a", "b"])
    assert len(t) == 0
    (out,) = _core.group_lookup_sum([core], [good], 0, True, ["a"], False)
    assert out.shape == (1, 2)
    assert len(t) == 2


def test_group_call_on_a_closed_table_raises() -> None:
    """A table closed after the group was made: the group's calls raise and run nothing."""
    group, _ = _group()
    group["user"].lookup(u64([1, 2]))
    group["item"].close()
    before = snapshot(group["user"], u64(range(10)))
    off = np.array([0, 1], np.int64)
    with pytest.raises(ValueError, match="closed"):
        group.lookup_sum({"user": (u64([7]), off), "item": (u64([7]), off)})
    with pytest.raises(ValueError, match="closed"):
        group.apply_gradients(
            {
                "user": (u64([1]), off, np.ones((1, 4), np.float32)),
                "item": (u64([1]), off, np.ones((1, 7), np.float32)),
            }
        )
    assert_unchanged(before, snapshot(group["user"], u64(range(10))))


def test_group_rejects_non_tables() -> None:
    """A TableGroup holds only Tables."""
    with pytest.raises(TypeError):
        embstore.TableGroup({"x": object()})  # type: ignore[dict-item]
