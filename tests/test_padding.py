"""padding_id: the id that stands for "no id" contributes nothing, gets no row, no update.

Every check compares a table with a padding id against a twin without one that is given
the same batch with the padding ids taken out by a plain loop (the oracle)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_rows_equal, assert_unchanged, random_offsets, snapshot, u64

import embstore

PAD = -1
PAD_BITS = np.uint64(2**64 - 1)
UNIVERSE = u64([*range(60), 2**64 - 1])


def _tables(**kw: Any) -> tuple[embstore.Table, embstore.Table]:
    settings: dict[str, Any] = {
        "dim": 3,
        "capacity": 200,
        "optimizer": embstore.Adagrad(lr=0.3),
        "initializer": embstore.Uniform(-1, 1, seed=4),
        "num_shards": 2,
        **kw,
    }
    return embstore.Table(**settings, padding_id=PAD), embstore.Table(**settings)


def _without_padding(
    keys: np.ndarray, offsets: np.ndarray, weights: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The oracle: the same bags, padding ids left out, by a plain loop."""
    out_keys: list[int] = []
    out_w: list[float] = []
    out_off = [0]
    bits = keys.view(np.uint64)
    for b in range(len(offsets) - 1):
        for i in range(offsets[b], offsets[b + 1]):
            if bits[i] != PAD_BITS:
                out_keys.append(int(bits[i]))
                if weights is not None:
                    out_w.append(float(weights[i]))
        out_off.append(len(out_keys))
    w = None if weights is None else np.array(out_w, np.float32)
    return u64(out_keys), np.array(out_off, np.int64), w


