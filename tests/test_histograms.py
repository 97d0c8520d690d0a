"""Raw latency histograms in Python (_core.LatencyHistogram, HistogramSnapshot): standalone
histograms, adding snapshots of several processes, and pickling them across processes."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore import _core

EMPTY = _core.HistogramSnapshot()
values_ns = st.lists(st.integers(min_value=0, max_value=10**12), min_size=0, max_size=200)


@pytest.fixture(autouse=True)
def _metrics_on() -> Iterator[None]:
    embstore.metrics.enable(True)
    yield
    embstore.metrics.enable(True)


def _snapshot(values: list[int]) -> _core.HistogramSnapshot:
    h = _core.LatencyHistogram()
    for v in values:
        h.record(v)
    return h.snapshot()


@settings(max_examples=60, deadline=None)
@given(st.lists(values_ns, min_size=0, max_size=5))
def test_merged_parts_summarise_as_one_histogram_of_every_value(parts: list[list[int]]) -> None:
    merged = _core.merge_histograms([_snapshot(p) for p in parts])
    every = [v for p in parts for v in p]
    got = _core.summarize_histograms(EMPTY, merged)
    assert got == pytest.approx(_core.histogram_summary(every))
    assert got["count"] == len(every)
    assert merged.sum_ns == int(np.sum(np.array(every, dtype=np.uint64)))
    assert merged.max_ns == (max(every) if every else 0)


def test_merge_adds_buckets_and_resets_and_keeps_the_largest_max() -> None:
    a, b = _snapshot([1_000, 2_000]), _snapshot([3_000_000])
    m = _core.merge_histograms([a, b])
    ca, cb, cm = (np.frombuffer(s.counts, dtype="<u8") for s in (a, b, m))
    np.testing.assert_array_equal(cm, ca + cb)
    assert (m.sum_ns, m.max_ns) == (3_003_000, 3_000_000)
    r = _core.HistogramSnapshot(a.counts, a.sum_ns, a.max_ns, 2)
    assert _core.merge_histograms([r, b, r]).resets == 4


@settings(max_examples=30, deadline=None)
@given(values_ns)
def test_snapshot_pickles_exactly(values: list[int]) -> None:
    s = _snapshot(values)
    s = _core.HistogramSnapshot(s.counts, s.sum_ns, s.max_ns, len(values) % 3)
    t = pickle.loads(pickle.dumps(s))
    assert (t.counts, t.sum_ns, t.max_ns, t.resets) == (s.counts, s.sum_ns, s.max_ns, s.resets)


def test_bad_pickled_state_names_the_field() -> None:
    s = _core.HistogramSnapshot.__new__(_core.HistogramSnapshot)
    with pytest.raises(ValueError, match="counts"):
        s.__setstate__((b"\0" * 8, 0, 0, 0))


def test_standalone_records_whatever_the_switch_registry_obeys_it() -> None:
    embstore.metrics.enable(False)
    own = _core.LatencyHistogram()
    own.record(5_000)
    named = _core.named_histogram("test.histograms.switch")
    before = named.snapshot()
    named.record(5_000)
    assert _core.summarize_histograms(EMPTY, own.snapshot())["count"] == 1
    assert _core.summarize_histograms(before, named.snapshot())["count"] == 0
    embstore.metrics.enable(True)
    named.record(5_000)
    assert _core.summarize_histograms(before, named.snapshot())["count"] == 1
