"""The core's CSR offsets check (reached by TableGroup calls given arrays in the core's own
dtypes): valid offsets of any shape pass and pool like numpy, a decrease anywhere, even
between extreme values, raises naming its first position, and nothing changes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import u64
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore

I64 = np.iinfo(np.int64)


def _group() -> embstore.TableGroup:
    table = embstore.Table(dim=3, capacity=1000, optimizer=embstore.SGD(lr=0.1), num_shards=2)
    return embstore.TableGroup({"t": table})


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5), min_size=0, max_size=40))
def test_valid_offsets_pool_every_bag(sizes: list[int]) -> None:
    """Bags of any sizes (empty ones too): every bag's sum is the sum of its rows."""
    group = _group()
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    keys = u64(np.arange(int(offsets[-1])) % 7)
    out = group.lookup_sum({"t": (keys, offsets)})["t"]
    rows = group["t"].lookup(keys, insert=False)
    ref = np.array(
        [rows[offsets[b] : offsets[b + 1]].sum(0) for b in range(len(sizes))], np.float32
    ).reshape(len(sizes), 3)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3), min_size=2, max_size=40),
    data=st.data(),
)
def test_a_decrease_anywhere_raises_naming_its_first_position(
    sizes: list[int], data: st.DataObject
) -> None:
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(offsets[-1])
    # Break the order at an inner position, with an ordinary or an extreme value.
    inner = list(range(1, len(offsets) - 1)) or [1]
    first = data.draw(st.sampled_from(inner))
    value = data.draw(st.sampled_from([-1, I64.min, int(offsets[first - 1]) - 1]))
    bad = offsets.copy()
    bad[first] = value
    if data.draw(st.booleans()) and first + 2 < len(bad):
        bad[first + 1] = I64.max  # a later jump up that would wrap a signed difference
    group = _group()
    keys = u64(np.arange(n) % 5)
    with pytest.raises(ValueError, match=rf"offsets\[{first - 1}\]") as err:
        group.lookup_sum({"t": (keys, bad)})
    assert "non-decreasing" in str(err.value)
    assert "'t'" in str(err.value)
    with pytest.raises(ValueError, match="non-decreasing"):
        group.apply_gradients({"t": (keys, bad, np.ones((len(sizes), 3), np.float32))})
    assert len(group["t"]) == 0  # nothing was inserted


def test_offsets_first_and_last_are_checked() -> None:
    group = _group()
    keys = u64([1, 2, 3])
    with pytest.raises(ValueError, match=r"offsets\[0\] must be 0"):
        group.lookup_sum({"t": (keys, np.array([1, 2, 3], np.int64))})
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal len\(keys\)=3"):
        group.lookup_sum({"t": (keys, np.array([0, 1, 2], np.int64))})
    assert len(group["t"]) == 0
