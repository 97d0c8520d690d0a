"""The DDP recipe (examples/ddp_shared_store.py, docs/torch.md): two processes train the
dense part under DistributedDataParallel (gloo, loopback) and share ONE embstore PS served
from this process. Checked: the dense parameters end identical on both ranks (and moved),
and every row update of both processes reached the store exactly once:

- a row only one rank touched equals, bit for bit (values and optimizer state), a replay
  of that rank's recorded pushes in its order on a fresh group;
- a shared row of the Adam table counts, in its per-row step, exactly the pushes of both
  ranks that held it (Adam steps a row once per call);
- a shared row of the SGD table is, within float32 rounding of the sum, the initial row
  minus lr times every recorded gradient of both ranks (SGD updates commute up to the
  order of the float additions, which depends on how the two ranks interleaved);
- the store holds exactly the ids the pushes named.

Then one push applied a second time must make the check fail. Also, in one process: a
module over an ``embstore.ps.Client`` trains the server's rows as a module over an equal
in-process group does, and its configs are checked against the server's tables.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch absent (pip install 'embstore[torch]')")
pytest.importorskip("grpc", reason="grpcio absent (pip install 'embstore[ps]')")
pytest.importorskip("grpc_tools", reason="grpcio-tools absent (pip install 'embstore[ps]')")

import torch
import torch.distributed as dist
from reference import per_id_grads

import embstore
from embstore import ps
from embstore.torch import EmbeddingBagCollection, EmbeddingBagConfig

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 10
WORLD = 2
F32_EPS = 2.0**-24  # unit roundoff of float32


def _pushes(run: dict[str, Any], table: str) -> list[tuple[str, tuple[np.ndarray, ...]]]:
    return [(mode, entries[table]) for mode, entries in run["pushes"] if table in entries]


def _touched(runs: list[dict[str, Any]], table: str) -> dict[int, list[int]]:
    """id -> how many pushes of each rank held it."""
    seen: dict[int, list[int]] = {}
    for rank, run in enumerate(runs):
        for _, entry in _pushes(run, table):
            for key in np.unique(entry[0]).tolist():
                seen.setdefault(key, [0] * len(runs))[rank] += 1
    return seen


def _rows(table: embstore.Table) -> dict[int, dict[str, np.ndarray]]:
    data = table.export()
    names = ["values", *table.state_names()]
    return {int(k): {n: data[n][i] for n in names} for i, k in enumerate(data["ids"])}


def _replay(recipe: Any, pushes: list[tuple[str, dict[str, Any]]]) -> embstore.TableGroup:
    group = recipe.tables()
    for mode, entries in pushes:
        group.apply_gradients(entries, mode=mode)
    return group


def _sgd_mismatches(
    name: str, table: embstore.Table, runs: list[dict[str, Any]], ids: list[int], row: Any
) -> list[str]:
    """Shared SGD rows against init - lr * (every recorded gradient), summed in float64,
    allowing float32 rounding of each addition and product."""
    lr = float(table.optimizer.lr)
    total = {k: np.zeros(table.dim) for k in ids}
    size = {k: np.zeros(table.dim) for k in ids}
    terms = dict.fromkeys(ids, 0)
    wanted = set(ids)
    for run in runs:
        for mode, (keys, offsets, grads, *w) in _pushes(run, name):
            g = per_id_grads(len(keys), grads, offsets, w[0] if w else None, mode)
            for key, gi in zip(keys.tolist(), g.astype(np.float64), strict=True):
                if key in wanted:
                    total[key] += gi
                    size[key] += np.abs(gi)
                    terms[key] += 1
    init = table.initial_values(np.array(ids, np.uint64)).astype(np.float64)
    out = []
    for k, key in enumerate(ids):
        want = init[k] - lr * total[key]
        bound = 4 * (terms[key] + 2) * F32_EPS * (np.abs(init[k]) + lr * size[key])
        got = row(key)["values"].astype(np.float64)
        if np.any(np.abs(got - want) > bound):
            out.append(f"{name}[{key}]: {got} != {want} (+- {bound})")
    return out


def mismatches(recipe: Any, group: embstore.TableGroup, runs: list[dict[str, Any]]) -> list[str]:
    """Every way the store differs from 'each recorded push applied exactly once'."""
    out: list[str] = []
    own = [_replay(recipe, run["pushes"]) for run in runs]
    for name in group.names:
        table, touched = group[name], _touched(runs, name)
        rows = _rows(table)
        if set(rows) != set(touched):
            out.append(f"{name}: ids {sorted(set(rows) ^ set(touched))[:5]} ...")
            continue
        shared = sorted(k for k, n in touched.items() if all(n))
        for key, counts in touched.items():
            if key in shared:
                continue
            replayed = _rows(own[next(r for r, n in enumerate(counts) if n)][name])[key]
            for state, value in replayed.items():
                if not np.array_equal(rows[key][state], value):
                    out.append(f"{name}[{key}].{state} differs from its rank's replay")
        if "step" in table.state_names():  # Adam: one step per call that held the row
            for key in shared:
                step = int(rows[key]["step"])
                if step != sum(touched[key]):
                    out.append(f"{name}[{key}]: {step} Adam steps, {touched[key]} pushes")
        else:
            assert isinstance(table.optimizer, embstore.SGD)
            out += _sgd_mismatches(name, table, runs, shared, rows.__getitem__)
    return out


def test_two_ddp_processes_share_one_ps_and_each_update_arrives_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets on loopback only
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the spawned workers import it by name
    recipe = importlib.import_module("ddp_shared_store")
    group = recipe.tables()
    with ps.serve(group, port=0, host="127.0.0.1") as server:
        recipe.launch(
            f"127.0.0.1:{server.port}",
            world_size=WORLD,
            steps=STEPS,
            record=str(tmp_path),
            timeout=90,
        )
    runs = []
    for rank in range(WORLD):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            runs.append(pickle.load(f))  # written by our own workers
        assert len(runs[rank]["pushes"]) == STEPS  # one push per step, both tables in it

    # DDP: both ranks end with the same dense parameters, though they started apart
    dense = [run["dense"] for run in runs]
    assert dense[0].keys() == dense[1].keys()
    for key in dense[0]:
        assert torch.equal(dense[0][key], dense[1][key]), key
    torch.manual_seed(0)
    start = recipe.Model(group)
    assert any(not torch.equal(p, dense[0][k]) for k, p in start.named_parameters())

    # the ranks did share rows, and had rows of their own
    for name in group.names:
        counts = list(_touched(runs, name).values())
        assert sum(all(n) for n in counts) >= 5
        assert sum(not all(n) for n in counts) >= 5
    assert mismatches(recipe, group, runs) == []

    # the check catches an update that arrived twice
    mode, entries = runs[1]["pushes"][STEPS // 2]
    group.apply_gradients(entries, mode=mode)
    found = mismatches(recipe, group, runs)
    assert any(m.startswith("items[") for m in found)
    assert any(m.startswith("users[") for m in found)


def test_a_module_over_a_ps_client_trains_the_servers_rows_as_in_process() -> None:
    def cfg(dim: int = 4, name: str = "t") -> list[EmbeddingBagConfig]:
        opt = embstore.Adagrad(lr=0.1)
        return [EmbeddingBagConfig(name, dim, 100, ["f", "g"], pooling="mean", optimizer=opt)]

    served, local = (embstore.TableGroup({"t": cfg()[0].build_table()}) for _ in range(2))
    twin = EmbeddingBagCollection.from_configs(cfg(), backend=local)
    rng = np.random.default_rng(0)
    server = ps.serve(served, port=0, host="127.0.0.1")
    with server, ps.Client(f"127.0.0.1:{server.port}", timeout=30) as client:
        remote = EmbeddingBagCollection.from_configs(cfg(), backend=client)
        for _ in range(3):
            feats = {
                "f": (torch.from_numpy(rng.integers(0, 20, 6)), torch.tensor([0, 2, 6])),
                "g": {"values": torch.tensor([3, 4]), "lengths": torch.tensor([1, 0, 1])},
            }
            seed = torch.randn(4)
            losses = []
            for module in (remote, twin):
                out = module(feats)
                out["f"].mul_(2.0)  # the outputs are writable, as over a TableGroup
                losses.append((out["f"] @ seed).sum() + out["g"].pow(2).sum())
                losses[-1].backward()
            assert torch.equal(losses[0], losses[1])
        with torch.no_grad():  # read-only on the server too
            remote({"f": (torch.tensor([77]), torch.tensor([0, 1]))})
        with pytest.raises(ValueError, match="'t' has dim 4, its config says embedding_dim=8"):
            EmbeddingBagCollection.from_configs(cfg(dim=8), backend=client)
        with pytest.raises(KeyError, match="no table 'u'"):
            EmbeddingBagCollection.from_configs(cfg(name="u"), backend=client)
    got, want = served["t"].export(), local["t"].export()
    assert 77 not in got["ids"].tolist()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
