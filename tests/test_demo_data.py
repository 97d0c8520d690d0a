"""The demo's building blocks: readers, data set and batches, metrics, synthetic data, FM."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.demo import readers
from embstore.demo.data import CTRData, DataError
from embstore.demo.defaults import default_factor_scale, default_lr
from embstore.demo.evaluation import StreamingMetrics, auc, logloss
from embstore.demo.fm import FactorizationMachine
from embstore.demo.synthetic import synthetic

# -- Criteo -------------------------------------------------------------------------------


def criteo_line(
    label: str = "1", ints: list[str] | None = None, cats: list[str] | None = None
) -> str:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *ints, *cats])


def write(tmp_path: Path, name: str, lines: list[str]) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_criteo_bucket() -> None:
    assert [readers.criteo_bucket(x) for x in (-2, 0, 1, 2)] == [-2, 0, 1, 2]
    assert readers.criteo_bucket(3) == readers.criteo_bucket(4) != readers.criteo_bucket(1)
    assert readers.criteo_bucket(100) - readers.criteo_bucket(3) == 21 - 1  # floor(ln(x)^2)
    assert readers.criteo_bucket(1000) == readers.criteo_bucket(1001)


def test_read_criteo(tmp_path: Path) -> None:
    ints_missing = [""] * 13
    cats_missing = [""] * 26
    same = ["7"] * 13
    path = write(
        tmp_path,
        "c.txt",
        [
            criteo_line("1"),
            criteo_line("0", ints=ints_missing, cats=cats_missing),
            "",  # blank lines are skipped
            criteo_line("0", ints=ints_missing, cats=cats_missing),
            criteo_line("1", ints=same, cats=["0000000a"] * 26),
        ],
    )
    data = readers.read(path)  # auto-detects the format
    assert len(data) == 4
    assert data.num_fields == 39
    assert data.fields[:2] == ("I1", "I2")
    assert data.fields[-1] == "C26"
    np.testing.assert_array_equal(data.labels, [1, 0, 0, 1])
    assert data.ids.dtype == np.uint64
    assert data.values is None
    assert data.present is None
    np.testing.assert_array_equal(data.ids[:, 1], data.ids[:, 2])  # missing: one id per field
    assert len(set(data.ids[:, 1].tolist())) == 39  # ... which differs between fields
    assert len(set(data.ids[:13, 3].tolist())) == 13  # equal values, different fields
    assert data.ids[0, 1] != data.ids[0, 0]  # missing is not value 0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("1\t2\t3", "40 tab-separated fields"),
        (criteo_line("2"), "label must be 0 or 1"),
        (criteo_line("1", ints=["x1"] + [""] * 12), "I1 must be an integer"),
        (criteo_line("1", cats=["zz"] + [""] * 25), "C1 must be a hex hash"),
        (criteo_line("1", cats=[""] * 25 + ["0x12"]), "C26 must be a hex hash"),
        (criteo_line("1", cats=["1" * 16] + [""] * 25), "C1 must be a hex hash"),
    ],
)
def test_read_criteo_rejects_malformed_lines(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, "bad.txt", [criteo_line(), line])
    with pytest.raises(DataError, match=rf"bad\.txt:2: .*{message}"):
        readers.read_criteo(path)


# -- libFM --------------------------------------------------------------------------------


def test_read_libfm(tmp_path: Path) -> None:
    path = write(tmp_path, "f.libfm", ["1 3:1 10:1", "-1 4:1 11:1", "0 3:1 12:1"])
    data = readers.read(path)
    assert data.fields == ("f0", "f1")
    np.testing.assert_array_equal(data.labels, [1, 0, 0])
    np.testing.assert_array_equal(data.ids, [[3, 4, 3], [10, 11, 12]])
    assert data.values is None
    assert data.present is None


def test_read_libfm_values_and_ragged_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "f.libfm", ["1 3:0.5 10:2", "0 4:1", "1 5:1 6:1 7:-1"])
    data = readers.read_libfm(path)
    assert data.num_fields == 3
    assert data.present is not None
    assert data.values is not None
    np.testing.assert_array_equal(data.present, [[1, 1, 1], [1, 0, 1], [0, 0, 1]])
    np.testing.assert_array_equal(data.values[:, 0], [0.5, 2, 1])
    batch = data.batch(0, 3)
    keys, offsets, weights = batch.features["f1"]  # type: ignore[misc]
    np.testing.assert_array_equal(keys, [10, 6])
    np.testing.assert_array_equal(offsets, [0, 1, 1, 2])  # example 1 has an empty bag
    np.testing.assert_array_equal(weights, [2, 1])
    # a held-out file must fit the training fields
    test = write(tmp_path, "t.libfm", ["1 3:1"])
    held_out = readers.read(test, like=data)
    assert held_out.fields == data.fields
    with pytest.raises(DataError, match="more than the 1 fields"):
        readers.read_libfm(path, num_fields=1)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("yes 1:1", "the label must be a number"),
        ("1 5", "a libFM feature is id:value"),
        ("1 a:1", "a libFM feature is id:value"),
        ("1 3:x", "a libFM feature is id:value"),
        ("1 3:inf", "a libFM feature is id:value"),
        ("1 -3:1", "a libFM feature is id:value"),
    ],
)
def test_read_libfm_rejects_malformed_lines(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, "bad.libfm", ["1 1:1", "", line])  # line 3: blank lines count
    with pytest.raises(DataError, match=rf"bad\.libfm:3: {message}"):
        readers.read_libfm(path)


def test_unreadable_files(tmp_path: Path) -> None:
    empty = write(tmp_path, "empty.txt", [""])
    with pytest.raises(DataError, match="no examples"):
        readers.read(empty)
    with pytest.raises(DataError, match="no examples"):
        readers.read_libfm(empty)
    other = write(tmp_path, "other.csv", ["1,2,3"])
    with pytest.raises(DataError, match="neither a Criteo TSV"):
        readers.read(other)
    with pytest.raises(ValueError, match="unknown data format"):
        readers.read(other, "csv")
    libfm = write(tmp_path, "a.libfm", ["1 1:1"])
    crit = write(tmp_path, "c.txt", [criteo_line()])
    with pytest.raises(DataError, match="differ from the training data"):
        readers.read(crit, like=readers.read(libfm))


# -- data set -----------------------------------------------------------------------------


def test_batches_and_split() -> None:
    ids = np.arange(20, dtype=np.uint64).reshape(2, 10)
    data = CTRData(labels=np.arange(10, dtype=np.float32) % 2, ids=ids, fields=("a", "b"))
    batches = list(data.batches(4))
    assert [len(b) for b in batches] == [4, 4, 2] == [len(b.labels) for b in batches]
    keys, offsets = batches[2].features["b"]  # type: ignore[misc]
    np.testing.assert_array_equal(keys, [18, 19])
    np.testing.assert_array_equal(offsets, [0, 1, 2])
    assert np.shares_memory(keys, ids)  # no copy of the ids
    train, test = data.split(0.2)
    assert (len(train), len(test)) == (8, 2)
    np.testing.assert_array_equal(test.ids[0], [8, 9])  # the end is held out
    assert data.distinct_ids() == [10, 10]
    with pytest.raises(DataError, match="too few"):
        data.take(0, 1).split(0.2)
    with pytest.raises(ValueError, match="shape"):
        CTRData(labels=np.zeros(3, np.float32), ids=ids, fields=("a", "b"))


# -- metrics ------------------------------------------------------------------------------


def brute_force_auc(y: np.ndarray, s: np.ndarray) -> float:
    pos, neg = s[y == 1], s[y == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


def test_auc_and_logloss(rng: np.random.Generator) -> None:
    y = rng.integers(0, 2, 300).astype(np.float32)
    s = np.round(rng.random(300) + 0.3 * y, 1)  # many ties
    assert auc(y, s) == pytest.approx(brute_force_auc(y, s), abs=1e-12)
    assert auc([1, 0], [0.9, 0.1]) == 1.0
    assert auc([1, 0], [0.1, 0.9]) == 0.0
    assert math.isnan(auc([1, 1], [0.3, 0.4]))
    p = rng.random(300)
    expected = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert logloss(y, p) == pytest.approx(expected, rel=1e-9)
    assert math.isfinite(logloss([1, 0], [0.0, 1.0]))  # clipped
    window = StreamingMetrics()
    window.update(y[:100], s[:100].astype(np.float32))
    window.update(y[100:], s[100:].astype(np.float32))
    assert window.count == 300
    assert window.result()[0] == pytest.approx(auc(y, s.astype(np.float32)))
    window.reset()
    assert all(math.isnan(x) for x in window.result())


# -- synthetic data -----------------------------------------------------------------------


def test_synthetic_is_deterministic_and_learnable() -> None:
    a, b = synthetic(20_000, 5, seed=3), synthetic(20_000, 5, seed=3)
    np.testing.assert_array_equal(a.data.ids, b.data.ids)
    np.testing.assert_array_equal(a.data.labels, b.data.labels)
    assert a.data.ids.shape == (5, 20_000)
    assert a.data.fields[0] == "field0"
    assert not np.array_equal(synthetic(20_000, 5, seed=4).data.labels, a.data.labels)
    assert 0.15 < a.data.labels.mean() < 0.4
    assert auc(a.data.labels, a.logits) > 0.8  # the hidden model separates the classes
    counts = np.unique(a.data.ids[0], return_counts=True)[1]
    assert counts.max() > 20 * np.median(counts)  # Zipf: a hot head and a long tail


# -- factorization machine ----------------------------------------------------------------


@pytest.mark.parametrize("factor_scale", [1.0, 0.3])
def test_fm_gradient_matches_finite_differences(
    rng: np.random.Generator, factor_scale: float
) -> None:
    """SGD(lr=1) tables and one distinct id per bag: a step moves each row by -dL/drow."""
    fields, dim, batch_size = ("a", "b", "c"), 3, 5
    group = embstore.TableGroup(
        {
            name: embstore.Table(
                dim=dim + 1,
                capacity=100,
                optimizer=embstore.SGD(lr=1.0),
                initializer=embstore.Uniform(-0.5, 0.5, seed=k),
            )
            for k, name in enumerate(fields)
        }
    )
    ids = (np.arange(15, dtype=np.uint64) + 100).reshape(3, 5)
    values = rng.uniform(0.5, 2.0, size=(3, 5)).astype(np.float32)
    labels = np.array([1, 0, 1, 1, 0], dtype=np.float32)
    data = CTRData(labels=labels, ids=ids, fields=fields, values=values)
    batch = data.batch(0, batch_size)
    model = FactorizationMachine(group, lr=0.1, l2=0.0, bias=0.2, factor_scale=factor_scale)
    rows0 = np.stack([group[f].initial_values(ids[k]) for k, f in enumerate(fields)])

    def loss(rows: np.ndarray) -> float:  # float64 reference
        p = rows.astype(np.float64) * values[:, :, None]
        e = factor_scale * p[:, :, 1:]
        s = e.sum(0)
        logit = 0.2 + p[:, :, 0].sum(0) + 0.5 * ((s * s).sum(1) - (e * e).sum((0, 2)))
        prob = 1 / (1 + np.exp(-logit))
        return float(-np.mean(labels * np.log(prob) + (1 - labels) * np.log(1 - prob)))

    numeric = np.zeros_like(rows0, dtype=np.float64)
    h = 1e-5
    for index in np.ndindex(*rows0.shape):
        up, down = rows0.astype(np.float64), rows0.astype(np.float64)
        up[index] += h
        down[index] -= h
        numeric[index] = (loss(up) - loss(down)) / (2 * h)
    probabilities = model.train_step(batch)
    assert probabilities.shape == (5,)
    assert ((probabilities > 0) & (probabilities < 1)).all()
    after = np.stack([group[f].lookup(ids[k], insert=False) for k, f in enumerate(fields)])
    np.testing.assert_allclose(rows0 - after, numeric, rtol=1e-3, atol=1e-6)
    # predict is read-only
    sizes = [len(t) for t in group.values()]
    new = CTRData(labels=labels, ids=ids + 1000, fields=fields).batch(0, 5)
    model.predict(new)
    assert [len(t) for t in group.values()] == sizes


# -- defaults -----------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [1, 2, 8, 10])
def test_defaults_up_to_ten_fields_are_the_fixed_ones(fields: int) -> None:
    assert default_lr(fields) == 0.1
    assert default_factor_scale(fields) == 1.0


def test_defaults_shrink_with_more_fields() -> None:
    assert default_lr(39) == pytest.approx(0.1 * 10 / 39)
    assert default_factor_scale(39) == pytest.approx(45 / 741)  # pairs of 10 and 39 fields
    lrs = [default_lr(f) for f in range(10, 100)]
    scales = [default_factor_scale(f) for f in range(10, 100)]
    assert all(a > b for a, b in itertools.pairwise(lrs))
    assert all(x > 0 for x in lrs)
    assert all(a > b for a, b in itertools.pairwise(scales))
    assert all(x > 0 for x in scales)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="fields must be positive"):
            default_lr(bad)
        with pytest.raises(ValueError, match="fields must be positive"):
            default_factor_scale(bad)


@pytest.mark.parametrize("factor_scale", [1.0, 0.25])
def test_deepfm_without_its_mlp_is_the_fm(factor_scale: float) -> None:
    """With the MLP's output layer zeroed, DeepFM's probabilities are the FM's on the same
    rows: the factor scale enters both models the same way."""
    torch = pytest.importorskip("torch", reason="DeepFM needs torch")
    from embstore.demo.dnn import DeepFM

    data = synthetic(300, 4, seed=5).data
    groups = [
        embstore.TableGroup(
            {
                name: embstore.Table(
                    dim=5, capacity=4096, initializer=embstore.Normal(std=0.3, seed=k)
                )
                for k, name in enumerate(data.fields)
            }
        )
        for _ in range(2)
    ]
    fm = FactorizationMachine(groups[0], lr=0.1, bias=-0.4, factor_scale=factor_scale)
    dnn = DeepFM(groups[1], bias=-0.4, factor_scale=factor_scale, torch_threads=None)
    with torch.no_grad():
        dnn.net.mlp[-1].weight.zero_()
        dnn.net.mlp[-1].bias.zero_()
    batch = data.batch(0, 300)
    for group in groups:
        group.lookup_sum(batch.features)  # insert the rows (same seeds: same rows)
    expected = fm.predict(batch)
    assert expected.std() > 0.01  # the pairwise term is not negligible at std 0.3
    np.testing.assert_allclose(dnn.predict(batch), expected, rtol=1e-5, atol=1e-6)
