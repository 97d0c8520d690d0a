"""The reference PS (embstore.ps): rows through the server equal direct TableGroup calls bit
for bit, errors and their types match TableGroup's, bad requests change nothing, a Save
under concurrent pushes is one instant of the store, timers of every layer meet in one
report, and the load client's smoke runs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("grpc", reason="grpcio absent (pip install 'embstore[ps]')")
pytest.importorskip("grpc_tools", reason="grpcio-tools absent (pip install 'embstore[ps]')")

import grpc
from helpers import group_export, sorted_export

import embstore
from embstore import ps
from embstore.ps._proto import SERVICE, messages
from embstore.ps.config import group_from_config

# Where this process imports embstore from (the installed package, or src/ in a dev loop):
# subprocesses must import the same build.
SRC = str(Path(embstore.__file__).resolve().parents[1])
DIMS = {"user": 4, "item": 8}


def _group(seed: int = 0, optimizer: Any = None) -> embstore.TableGroup:
    return embstore.TableGroup(
        {
            name: embstore.Table(
                dim=dim,
                capacity=4096,
                optimizer=optimizer or embstore.Adagrad(lr=0.05),
                initializer=embstore.Normal(std=0.1, seed=seed + k),
                num_threads=2,
            )
            for k, (name, dim) in enumerate(DIMS.items())
        }
    )


def _close(group: embstore.TableGroup) -> None:
    """Close every table now, so later tests' process-wide metrics do not see them."""
    for table in group.values():
        table.close()


@contextlib.contextmanager
def _serving(group: embstore.TableGroup) -> Iterator[ps.Client]:
    """A client of ``group`` served on a free local port; closes the client, then stops
    the server."""
    with ps.serve(group) as server, ps.Client(f"127.0.0.1:{server.port}", timeout=60) as c:
        yield c


@pytest.fixture
def served() -> Iterator[tuple[embstore.TableGroup, ps.Client]]:
    group = _group()
    with _serving(group) as client:
        yield group, client
    _close(group)


