"""Bad checkpoint files: every flipped byte, every truncation, wrong magic or version, foreign
files. Each raises embstore.CheckpointError naming the file, and nothing is returned."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import checkpoint


def small_checkpoint(path: Path, *, delta: bool = False) -> bytes:
    """A small file with several sections (two shards, admission sketch; a delta adds
    removed ids)."""
    t = embstore.Table(
        dim=3,
        capacity=64,
        num_shards=2,
        optimizer=embstore.Adam(lr=0.01),
        admission=embstore.CountFilter(min_count=2, width=16, depth=2),
    )
    keys = np.arange(12, dtype=np.uint64)
    t.lookup(keys)
    t.lookup(keys)
    t.apply_gradients(keys, np.ones((12, 3), np.float32))
    if delta:
        t.save(path.with_suffix(".base"))
        t.erase(keys[:3])
        t.apply_gradients(keys[5:8], np.ones((3, 3), np.float32))
        t.save_delta(path)
    else:
        t.save(path)
    return path.read_bytes()


def assert_rejected(path: Path) -> None:
    """Both readers raise CheckpointError naming the file."""
    with pytest.raises(embstore.CheckpointError) as e:
        checkpoint.read(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_every_flipped_byte_is_detected(tmp_path: Path, delta: bool) -> None:
    good = small_checkpoint(tmp_path / "good", delta=delta)
    assert isinstance(checkpoint.read(tmp_path / "good"), dict)
    bad = tmp_path / "bad"
    for offset in range(len(good)):
        data = bytearray(good)
        data[offset] ^= 0x5A
        bad.write_bytes(bytes(data))
        try:
            checkpoint.read(bad)
        except embstore.CheckpointError as e:
            err = e
        else:
            pytest.fail(f"a flipped byte at offset {offset} of {len(good)} went unnoticed")
        assert str(bad) in str(err)


def test_loader_rejects_corruption_in_each_region(tmp_path: Path) -> None:
    good = small_checkpoint(tmp_path / "good")
    # Offsets: preamble, header JSON, each section header and payload, the trailer.
    offsets = [3, 20, 40, len(good) - 10, len(good) - 40]
    with checkpoint.CheckpointReader(tmp_path / "good") as r:
        for sec in r.sections():
            offsets += [sec.offset - 30, sec.offset + max(0, sec.nbytes - 1)]
            r.skip_payload(sec)
    bad = tmp_path / "bad"
    for offset in offsets:
        data = bytearray(good)
        data[offset] ^= 0x01
        bad.write_bytes(bytes(data))
        with pytest.raises(embstore.CheckpointError) as e:
            embstore.Table.load(bad)
        assert str(bad) in str(e.value)


def test_every_truncation_is_detected(tmp_path: Path) -> None:
    good = small_checkpoint(tmp_path / "good")
    bad = tmp_path / "cut"
    for length in range(len(good)):
        bad.write_bytes(good[:length])
        assert_rejected(bad)
        if length % 97 == 0:
            with pytest.raises(embstore.CheckpointError, match="cut"):
                embstore.Table.load(bad)


def test_appended_bytes_are_detected(tmp_path: Path) -> None:
    good = small_checkpoint(tmp_path / "good")
    bad = tmp_path / "long"
    bad.write_bytes(good + b"\0" * 64)
    assert_rejected(bad)


def test_wrong_version(tmp_path: Path) -> None:
    good = bytearray(small_checkpoint(tmp_path / "good"))
    struct.pack_into("<I", good, 16, 99)
    struct.pack_into("<I", good, 28, zlib.crc32(bytes(good[:28])))
    bad = tmp_path / "v99"
    bad.write_bytes(bytes(good))
    with pytest.raises(embstore.CheckpointError, match="version 99"):
        embstore.Table.load(bad)
    with pytest.raises(embstore.CheckpointError, match="v99"):
        checkpoint.read_header(bad)


def test_wrong_magic_and_foreign_files(tmp_path: Path) -> None:
    good = small_checkpoint(tmp_path / "good")
    np.save(tmp_path / "array.npy", np.arange(100))
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "text").write_text("hello, this is not a checkpoint\n" * 10)
    (tmp_path / "magic").write_bytes(b"X" + good[1:])
    (tmp_path / "short").write_bytes(good[:20])
    for name in ("array.npy", "empty", "text", "magic", "short"):
        with pytest.raises(embstore.CheckpointError) as e:
            embstore.Table.load(tmp_path / name)
        assert str(tmp_path / name) in str(e.value)
        assert isinstance(e.value, ValueError)
    with pytest.raises(embstore.CheckpointError, match="not an embstore checkpoint"):
        checkpoint.read(tmp_path / "array.npy")


def test_valid_checksums_with_a_bad_header_are_rejected(tmp_path: Path) -> None:
    """A well-formed file whose JSON header lies (written by hand) is still refused."""
    good = small_checkpoint(tmp_path / "good")
    header = checkpoint.read_header(tmp_path / "good")
    for key, value in (("row_width", 99), ("kind", "sideways"), ("format", "other")):
        h = {k: v for k, v in header.items() if k not in ("rows", "removed", "sections")}
        h[key] = value
        path = tmp_path / f"lie-{key}"
        rewrite_header(tmp_path / "good", path, h)
        with pytest.raises(embstore.CheckpointError) as e:
            embstore.Table.load(path)
        assert str(path) in str(e.value)
    assert good


def rewrite_header(src: Path, dst: Path, header: dict[str, object]) -> None:
    """Copies a checkpoint with another JSON header (checksums recomputed)."""
    arrays = []
    with checkpoint.CheckpointReader(src) as r:
        for sec in r.sections():
            arrays.append((sec.name, sec.shard, r.read_payload(sec)))
    with checkpoint.CheckpointWriter(dst, header) as w:
        for name, shard, arr in arrays:
            w.section(name, arr, shard)
        w.finish()


def test_a_failed_load_returns_nothing_and_leaves_no_table(tmp_path: Path) -> None:
    good = small_checkpoint(tmp_path / "good")
    data = bytearray(good)
    data[-200] ^= 0xFF  # late in the file: the table is being filled when it is found
    (tmp_path / "late").write_bytes(bytes(data))
    before = set(embstore.metrics._open_tables())
    with pytest.raises(embstore.CheckpointError):
        embstore.Table.load(tmp_path / "late")
    assert set(embstore.metrics._open_tables()) == before