def _batch(rng: np.random.Generator, bags: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = int(rng.integers(0, 5 * bags + 1))
    keys = rng.integers(0, 60, size=n).astype(np.int64)
    keys[rng.random(n) < 0.3] = PAD  # about a third padding, some bags all padding
    w = rng.uniform(-2, 2, size=n).astype(np.float32)
    return keys, random_offsets(rng, n, bags), w


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_training_ignores_padding(
    mode: str, weighted: bool, rng: np.random.Generator
) -> None:
    padded, twin = _tables()
    for _ in range(12):
        bags = int(rng.integers(1, 9))
        keys, off, w = _batch(rng, bags)
        weights = w if weighted else None
        rk, roff, rw = _without_padding(keys, off, weights)
        got = padded.lookup_sum(keys, off, weights=weights, mode=mode)
        assert_rows_equal(got, twin.lookup_sum(rk, roff, weights=rw, mode=mode))
        g = rng.normal(size=(bags, 3)).astype(np.float32)
        padded.apply_gradients(keys, g, offsets=off, weights=weights, mode=mode)
        twin.apply_gradients(rk, g, offsets=roff, weights=rw, mode=mode)
    assert not padded.contains(u64([PAD_BITS]))[0]
    assert len(padded) == len(twin)
    assert_rows_equal(padded.lookup(UNIVERSE, insert=False), twin.lookup(UNIVERSE, insert=False))


def test_lookup_and_per_id_apply_ignore_padding(rng: np.random.Generator) -> None:
    padded, twin = _tables()
    keys = np.array([3, PAD, 7, PAD, 3], np.int64)
    out = np.full((5, 3), 9.0, np.float32)
    got = padded.lookup(keys, out=out)
    assert got is out
    assert np.array_equal(got[[1, 3]], np.zeros((2, 3), np.float32))
    assert_rows_equal(got[[0, 2, 4]], twin.lookup(u64([3, 7, 3])))
    g = rng.normal(size=(5, 3)).astype(np.float32)
    padded.apply_gradients(keys, g)
    twin.apply_gradients(u64([3, 7, 3]), g[[0, 2, 4]])
    assert_rows_equal(padded.lookup(UNIVERSE, insert=False), twin.lookup(UNIVERSE, insert=False))
    assert len(padded) == 2
    assert not padded.contains(u64([PAD_BITS]))[0]


def test_group_drops_padding_of_the_tables_that_have_it(rng: np.random.Generator) -> None:
    padded, padded_twin = _tables()
    plain = embstore.Table(dim=2, capacity=200, initializer=embstore.Uniform(-1, 1, seed=4))
    plain_twin = embstore.Table(dim=2, capacity=200, initializer=embstore.Uniform(-1, 1, seed=4))
    group = embstore.TableGroup({"p": padded, "q": plain})
    for _ in range(8):
        bags = int(rng.integers(1, 6))
        kp, offp, wp = _batch(rng, bags)
        kq, offq, _ = _batch(rng, bags)
        rk, roff, rw = _without_padding(kp, offp, wp)
        out = group.lookup_sum({"p": (kp, offp, wp), "q": (kq, offq)})
        assert_rows_equal(out["p"], padded_twin.lookup_sum(rk, roff, weights=rw))
        assert_rows_equal(out["q"], plain_twin.lookup_sum(kq, offq))  # -1 is a real id here
        gp = rng.normal(size=(bags, 3)).astype(np.float32)
        gq = rng.normal(size=(bags, 2)).astype(np.float32)
        group.apply_gradients({"p": (kp, offp, gp, wp), "q": (kq, offq, gq)})
        padded_twin.apply_gradients(rk, gp, offsets=roff, weights=rw)
        plain_twin.apply_gradients(kq, gq, offsets=offq)
    assert plain.contains(u64([PAD_BITS]))[0]
    assert not padded.contains(u64([PAD_BITS]))[0]
    for t, twin in ((padded, padded_twin), (plain, plain_twin)):
        assert_rows_equal(t.lookup(UNIVERSE, insert=False), twin.lookup(UNIVERSE, insert=False))


def test_bad_offsets_with_padding_raise_and_change_nothing() -> None:
    padded, _ = _tables()
    padded.lookup(u64([1, 2]))
    probe = UNIVERSE[:-1]  # snapshot counts every probe id as a hit or miss: no padding
    before = snapshot(padded, probe)
    keys = np.array([1, PAD, 2], np.int64)
    for off in ([0, 2], [0, 3, 2, 3], [1, 3]):
        with pytest.raises(ValueError, match="offsets"):
            padded.lookup_sum(keys, off)
        with pytest.raises(ValueError, match="offsets"):
            padded.apply_gradients(keys, np.ones((len(off) - 1, 3)), offsets=off)
        with pytest.raises(ValueError, match=r"'p'.*offsets"):
            embstore.TableGroup({"p": padded}).lookup_sum({"p": (keys, np.array(off))})
    assert_unchanged(before, snapshot(padded, probe))


def test_padding_id_is_kept_by_save_load_pickle_and_import(tmp_path: Path) -> None:
    padded, _ = _tables()
    padded.lookup_sum(np.array([1, PAD, 2]), [0, 3])
    padded.save(tmp_path / "c")
    for copy in (embstore.Table.load(tmp_path / "c"), pickle.loads(pickle.dumps(padded))):
        assert copy.padding_id == PAD == copy.spec.padding_id
        copy.lookup_sum(np.array([PAD, 5]), [0, 2])
        assert len(copy) == 3
        assert not copy.contains(u64([PAD_BITS]))[0]
    with pytest.raises(ValueError, match="padding id"):
        padded.import_({"ids": u64([PAD_BITS]), "values": np.zeros((1, 3), np.float32)})
    assert len(padded) == 2


@pytest.mark.parametrize(
    ("value", "exc"),
    [(1.5, TypeError), (True, TypeError), (2**64, ValueError), (-(2**63) - 1, ValueError)],
)
def test_bad_padding_id_names_the_argument(value: Any, exc: type) -> None:
    with pytest.raises(exc, match="padding_id"):
        embstore.Table(dim=2, capacity=8, padding_id=value)


def test_padding_id_as_uint64_or_numpy_int_is_the_same_id() -> None:
    a = embstore.Table(dim=2, capacity=8, padding_id=2**64 - 1)
    b = embstore.Table(dim=2, capacity=8, padding_id=np.int64(-1))
    for t in (a, b):
        t.lookup(np.array([-1, 4], np.int64))
        assert len(t) == 1