def _batch(rng: np.random.Generator, bags: int, universe: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(0, 6, bags)  # empty bags included
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    keys = rng.integers(0, universe, int(offsets[-1])).astype(np.uint64)  # duplicates
    keys[::7] = np.uint64(2**64 - 1)  # the largest id
    return keys, offsets


def _features(rng: np.random.Generator, weighted: bool) -> dict[str, tuple[Any, ...]]:
    out: dict[str, tuple[Any, ...]] = {}
    for name in DIMS:
        k, off = _batch(rng, int(rng.integers(1, 40)), 300)
        w = rng.standard_normal(k.shape[0]).astype(np.float32)
        out[name] = (k, off, w) if weighted else (k, off)
    return out


def _grads(rng: np.random.Generator, features: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    out = {}
    for name, f in features.items():
        g = rng.standard_normal((f[1].shape[0] - 1, DIMS[name])).astype(np.float32)
        out[name] = (f[0], f[1], g, *f[2:])
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


_rows = group_export


def _assert_same_rows(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name, rows in a.items():
        assert rows.keys() == b[name].keys()
        for k, v in rows.items():
            assert np.array_equal(v.view(np.uint8), b[name][k].view(np.uint8)), (name, k)


def test_rows_match_direct_calls_bit_for_bit(
    served: tuple[embstore.TableGroup, ps.Client], tmp_path: Path
) -> None:
    _, client = served
    direct = _group()
    rng = np.random.default_rng(7)
    for step in range(12):
        features = _features(rng, weighted=step % 3 == 0)
        mode = "mean" if step % 2 else "sum"
        got = client.lookup_sum(features, mode=mode, insert=step != 5)
        want = direct.lookup_sum(features, mode=mode, insert=step != 5)
        assert list(got) == list(features)
        for name in features:
            assert got[name].shape == want[name].shape
            assert np.array_equal(_bits(got[name]), _bits(want[name]))
        grads = _grads(rng, features)
        client.apply_gradients(grads, mode=mode)
        direct.apply_gradients(grads, mode=mode)
    client.save(tmp_path / "remote")
    direct.save(tmp_path / "direct")
    _assert_same_rows(
        _rows(embstore.TableGroup.load(tmp_path / "remote")),
        _rows(embstore.TableGroup.load(tmp_path / "direct")),
    )
    client.save_delta(tmp_path / "delta")
    manifest = json.loads((tmp_path / "delta" / "DELTAS.json").read_text())
    assert manifest["order"] == list(DIMS)


def test_stats_and_dims_describe_the_group(served: tuple[embstore.TableGroup, ps.Client]) -> None:
    group, client = served
    client.lookup_sum({"user": (np.arange(3, dtype=np.uint64), np.array([0, 3]))})
    assert client.dims == DIMS
    assert client.names == group.names
    stats = client.stats()
    assert list(stats) == group.names
    assert stats["user"]["size"] == group["user"].stats()["size"] == 3
    assert "group.lookup_sum" in stats["user"]["latency"]
    layers = {(h.layer, h.table, h.name) for h in client.histograms()}
    assert ("server", "-", "Lookup.Handle") in layers
    assert ("kv", "user", "group.lookup_sum") in layers


_K = np.arange(6, dtype=np.uint64)
_OFF = np.array([0, 2, 6])
_G4 = np.ones((2, 4), np.float32)
_BAD_CALLS: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("lookup_sum", "unknown table", {"user": (_K, _OFF), "nope": (_K, _OFF)}, {}),
    ("lookup_sum", "tuple", {"user": (_K,)}, {}),
    ("lookup_sum", "float keys", {"user": (_K.astype(np.float64), _OFF)}, {}),
    ("lookup_sum", "weights length", {"user": (_K, _OFF, np.ones(5, np.float32))}, {}),
    ("lookup_sum", "offsets order", {"user": (_K, np.array([0, 4, 2]))}, {}),
    ("lookup_sum", "offsets end", {"user": (_K, np.array([0, 2, 9]))}, {}),
    (
        "lookup_sum",
        "inserts then bad table",
        {"user": (_K + np.uint64(100), _OFF), "item": (_K, np.array([0, 4, 2]))},
        {},
    ),
    ("lookup_sum", "mode", {"user": (_K, _OFF)}, {"mode": "max"}),
    ("apply_gradients", "grads shape", {"user": (_K, _OFF, np.ones((2, 3), np.float32))}, {}),
    ("apply_gradients", "NaN grads", {"user": (_K, _OFF, np.full((2, 4), np.nan, np.float32))}, {}),
    (
        "apply_gradients",
        "inf in one table",
        {"item": (_K, _OFF, np.ones((2, 8), np.float32)), "user": (_K, _OFF, _G4 * np.inf)},
        {},
    ),
    ("apply_gradients", "unknown table", {"user": (_K, _OFF, _G4), "x": (_K, _OFF, _G4)}, {}),
]


@pytest.mark.parametrize(
    ("method", "what", "arg", "kwargs"), _BAD_CALLS, ids=[c[1] for c in _BAD_CALLS]
)
def test_errors_match_tablegroup_and_change_nothing(
    served: tuple[embstore.TableGroup, ps.Client],
    method: str,
    what: str,
    arg: dict[str, Any],
    kwargs: dict[str, Any],
) -> None:
    group, client = served
    client.lookup_sum({n: (_K, _OFF) for n in DIMS})  # rows to keep unchanged
    direct = _group()
    direct.lookup_sum({n: (_K, _OFF) for n in DIMS})
    before = _rows(group)
    with pytest.raises(Exception) as want:  # noqa: PT011  (whatever the group raises)
        getattr(direct, method)(arg, **kwargs)
    with pytest.raises(type(want.value)) as got:
        getattr(client, method)(arg, **kwargs)
    assert type(got.value) is type(want.value)
    assert str(got.value) == str(want.value)
    _assert_same_rows(_rows(group), before)


def _raw(client: ps.Client, method: str, request: Any) -> grpc.RpcError:
    channel = grpc.insecure_channel(client.target)
    call = channel.unary_unary(
        f"/{SERVICE}/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=lambda b: b,
    )
    try:
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=30)
    finally:
        channel.close()
    return e.value


def test_malformed_requests_are_invalid_argument_and_change_nothing(
    served: tuple[embstore.TableGroup, ps.Client],
) -> None:
    """Requests no Client would send (bypassing its checks) still leave the store as it was."""
    group, client = served
    client.lookup_sum({n: (_K, _OFF) for n in DIMS})
    before = _rows(group)
    tb = messages["TableBatch"]
    k, off = _K.tobytes(), _OFF.tobytes()
    g = _G4.tobytes()
    bad = [
        ("Lookup", messages["LookupRequest"](tables=[tb(table="user", keys=k[:-1], offsets=off)])),
        ("Lookup", messages["LookupRequest"](tables=[tb(table="user", keys=k, offsets=b"")])),
        (
            "Lookup",
            messages["LookupRequest"](tables=[tb(table="user", keys=k, offsets=off)], mode=7),
        ),
        (
            "Lookup",
            messages["LookupRequest"](
                tables=[
                    tb(table="user", keys=k, offsets=off),
                    tb(table="user", keys=k, offsets=off),
                ]
            ),
        ),
        (
            "PushGrad",
            messages["PushGradRequest"](
                tables=[
                    tb(
                        table="item",
                        keys=k,
                        offsets=off,
                        grads=np.ones((2, 8), np.float32).tobytes(),
                    ),
                    tb(table="user", keys=k, offsets=off, grads=g[:-4]),
                ]
            ),
        ),
        (
            "PushGrad",
            messages["PushGradRequest"](
                tables=[tb(table="user", keys=k, offsets=off, grads=g, weights=b"\0" * 8)]
            ),
        ),
    ]
    for method, request in bad:
        err = _raw(client, method, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.details())
        assert err.details()
    _assert_same_rows(_rows(group), before)


def test_save_under_concurrent_pushes_is_one_instant(tmp_path: Path) -> None:
    """S streams each push +1.0 to every row of their own key set (SGD, lr 1, grad -1), so
    a row's value counts the pushes applied to it. The saved file must show, per stream,
    one count on all its rows (no torn push), and the counts of all streams must be one
    instant: push c_s of every stream sent before push c_s + 1 of any stream returned.
    After the run the store holds every push (nothing lost)."""
    streams, pushes, keys_per = 3, 40, 64
    group = embstore.TableGroup(
        {
            "t": embstore.Table(
                dim=2,
                capacity=1024,
                optimizer=embstore.SGD(lr=1.0),
                initializer=embstore.Zeros(),
                num_threads=2,
            )
        }
    )
    server = ps.serve(group, threads=6)
    target = f"127.0.0.1:{server.port}"
    times: list[list[tuple[int, int]]] = [[] for _ in range(streams)]
    started = threading.Barrier(streams + 2)

    def push(s: int) -> None:
        keys = np.arange(s * 1000, s * 1000 + keys_per, dtype=np.uint64)
        off = np.arange(keys_per + 1, dtype=np.int64)
        grads = np.full((keys_per, 2), -1.0, np.float32)
        with ps.Client(target, timeout=60) as c:
            c.lookup_sum({"t": (keys, off)})  # rows exist, all zero, before the first push
            started.wait()
            for _ in range(pushes):
                t0 = time.monotonic_ns()
                c.apply_gradients({"t": (keys, off, grads)})
                times[s].append((t0, time.monotonic_ns()))

    def lookups() -> None:
        keys = np.arange(streams * 1000, dtype=np.uint64)[: 3 * keys_per]
        with ps.Client(target, timeout=60) as c:
            started.wait()
            for _ in range(pushes):
                c.lookup_sum({"t": (keys, np.array([0, keys.shape[0]]))}, insert=False)

    threads = [threading.Thread(target=push, args=(s,)) for s in range(streams)]
    threads.append(threading.Thread(target=lookups))
    for th in threads:
        th.start()
    started.wait()
    with ps.Client(target, timeout=60) as c:
        while min(len(t) for t in times) < pushes // 4:
            time.sleep(0.001)
        c.save(tmp_path / "mid")
    for th in threads:
        th.join(timeout=120)
    server.stop()

    live = _rows(group)["t"]
    assert np.all(live["values"] == pushes)  # nothing lost
    saved = _rows(embstore.TableGroup.load(tmp_path / "mid"))["t"]
    counts = []
    for s in range(streams):
        mine = (saved["ids"] >= s * 1000) & (saved["ids"] < s * 1000 + keys_per)
        assert mine.sum() == keys_per
        values = saved["values"][mine]
        assert np.all(values == values[0, 0]), f"stream {s}: a torn push in the checkpoint"
        counts.append(int(values[0, 0]))
    latest_send = max(times[s][c - 1][0] for s, c in enumerate(counts) if c > 0)
    earliest_next_return = (
        min(times[s][c][1] for s, c in enumerate(counts) if c < pushes)
        if any(c < pushes for c in counts)
        else 2**63
    )
    assert latest_send < earliest_next_return, counts


def test_server_and_client_timers_meet_in_one_report(tmp_path: Path) -> None:
    path = tmp_path / "perf.log"
    code = (
        "import time, numpy as np, embstore\n"
        "from embstore import ps\n"
        "g = embstore.TableGroup({'t': embstore.Table(dim=2, capacity=64)})\n"
        "srv = ps.serve(g)\n"
        "c = ps.Client(f'127.0.0.1:{srv.port}')\n"
        "k, off = np.arange(4, dtype=np.uint64), np.array([0, 2, 4])\n"
        "c.lookup_sum({'t': (k, off)})\n"
        "c.apply_gradients({'t': (k, off, np.ones((2, 2), np.float32))})\n"
        "time.sleep(0.5)\n"
        "c.close(); srv.stop()\n"
    )
    env = dict(
        os.environ,
        EMBSTORE_PERF_REPORT_PATH=str(path),
        EMBSTORE_PERF_INTERVAL_MS="200",
        PYTHONPATH=SRC,
    )
    env.pop("EMBSTORE_METRICS", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    seen = set()
    for line in path.read_text().splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split()[1:])
        seen.add((fields["layer"], fields["name"]))
    for layer, name in [
        ("client", "Lookup.Total"),
        ("client", "Lookup.Encode"),
        ("client", "Lookup.RPC"),
        ("client", "Lookup.Decode"),
        ("server", "Lookup.Queue"),
        ("server", "Lookup.Decode"),
        ("server", "Lookup.Handle"),
        ("server", "Lookup.Encode"),
        ("client", "PushGrad.RPC"),
        ("server", "PushGrad.Handle"),
        ("kv", "group.lookup_sum"),
        ("kv", "group.apply_gradients"),
    ]:
        assert (layer, name) in seen, (layer, name)


def test_config_builds_the_group_and_names_bad_keys() -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "ps" / "tables.json"
    config = json.loads(example.read_text())
    for spec in config["tables"].values():
        spec["capacity"] = 64  # the example's size is for the load run
    group = group_from_config(config)
    assert group.names == [f"t{i}" for i in range(8)]
    assert isinstance(group["t0"].optimizer, embstore.Adagrad)
    assert group["t0"].dim == 32
    with pytest.raises(ValueError, match=r"tables\['a'\]: unknown keys \['colour'\]"):
        group_from_config({"tables": {"a": {"dim": 2, "capacity": 8, "colour": 1}}})
    with pytest.raises(ValueError, match=r"optimizer.type must be one of"):
        group_from_config({"tables": {"a": {"dim": 2, "capacity": 8, "optimizer": {"type": "X"}}}})


def test_load_client_smoke(tmp_path: Path) -> None:
    group = embstore.TableGroup(
        {f"t{i}": embstore.Table(dim=8, capacity=20_000, num_threads=1) for i in range(2)}
    )
    server = ps.serve(group)
    out = tmp_path / "load.json"
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "embstore.ps",
                "load",
                "--target",
                f"127.0.0.1:{server.port}",
                "--smoke",
                "--json",
                str(out),
            ],
            env=dict(os.environ, PYTHONPATH=SRC),
            check=True,
            timeout=300,
            stdout=subprocess.DEVNULL,
        )
    finally:
        server.stop()
    results = json.loads(out.read_text())
    assert [r["streams"] for r in results["closed"]] == [1, 2]
    for row in results["closed"]:
        for op in ("Lookup", "PushGrad"):
            assert row["ops"][op]["count"] > 0
            assert row["ops"][op]["errors"] == 0
            assert row["inproc"][op]["count"] > 0
        assert row["empty_rpc"]["count"] > 0
        for op in ("Lookup", "PushGrad"):
            assert row["bytes_rpc"][op]["count"] > 0
            assert row["bytes_rpc"][op]["errors"] == 0
        names = {(h["layer"], h["name"]) for h in row["layers"]}
        assert {
            ("server", "Lookup.Handle"),
            ("client", "Lookup.RPC"),
            ("trainer", "PushGrad.Total"),
            ("kv", "group.lookup_sum"),
        } <= names
    assert results["open"]
    assert results["open"][0]["ops"]["Step"]["count"] > 0
    # The transport floors move the ops' own bytes: 2 tables x 256 bags x D=8 floats down.
    assert results["bytes"]["Lookup"]["down"] >= 2 * 256 * 8 * 4
    assert results["bytes"]["PushGrad"]["up"] > results["bytes"]["Lookup"]["up"]


