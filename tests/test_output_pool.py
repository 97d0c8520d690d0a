"""Results come from the core's output pool: recycled when freed, never shared while alive."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from helpers import u64

import embstore
from embstore import _core


@pytest.fixture
def pool_limit() -> Iterator[int]:
    """The pool's limit, restored after the test (which may change it)."""
    limit = _core.output_pool_limit()
    yield limit
    _core.set_output_pool_limit(limit)


def _table(dim: int = 8) -> embstore.Table:
    return embstore.Table(dim=dim, capacity=1 << 14, optimizer=embstore.SGD(lr=0.1))


def test_freed_result_is_reused_by_the_next_call_of_its_size() -> None:
    t = _table()
    keys = u64(range(4096))
    first = t.lookup(keys)  # 128 KiB
    address = first.ctypes.data
    pooled = _core.output_pool_bytes()
    del first
    assert _core.output_pool_bytes() == pooled + _pooled_bytes(4096, 8)
    second = t.lookup(keys)
    assert second.ctypes.data == address
    assert _core.output_pool_bytes() == pooled


def _pooled_bytes(rows: int, dim: int) -> int:
    """Bytes the pool holds for a released float32 [rows, dim] result (whole 4 KiB pages)."""
    return -(-rows * dim * 4 // 4096) * 4096


def test_live_results_never_share_memory() -> None:
    """Results held at once are distinct buffers and keep their values as later calls run."""
    t = _table()
    batches = [u64(range(k * 1000, k * 1000 + 2048)) for k in range(4)]
    results = [t.lookup(b) for b in batches]
    kept = [r.copy() for r in results]
    for b in batches:  # more calls of the same size, while the first results are alive
        t.lookup_sum(b, np.arange(b.shape[0] + 1))
        t.lookup(b)
    for r, k in zip(results, kept, strict=True):
        np.testing.assert_array_equal(r, k)
    addresses = {r.ctypes.data for r in results}
    assert len(addresses) == len(results)


def test_group_results_come_from_the_pool() -> None:
    tables = {name: _table() for name in ("a", "b")}
    g = embstore.TableGroup(tables)
    keys = u64(range(3000))
    offsets = np.arange(keys.shape[0] + 1)
    out = g.lookup_sum({"a": (keys, offsets), "b": (keys, offsets)})
    addresses = {name: arr.ctypes.data for name, arr in out.items()}
    np.testing.assert_array_equal(out["a"], tables["a"].lookup(keys, insert=False))
    del out
    again = g.lookup_sum({"a": (keys, offsets), "b": (keys, offsets)})
    assert {arr.ctypes.data for arr in again.values()} == set(addresses.values())


def test_result_is_an_ordinary_writable_array_that_outlives_its_table() -> None:
    t = _table(dim=5)
    keys = u64([1, 2, 3])
    out = t.lookup(keys)
    want = t.lookup(keys, insert=False).copy()
    assert out.dtype == np.float32
    assert out.shape == (3, 5)
    assert out.flags["C_CONTIGUOUS"]
    assert out.flags["WRITEABLE"]
    assert out.flags["ALIGNED"]
    assert out.ctypes.data % 64 == 0
    t.close()
    del t
    np.testing.assert_array_equal(out, want)
    out += 1.0
    np.testing.assert_array_equal(out, want + 1.0)
    assert _table().lookup(u64([])).shape == (0, 8)


def test_pool_keeps_at_most_its_limit(pool_limit: int) -> None:
    limit = 1 << 20
    _core.set_output_pool_limit(limit)
    assert _core.output_pool_bytes() <= limit
    t = _table(dim=16)
    results = [t.lookup(u64(range(n))) for n in range(1000, 9000, 500)]  # 64-576 KiB each
    del results
    assert 0 < _core.output_pool_bytes() <= limit
    big = t.lookup(u64(range(20000)))  # 1.25 MiB: over a quarter of the limit, never kept
    before = _core.output_pool_bytes()
    del big
    assert _core.output_pool_bytes() == before
    _core.set_output_pool_limit(0)
    assert _core.output_pool_bytes() == 0


@pytest.mark.parametrize(("rows", "dim"), [(-1, 4), (3, -2)])
def test_negative_sizes_are_refused(rows: int, dim: int) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        _core.empty_rows(rows, dim)
