"""The AVX2 kernels and the baseline kernels give the same bits.

The forward read kernel and the fused apply are compiled twice (csrc/embstore/simd.hpp) and
picked at run time from the CPU. The rest of the suite checks whichever level this machine
runs against the numpy reference; this file runs the same random training sequences at both
levels and requires identical outputs, rows and optimizer state.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import Config, kernels_at, random_offsets, u64
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import (
    AdagradSpec,
    AdamSpec,
    FTRLSpec,
    NormalSpec,
    OptSpec,
    RowWiseAdagradSpec,
    SGDSpec,
)

from embstore import _core

LEVELS = ["baseline", "avx2"]
HAS_AVX2 = _core.simd_level() == "avx2"  # the level chosen at import: the CPU's best
OPTIMIZERS: list[OptSpec] = [
    SGDSpec(lr=0.1),
    SGDSpec(lr=0.1, momentum=0.9),
    AdagradSpec(lr=0.05),
    RowWiseAdagradSpec(lr=0.05),
    AdamSpec(lr=0.01, weight_decay=0.01),
    FTRLSpec(alpha=0.1, l1=0.01, l2=0.01),
]


def _run(level: str, cfg: Config, seed: int, steps: int) -> list[np.ndarray]:
    """A training sequence (pooled lookups with weights or mean, applies, plain lookups) at
    ``level``: every output, then the final rows and state of every id."""
    with kernels_at(level):
        return _train(cfg, seed, steps)


def _train(cfg: Config, seed: int, steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = cfg.table()
    universe = u64(rng.choice(1 << 40, size=64, replace=False))
    outs: list[np.ndarray] = []
    for step in range(steps):
        n, bags = int(rng.integers(1, 200)), int(rng.integers(1, 40))
        keys = universe[rng.integers(0, universe.shape[0], n)]  # duplicates on purpose
        offsets = random_offsets(rng, n, bags)  # empty bags included
        weights = rng.normal(size=n).astype(np.float32) if step % 3 == 1 else None
        mode = "mean" if step % 3 == 2 else "sum"
        outs.append(t.lookup_sum(keys, offsets, weights=weights, mode=mode))
        grads = rng.normal(scale=0.5, size=(bags, cfg.dim)).astype(np.float32)
        t.apply_gradients(keys, grads, offsets=offsets, weights=weights, mode=mode)
        outs.append(t.lookup(keys[: n // 2], insert=False))
    exported = t.export()
    order = np.argsort(exported["ids"])
    outs.extend(np.asarray(v)[order] for v in exported.values())
    return outs


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU (or EMBSTORE_SIMD) runs the baseline only")
@settings(max_examples=30)
@given(
    dim=st.sampled_from([1, 5, 16, 24, 32, 64, 128]),
    optimizer=st.sampled_from(OPTIMIZERS),
    shards=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**32 - 1),
)
def test_levels_agree_bit_for_bit(dim: int, optimizer: OptSpec, shards: int, seed: int) -> None:
    cfg = Config(
        dim=dim, optimizer=optimizer, initializer=NormalSpec(std=0.1, seed=3), num_shards=shards
    )
    base, avx2 = (_run(level, cfg, seed, steps=6) for level in LEVELS)
    assert len(base) == len(avx2)
    for a, b in zip(base, avx2, strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert a.tobytes() == b.tobytes()  # bits: -0.0 and NaN payloads included


def test_set_simd_level_checks_its_argument() -> None:
    with pytest.raises(ValueError, match="baseline"):
        _core.set_simd_level("sse9")
    with kernels_at("baseline"):
        assert _core.simd_level() == "baseline"


def test_environment_variable_forces_the_baseline() -> None:
    """EMBSTORE_SIMD=baseline, read at first use, keeps a process on the baseline kernels."""
    code = "from embstore import _core; print(_core.simd_level())"
    env = {**os.environ, "EMBSTORE_SIMD": "baseline"}
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "baseline"


@pytest.mark.parametrize("level", LEVELS)
def test_gradient_finite_check_at_every_position(level: str) -> None:
    """The vectorised finite check (max-reduced exponent bits, 8 floats a step with AVX2)
    rejects Inf, -Inf and NaN at every position, the tail past the last full vector
    included, and passes the largest finite values, subnormals and -0.0; a rejected call
    leaves the table as it was."""
    if level == "avx2" and not HAS_AVX2:
        pytest.skip("this CPU (or EMBSTORE_SIMD) runs the baseline only")
    dim, n = 3, 7  # 21 floats: two AVX2 vectors and a tail of 5
    with kernels_at(level):
        t = Config(dim=dim, optimizer=SGDSpec(lr=0.1)).table()
        keys = u64(np.arange(1, n + 1))
        t.lookup(keys, insert=True)
        before = np.asarray(t.lookup(keys, insert=False)).copy()
        big = np.finfo(np.float32).max
        # Finite extremes, a subnormal and signed zeros: all of them pass the check.
        fine = np.zeros((n, dim), dtype=np.float32)
        fine[0] = [big, -big, np.float32(1e-45)]
        fine[1] = [-0.0, 0.0, -np.float32(1e-45)]
        for pos in range(n * dim):
            for bad in (np.inf, -np.inf, np.nan):
                grads = fine.copy()
                grads.reshape(-1)[pos] = bad
                with pytest.raises(ValueError, match=f"grads must be finite: element {pos}"):
                    t.apply_gradients(keys, grads)
        np.testing.assert_array_equal(np.asarray(t.lookup(keys, insert=False)), before)
        t.apply_gradients(keys, fine)  # accepted
        assert not np.array_equal(np.asarray(t.lookup(keys, insert=False)), before)
