"""embstore.ps._wire writes and reads the bulk messages exactly as the generated message
classes do: checked field for field on random and edge-case batches, both directions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("grpc_tools", reason="grpcio-tools absent (pip install 'embstore[ps]')")
pytest.importorskip("google.protobuf", reason="protobuf absent (pip install 'embstore[ps]')")

from embstore.ps import _wire
from embstore.ps._proto import messages

NAMES = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@st.composite
def tables(draw: Any, with_grads: bool) -> list[_wire.TableArrays]:
    out = []
    for name in draw(st.lists(NAMES, max_size=4, unique=True)):
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        bags = draw(st.integers(0, 6))
        lengths = rng.integers(0, 4, bags)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        n = int(offsets[-1])
        keys = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
        weights = rng.random(n, dtype=np.float32) if draw(st.booleans()) else None
        dim = draw(st.integers(1, 5))
        grads = rng.standard_normal((bags, dim), dtype=np.float32) if with_grads else None
        out.append(_wire.TableArrays(name, keys, offsets, weights=weights, grads=grads))
    return out


def _same_batches(parsed: Any, given: list[_wire.TableArrays]) -> None:
    assert [tb.table for tb in parsed] == [t.table for t in given]
    for tb, t in zip(parsed, given, strict=True):
        assert tb.keys == t.keys.astype("<u8").tobytes()
        assert tb.offsets == t.offsets.astype("<i8").tobytes()
        assert tb.weights == (b"" if t.weights is None else t.weights.astype("<f4").tobytes())
        assert tb.grads == (b"" if t.grads is None else t.grads.astype("<f4").tobytes())


SEND_NS = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=60, deadline=None)
@given(tables(with_grads=False), st.booleans(), st.integers(0, 1), SEND_NS)
def test_lookup_request_parses_as_the_message(
    ts: list[_wire.TableArrays], insert: bool, mode: int, send_ns: int
) -> None:
    raw = _wire.encode_lookup_request(ts, insert=insert, mode=mode, client_send_ns=send_ns)
    msg = messages["LookupRequest"].FromString(raw)
    _same_batches(msg.tables, ts)
    assert (msg.insert, msg.mode, msg.client_send_ns) == (insert, mode, send_ns)
    # ... and the server's reader gets the same back from the message's own bytes.
    views, scalars = _wire.parse_request(msg.SerializeToString())
    assert scalars.get(2, 0) == insert
    assert scalars.get(3, 0) == mode
    assert scalars.get(4, 0) == send_ns
    for v, t in zip(views, ts, strict=True):
        assert v.table == t.table
        np.testing.assert_array_equal(v.keys, t.keys)
        np.testing.assert_array_equal(v.offsets, t.offsets)
        assert (v.weights is None) == (t.weights is None or t.weights.size == 0)
        if v.weights is not None:
            np.testing.assert_array_equal(v.weights, t.weights)


@settings(max_examples=60, deadline=None)
@given(tables(with_grads=True), st.integers(0, 1), SEND_NS)
def test_push_request_parses_as_the_message(
    ts: list[_wire.TableArrays], mode: int, send_ns: int
) -> None:
    raw = _wire.encode_push_request(ts, mode=mode, client_send_ns=send_ns)
    msg = messages["PushGradRequest"].FromString(raw)
    _same_batches(msg.tables, ts)
    assert (msg.mode, msg.client_send_ns) == (mode, send_ns)
    views, scalars = _wire.parse_request(raw)
    assert scalars.get(3, 0) == send_ns
    for v, t in zip(views, ts, strict=True):
        assert t.grads is not None
        np.testing.assert_array_equal(v.grads, t.grads.reshape(-1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), max_size=5), st.integers())
def test_lookup_response_both_ways(shapes: list[tuple[int, int]], seed: int) -> None:
    rng = np.random.default_rng(seed % 2**32)
    pooled = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    raw = _wire.encode_lookup_response(pooled)
    msg = messages["LookupResponse"].FromString(raw)
    assert list(msg.dims) == [d for _, d in shapes]
    assert list(msg.pooled) == [a.tobytes() for a in pooled]
    for blob in (raw, msg.SerializeToString()):
        spans, dims = _wire.parse_lookup_response(blob)
        assert dims == [d for _, d in shapes]
        got = [blob[s : s + n] for s, n in spans]
        assert got == [a.tobytes() for a in pooled]


def test_non_native_arrays_are_written_little_endian() -> None:
    keys = np.array([1, 2, 3], dtype=">u8")
    offsets = np.array([0, 3], dtype=np.int32)
    t = _wire.TableArrays("t", keys, offsets, weights=np.ones(6, np.float64)[::2])
    msg = messages["LookupRequest"].FromString(
        _wire.encode_lookup_request([t], insert=False, mode=0, client_send_ns=0)
    )
    assert msg.tables[0].keys == np.array([1, 2, 3], "<u8").tobytes()
    assert msg.tables[0].offsets == np.array([0, 3], "<i8").tobytes()
    assert msg.tables[0].weights == np.ones(3, "<f4").tobytes()


def test_malformed_bytes_raise_wire_error() -> None:
    raw = _wire.encode_lookup_response([np.ones((2, 3), np.float32)])
    with pytest.raises(_wire.WireError, match="runs past the end"):
        _wire.parse_lookup_response(raw[:-5])
    with pytest.raises(_wire.WireError, match="varint"):
        _wire.parse_request(b"\x0a\xff")
    with pytest.raises(_wire.WireError, match="wire type"):
        _wire.parse_request(b"\x0b")
    with pytest.raises(ValueError, match=r"keys is 3 bytes"):
        _wire.parse_request(b"\x0a\x05\x12\x03abc")


def test_keep_freed_memory_sets_glibc_or_says_it_did_not(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes
    import platform

    from embstore import ps

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("keep_freed_memory tunes glibc only")
    assert ps.keep_freed_memory() is True

    class Refusing:
        def mallopt(self, param: int, value: int) -> int:
            return 0 if param == -3 else 1  # glibc refuses the mmap threshold

    monkeypatch.setattr(ctypes, "CDLL", lambda _name: Refusing())
    assert ps.keep_freed_memory() is False  # a refusal is reported, not hidden
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", ""))
    assert ps.keep_freed_memory() is False
