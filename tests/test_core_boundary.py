"""The group calls' contract at the Python/C++ boundary: canonical arrays per table, or a
TypeError naming the table and the argument (never None/False, nothing applied)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import embstore
from embstore import _core

KEYS = np.array([5, 6, 7], dtype=np.uint64)
OFFSETS = np.array([0, 2, 3], dtype=np.int64)
GRADS = np.ones((2, 4), dtype=np.float32)


def _impl(t: embstore.Table) -> _core.Table:
    return t._internals().live()


@pytest.mark.parametrize(
    ("entry", "argument"),
    [
        ((KEYS.astype(np.float64), OFFSETS), "keys"),
        ((KEYS[::2], OFFSETS[:2]), "keys"),
        ((KEYS, OFFSETS.astype(np.int32)), "offsets"),
        ((KEYS, OFFSETS, np.ones(3, dtype=np.float64)), "weights"),
        ((KEYS, OFFSETS, np.ones(2, dtype=np.float32)), "weights"),
        ([KEYS, OFFSETS], "tuple"),
        ((KEYS,), "tuple"),
    ],
)
def test_group_lookup_sum_rejects_non_canonical(entry: Any, argument: str) -> None:
    t = embstore.Table(dim=4, capacity=64)
    with pytest.raises(TypeError, match=f"table 'emb'.*{argument}"):
        _core.group_lookup_sum([_impl(t)], [entry], 0, True, ["emb"])
    assert len(t) == 0


@pytest.mark.parametrize(
    ("entry", "argument"),
    [
        ((KEYS.view(np.int64), OFFSETS, GRADS.astype(np.float64)), "grads"),
        ((KEYS, OFFSETS, np.ones((2, 5), dtype=np.float32)), "grads"),
        ((KEYS, OFFSETS, np.asfortranarray(np.ones((2, 4), np.float32))), "grads"),
        ((KEYS, OFFSETS, GRADS, np.ones(3, dtype=np.float16)), "weights"),
    ],
)
def test_group_apply_gradients_rejects_non_canonical(entry: Any, argument: str) -> None:
    t = embstore.Table(dim=4, capacity=64, initializer=embstore.Zeros())
    t.lookup(KEYS)
    before = t.lookup(KEYS, insert=False)
    with pytest.raises(TypeError, match=f"table 'emb'.*{argument}"):
        _core.group_apply_gradients([_impl(t)], [entry], 0, ["emb"])
    np.testing.assert_array_equal(t.lookup(KEYS, insert=False), before)


def test_group_calls_take_canonical_arrays() -> None:
    t = embstore.Table(dim=4, capacity=64, initializer=embstore.Zeros())
    (out,) = _core.group_lookup_sum([_impl(t)], [(KEYS.view(np.int64), OFFSETS)], 0, True, ["e"])
    np.testing.assert_array_equal(out, np.zeros((2, 4), dtype=np.float32))
    assert len(t) == 3
    assert _core.group_apply_gradients([_impl(t)], [(KEYS, OFFSETS, GRADS, None)], 0, ["e"]) is True