def test_ping_moves_the_bytes_asked_for(served: tuple[embstore.TableGroup, ps.Client]) -> None:
    _, client = served
    reply = client._calls["Ping"](messages["PingRequest"](payload=b"x" * 1000, reply_bytes=4096))
    assert reply.payload == bytes(4096)
    client.ping(b"y" * 10, reply_bytes=0)
    with pytest.raises(ValueError, match="reply_bytes must be in"):
        client.ping(reply_bytes=-1)


def _cpp_binary() -> str:
    """The C++ server's binary, or skip (call it before building anything to close)."""
    binary = os.environ.get("EMBSTORE_CPP_PS_SERVER")
    if not binary:
        pytest.skip("EMBSTORE_CPP_PS_SERVER is not set (the C++ example server is not built)")
    return binary


@contextlib.contextmanager
def _cpp_serving(*args: str) -> Iterator[str]:
    """The C++ example server (examples/cpp_ps_server) started with ``args``, when
    EMBSTORE_CPP_PS_SERVER names its binary (CI builds it; .ci/run); yields its target."""
    proc = subprocess.Popen(
        [_cpp_binary(), "--port", "0", *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "...: 2 tables on 127.0.0.1:PORT"
        yield line.strip().rsplit(" ", 1)[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


_CPP_TABLES = ("--tables", "user,item", "--dim", "8", "--capacity", "4096")


@pytest.fixture
def cpp_server() -> Iterator[str]:
    with _cpp_serving(*_CPP_TABLES) as target:
        yield target


def _cpp_twin(names: tuple[str, ...] = ("user", "item")) -> embstore.TableGroup:
    """An in-process group built like the C++ server's tables (its defaults, D=8)."""
    return embstore.TableGroup(
        {
            n: embstore.Table(
                dim=8,
                capacity=4096,
                optimizer=embstore.Adagrad(lr=0.01),
                initializer=embstore.Normal(std=0.01, seed=0),
            )
            for n in names
        }
    )


def test_cpp_server_rows_match_direct_calls_bit_for_bit(cpp_server: str) -> None:
    """Pooled rows of lookups and the rows left by pushes, through the C++ server, equal the
    same calls on an in-process TableGroup built like its tables."""
    direct = _cpp_twin()
    rng = np.random.default_rng(11)
    seen: dict[str, list[np.ndarray]] = {"user": [], "item": []}
    with ps.Client(cpp_server, timeout=60) as client:
        assert client.dims == {"user": 8, "item": 8}
        for step in range(10):
            features = {}
            for name in ("user", "item"):
                k, off = _batch(rng, int(rng.integers(1, 40)), 300)
                w = rng.standard_normal(k.shape[0]).astype(np.float32)
                features[name] = (k, off, w) if step % 3 == 0 else (k, off)
                seen[name].append(k)
            mode = "mean" if step % 2 else "sum"
            got = client.lookup_sum(features, mode=mode)
            want = direct.lookup_sum(features, mode=mode)
            for name in features:
                assert np.array_equal(_bits(got[name]), _bits(want[name]))
            grads = {
                n: (
                    f[0],
                    f[1],
                    rng.standard_normal((f[1].shape[0] - 1, 8)).astype(np.float32),
                    *f[2:],
                )
                for n, f in features.items()
            }
            client.apply_gradients(grads, mode=mode)
            direct.apply_gradients(grads, mode=mode)
        rows = {}
        for name, keys in seen.items():
            k = np.unique(np.concatenate(keys))
            rows[name] = (k, np.arange(k.shape[0] + 1, dtype=np.int64))  # one id per bag
        got = client.lookup_sum(rows, insert=False)
        want = direct.lookup_sum(rows, insert=False)
        for name in rows:
            assert np.array_equal(_bits(got[name]), _bits(want[name]))
        for arg in ({"user": (_K, np.array([0, 4, 2]))}, {"nope": (_K, _OFF)}):
            with pytest.raises(Exception) as expected:  # noqa: PT011  (the group decides)
                direct.lookup_sum(arg)
            with pytest.raises(type(expected.value)):
                client.lookup_sum(arg)


def _cpp_steps(
    client: ps.Client, direct: embstore.TableGroup, rng: np.random.Generator, steps: int
) -> None:
    """The same lookups and pushes through the C++ server and on ``direct``; pooled rows
    must agree bit for bit."""
    for step in range(steps):
        features = {n: _batch(rng, int(rng.integers(1, 40)), 300) for n in direct.names}
        mode = "mean" if step % 2 else "sum"
        got = client.lookup_sum(features, mode=mode)
        want = direct.lookup_sum(features, mode=mode)
        for name in features:
            assert np.array_equal(_bits(got[name]), _bits(want[name]))
        grads = {
            n: (k, off, rng.standard_normal((off.shape[0] - 1, 8)).astype(np.float32))
            for n, (k, off) in features.items()
        }
        client.apply_gradients(grads, mode=mode)
        direct.apply_gradients(grads, mode=mode)


def _assert_file_holds(path: Path, want: dict[str, np.ndarray]) -> None:
    """embstore.checkpoint.read reads ``path`` and finds ``want``'s rows, bit for bit."""
    got = embstore.checkpoint.read(path)
    order = np.argsort(got["ids"], kind="stable")
    assert np.array_equal(got["ids"][order], want["ids"])
    for key in want.keys() & got.keys() - {"ids"}:
        assert np.array_equal(got[key][order].view(np.uint8), want[key].view(np.uint8)), key


def test_cpp_server_save_and_delta_hold_the_rows_it_served(tmp_path: Path) -> None:
    """Save through the C++ server writes a group checkpoint TableGroup.load reads, equal bit
    for bit to an in-process group fed the same batches; save_delta writes the Python
    server's delta layout (tNNN.delta + DELTAS.json) that Table.load chains onto it; every
    file reads with embstore.checkpoint.read; paths are confined to --checkpoint-dir."""
    _cpp_binary()
    root = tmp_path / "ckpt"
    direct = _cpp_twin()
    rng = np.random.default_rng(5)
    with _cpp_serving(*_CPP_TABLES, "--checkpoint-dir", str(root)) as target:
        client = ps.Client(target, timeout=60)
        _cpp_steps(client, direct, rng, 6)
        with pytest.raises(Exception) as expected:  # noqa: PT011  (the store decides)
            direct["user"].save_delta(tmp_path / "no-base.delta")
        with pytest.raises(type(expected.value)):
            client.save_delta("d0")  # no full save yet
        client.save("full")
        at_full = _rows(direct)
        _assert_same_rows(_rows(embstore.TableGroup.load(root / "full")), at_full)
        _cpp_steps(client, direct, rng, 5)
        client.save_delta("d1")
        for bad in ("../escape", str(tmp_path / "elsewhere"), "full/../../x"):
            with pytest.raises(ValueError, match="outside the server's checkpoint"):
                client.save(bad)
        client.close()
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path / "elsewhere").exists()
    manifest = json.loads((root / "full" / "MANIFEST.json").read_text())["body"]
    deltas = json.loads((root / "d1" / "DELTAS.json").read_text())
    assert deltas["format"] == "embstore.ps.deltas"
    assert deltas["order"] == ["user", "item"]
    assert deltas["files"] == {"user": "t000.delta", "item": "t001.delta"}
    want = _rows(direct)
    for name in direct.names:
        base = root / "full" / manifest["tables"][name]["file"]
        delta = root / "d1" / deltas["files"][name]
        _assert_file_holds(base, at_full[name])
        assert embstore.checkpoint.read(delta)["removed"].shape == (0,)
        loaded = embstore.Table.load(base, deltas=[delta])
        _assert_same_rows({name: sorted_export(loaded)}, {name: want[name]})
        loaded.close()
    _close(direct)
    # A server started on a directory holding a group checkpoint serves its rows.
    with _cpp_serving(*_CPP_TABLES, "--checkpoint-dir", str(root / "full")) as target:
        restarted = ps.Client(target, timeout=60)
        for name, rows in at_full.items():
            one = (rows["ids"], np.arange(rows["ids"].shape[0] + 1, dtype=np.int64))
            got = restarted.lookup_sum({name: one}, insert=False)[name]
            assert np.array_equal(_bits(got), _bits(rows["values"])), name
        restarted.close()


def test_cpp_server_ping_moves_the_bytes_asked_for(cpp_server: str) -> None:
    with ps.Client(cpp_server, timeout=60) as client:
        reply = client._calls["Ping"](
            messages["PingRequest"](payload=b"x" * 1000, reply_bytes=4096)
        )
        assert reply.payload == bytes(4096)
        with pytest.raises(ps.PSError, match="reply_bytes must be in"):
            client.ping(reply_bytes=-1)


def test_cpp_server_save_without_checkpoint_dir(cpp_server: str, tmp_path: Path) -> None:
    """Without --checkpoint-dir a Save names its directory (any path); an empty one is a
    ValueError, and a file in the way an OSError, with the store unchanged."""
    (tmp_path / "file").write_text("x")
    with ps.Client(cpp_server, timeout=60) as client:
        client.lookup_sum({"user": (_K, _OFF)})
        with pytest.raises(ValueError, match="--checkpoint-dir"):
            client.save("")
        with pytest.raises(OSError, match=r"(?i)not a directory"):
            client.save(tmp_path / "file" / "sub")
        client.save(tmp_path / "plain")
        before = client.lookup_sum({"user": (_K, _OFF)}, insert=False)["user"]
    saved = embstore.TableGroup.load(tmp_path / "plain")
    assert sorted(saved.names) == ["item", "user"]
    assert np.array_equal(_bits(saved.lookup_sum({"user": (_K, _OFF)})["user"]), _bits(before))
    _close(saved)


def test_cpp_server_save_under_concurrent_pushes_is_one_instant(tmp_path: Path) -> None:
    """S streams push a fixed gradient to their own key set while lookups run and a Save
    lands in the middle. Each stream's rows in the file equal an in-process replica's after
    some count c_s of that stream's pushes (no torn push), the counts are one instant (push
    c_s of every stream sent before push c_s + 1 of any returned), and the live rows at the
    end hold every push."""
    _cpp_binary()
    streams, pushes, keys_per = 3, 30, 48
    keys = [np.arange(s * 1000, s * 1000 + keys_per, dtype=np.uint64) for s in range(streams)]
    off = np.arange(keys_per + 1, dtype=np.int64)  # one id per bag: pooled row == the row
    grads = [np.full((keys_per, 8), 0.1 * (s + 1), np.float32) for s in range(streams)]
    replica = _cpp_twin(("t",))
    after: list[list[np.ndarray]] = []  # after[s][c]: stream s's rows after c pushes
    for s in range(streams):
        after.append([replica.lookup_sum({"t": (keys[s], off)})["t"]])
        for _ in range(pushes):
            replica.apply_gradients({"t": (keys[s], off, grads[s])})
            after[s].append(replica.lookup_sum({"t": (keys[s], off)}, insert=False)["t"])
    _close(replica)
    times: list[list[tuple[int, int]]] = [[] for _ in range(streams)]
    started = threading.Barrier(streams + 2)
    args = ("--tables", "t", "--dim", "8", "--capacity", "4096", "--pollers", "6")
    with _cpp_serving(*args) as target:

        def push(s: int) -> None:
            with ps.Client(target, timeout=60) as c:
                c.lookup_sum({"t": (keys[s], off)})  # rows exist before the first push
                started.wait()
                for _ in range(pushes):
                    t0 = time.monotonic_ns()
                    c.apply_gradients({"t": (keys[s], off, grads[s])})
                    times[s].append((t0, time.monotonic_ns()))

        def lookups() -> None:
            every = np.concatenate(keys)
            with ps.Client(target, timeout=60) as c:
                started.wait()
                for _ in range(pushes):
                    c.lookup_sum({"t": (every, np.array([0, every.shape[0]]))}, insert=False)

        threads = [threading.Thread(target=push, args=(s,)) for s in range(streams)]
        threads.append(threading.Thread(target=lookups))
        for th in threads:
            th.start()
        started.wait()
        with ps.Client(target, timeout=60) as c:
            deadline = time.monotonic() + 60
            while min(len(t) for t in times) < pushes // 4 and time.monotonic() < deadline:
                time.sleep(0.001)
            c.save(tmp_path / "mid")
            for th in threads:
                th.join(timeout=120)
            for s in range(streams):  # nothing lost
                live = c.lookup_sum({"t": (keys[s], off)}, insert=False)["t"]
                assert np.array_equal(_bits(live), _bits(after[s][pushes])), s
    saved = _rows(embstore.TableGroup.load(tmp_path / "mid"))["t"]
    counts = []
    for s in range(streams):
        mine = (saved["ids"] >= s * 1000) & (saved["ids"] < s * 1000 + keys_per)
        rows = _bits(saved["values"][mine])  # ids ascending, like keys[s]
        match = [c for c in range(pushes + 1) if np.array_equal(rows, _bits(after[s][c]))]
        assert match, f"stream {s}: the checkpoint holds no count of pushes (a torn push)"
        counts.append(match[0])
    latest_send = max(times[s][c - 1][0] for s, c in enumerate(counts) if c > 0)
    earliest_next_return = min(
        (times[s][c][1] for s, c in enumerate(counts) if c < pushes), default=2**63
    )
    assert latest_send < earliest_next_return, counts


@pytest.fixture(scope="module")
def twin() -> Iterator[tuple[ps.Client, embstore.TableGroup]]:
    """A served group and an identical in-process one, fed the same calls."""
    served, direct = _group(seed=5), _group(seed=5)
    with _serving(served) as client:
        yield client, direct
    _close(served)
    _close(direct)


_ids = st.sampled_from([0, 1, 2, 3, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    insert=st.booleans(),
)
def test_any_batch_through_the_server_equals_the_direct_call(
    twin: tuple[ps.Client, embstore.TableGroup],
    data: st.DataObject,
    mode: str,
    weighted: bool,
    insert: bool,
) -> None:
    client, direct = twin
    features: dict[str, tuple[Any, ...]] = {}
    for name in data.draw(st.permutations(list(DIMS))):
        lengths = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=6))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        keys = np.array(
            data.draw(st.lists(_ids, min_size=int(offsets[-1]), max_size=int(offsets[-1]))),
            dtype=np.uint64,
        )
        if weighted:
            w = data.draw(
                st.lists(
                    st.floats(-1e6, 1e6, width=32),
                    min_size=keys.shape[0],
                    max_size=keys.shape[0],
                )
            )
            features[name] = (keys, offsets, np.array(w, dtype=np.float32))
        else:
            features[name] = (keys, offsets)
    got = client.lookup_sum(features, mode=mode, insert=insert)
    want = direct.lookup_sum(features, mode=mode, insert=insert)
    assert list(got) == list(want)
    for name in want:
        assert np.array_equal(_bits(got[name]), _bits(want[name]))
    if not weighted:
        grads = {
            n: (f[0], f[1], np.full((f[1].shape[0] - 1, DIMS[n]), 0.5, np.float32))
            for n, f in features.items()
        }
        client.apply_gradients(grads, mode=mode)
        direct.apply_gradients(grads, mode=mode)
