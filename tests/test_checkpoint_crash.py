"""Crash safety: a process killed (SIGKILL) at any moment of a save leaves the previous
checkpoint at that path loadable and intact, and no temporary file is taken for a
checkpoint.

A child process saves table B over table A's checkpoint. The writer's test hook
(EMBSTORE_CHECKPOINT_TEST_PAUSE=<point>) makes it write a marker file and sleep at a known
point, where the test kills it; other runs kill a child that saves in a loop at random
times.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import checkpoint

pytestmark = pytest.mark.slow

CHILD = """
import sys, numpy as np, embstore
path, rows, loop = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "loop"
t = embstore.Table(dim=8, capacity=2 * rows, num_shards=4, optimizer=embstore.Adam(lr=0.01),
                   initializer=embstore.Uniform(-1, 1, seed=2))
t.apply_gradients(np.arange(rows), np.ones((rows, 8), np.float32))
print("ready", flush=True)
while True:
    t.save(path)
    if not loop:
        break
    t.apply_gradients(np.arange(rows), np.ones((rows, 8), np.float32))
"""
GROUP_CHILD = """
import sys, numpy as np, embstore
d = sys.argv[1]
g = embstore.TableGroup({n: embstore.Table(dim=4, capacity=5000, num_shards=2,
                                           initializer=embstore.Uniform(-1, 1, seed=9))
                         for n in ("a", "b", "c")})
for t in g.values():
    t.lookup(np.arange(3000))
g.save(d)
"""


def table_a(rows: int) -> embstore.Table:
    t = embstore.Table(
        dim=8,
        capacity=2 * rows,
        num_shards=4,
        optimizer=embstore.Adam(lr=0.01),
        initializer=embstore.Normal(std=1.0, seed=1),
    )
    t.apply_gradients(np.arange(rows) + 7, np.full((rows, 8), 0.5, np.float32))
    return t


def digest(rows: dict[str, np.ndarray]) -> bytes:
    order = np.argsort(rows["ids"], kind="stable")
    return b"".join(np.ascontiguousarray(rows[k][order]).tobytes() for k in sorted(rows))


def run_child(
    args: list[str], env_extra: dict[str, str], code: str = CHILD
) -> subprocess.Popen[str]:
    env = dict(os.environ, **env_extra)
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, text=True
    )


def wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the child exited ({proc.returncode}) before reaching the pause point")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the child never reached the pause point")
        time.sleep(0.01)


def kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(60)
    assert proc.returncode == -signal.SIGKILL
    if proc.stdout is not None:
        proc.stdout.close()


def check_directory(directory: Path, ckpt: Path) -> None:
    """Only the checkpoint and maybe the killed save's temporary file are there. A
    temporary file never sits at a checkpoint's path (a hidden name with a .tmp suffix,
    which the next save in a group directory removes); read as a checkpoint it is either
    refused (incomplete) or complete (killed after its trailer was written)."""
    for p in directory.iterdir():
        if p == ckpt or p.name.startswith("marker"):
            continue
        assert p.name.startswith(f".{ckpt.name}."), p.name
        assert p.name.endswith(".tmp"), p.name
        try:
            rows = checkpoint.read(p)
        except embstore.CheckpointError:
            continue
        assert rows["ids"].shape[0] == checkpoint.read_header(p)["rows"]


# Sections of the child's file: 4 shards x (ids, rows, last_step), chunks of all rows.
POINTS = [
    "header",
    "section:0",
    "section:1",
    "section:5",
    "section:11",
    "trailer",
    "fsync",
    "replace",
    "dirsync",
]


@pytest.mark.parametrize("point", POINTS)
def test_kill_at_a_known_point_keeps_the_previous_checkpoint(tmp_path: Path, point: str) -> None:
    rows = 2000
    ckpt = tmp_path / "table.ckpt"
    old = table_a(rows)
    old.save(ckpt)
    want_old = digest(old.export())
    marker = tmp_path / "marker"
    proc = run_child(
        [str(ckpt), str(rows), "once"],
        {"EMBSTORE_CHECKPOINT_TEST_PAUSE": point, "EMBSTORE_CHECKPOINT_TEST_MARKER": str(marker)},
    )
    wait_for(marker, proc)
    kill(proc)
    loaded = embstore.Table.load(ckpt)
    got = digest(loaded.export())
    if point == "dirsync":  # killed after the rename: the new checkpoint is complete
        assert got != want_old
        assert len(loaded) == rows
        assert checkpoint.read_header(ckpt)["rows"] == rows
    else:
        assert got == want_old
    assert digest(checkpoint.read(ckpt)) == got
    check_directory(tmp_path, ckpt)


def test_kill_at_random_times_keeps_a_whole_checkpoint(tmp_path: Path) -> None:
    rows = 60_000
    ckpt = tmp_path / "table.ckpt"
    old = table_a(rows)
    old.save(ckpt)
    seen = {digest(old.export())}
    rng = np.random.default_rng(11)
    for _ in range(5):
        proc = run_child([str(ckpt), str(rows), "loop"], {})
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(float(rng.uniform(0.0, 0.6)))
        kill(proc)
        loaded = embstore.Table.load(ckpt)  # whatever was last renamed in: whole
        e = loaded.export()
        assert len(loaded) == rows
        # Either A's rows or a save of the child's: every row of one moment.
        if digest(e) not in seen:
            steps = np.unique(e["step"])
            assert steps.shape[0] == 1, "rows of several saves mixed"
            seen.add(digest(e))
        check_directory(tmp_path, ckpt)


@pytest.mark.parametrize("point", ["section:4", "replace", "small-replace"])
def test_group_save_killed_keeps_the_previous_group(tmp_path: Path, point: str) -> None:
    d = tmp_path / "group"
    a = embstore.Table(dim=4, capacity=5000, num_shards=2)
    a.lookup(np.arange(100))
    g = embstore.TableGroup({"a": a, "b": embstore.Table(dim=4, capacity=10)})
    g.save(d)
    before = sorted(os.listdir(d))
    marker = tmp_path / "marker"
    proc = run_child(
        [str(d)],
        {"EMBSTORE_CHECKPOINT_TEST_PAUSE": point, "EMBSTORE_CHECKPOINT_TEST_MARKER": str(marker)},
        code=GROUP_CHILD,
    )
    wait_for(marker, proc)
    kill(proc)
    h = embstore.TableGroup.load(d)
    assert h.names == ["a", "b"]
    assert len(h["a"]) == 100
    assert len(h["b"]) == 0
    assert digest(h["a"].export()) == digest(a.export())
    assert set(before) <= set(os.listdir(d))
    g.save(d)  # the next save cleans up what the killed one left
    assert len(os.listdir(d)) == 3
