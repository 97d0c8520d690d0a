"""Tests of the W1 bench harness itself (embstore.bench): peers agree with the numpy
reference, the traffic-floor arithmetic, the report's targets and the plot.

Optional peers and tools (torch, FBGEMM, matplotlib) are skipped when not installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from embstore.bench import make_workload
from embstore.bench.peer_fbgemm import FBGEMM_INSTALL, FbgemmTbePeer, tbe_inputs
from embstore.bench.verify import verify_peer


def _small_workload(pooling: int, dim: int = 16, **kw: Any) -> Any:
    return make_workload(
        num_tables=3,
        universe=2000,
        batch_size=64,
        pooling=pooling,
        dim=dim,
        num_batches=kw.pop("num_batches", 3),
        **kw,
    )


# --------------------------------------------------------------------------------------
# FBGEMM peer
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", [1, 3])
def test_tbe_inputs_are_table_major(pooling: int) -> None:
    """TBE input: all tables' rows concatenated; offsets[t * B + b] starts bag b of table t."""
    wl = _small_workload(pooling)
    batch = wl.batches[0]
    indices, offsets = tbe_inputs(batch)
    b, n = batch.batch_size, batch.batch_size * pooling
    assert indices.dtype == np.int64 and offsets.dtype == np.int64
    assert offsets.shape == (len(batch.rows) * b + 1,)
    assert offsets[0] == 0 and offsets[-1] == indices.shape[0] == len(batch.rows) * n
    for t, rows in enumerate(batch.rows):
        for bag in (0, 1, b - 1):
            lo, hi = offsets[t * b + bag], offsets[t * b + bag + 1]
            np.testing.assert_array_equal(
                indices[lo:hi], rows[batch.offsets[bag] : batch.offsets[bag + 1]]
            )


def test_fbgemm_unavailable_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FBGEMM the peer is skipped, and the message says how to install it."""
    import embstore.bench.peer_fbgemm as mod

    def missing() -> Any:
        raise ImportError("No module named 'fbgemm_gpu'")

    monkeypatch.setattr(mod, "import_fbgemm", missing)
    why = FbgemmTbePeer.unavailable()
    assert why is not None and why.startswith("skipped")
    assert FBGEMM_INSTALL in why


@pytest.mark.parametrize(("pooling", "dim", "threads"), [(1, 16, 1), (4, 16, 2), (8, 128, 1)])
def test_fbgemm_peer_matches_numpy(pooling: int, dim: int, threads: int) -> None:
    """FBGEMM's forward and fused EXACT_ADAGRAD step agree with the numpy reference.

    FBGEMM's CPU update is ``acc += g * g; w -= lr * g / (sqrt(acc) + eps)`` (eps outside
    the square root, as the reference) with ``g`` summed and the step computed in double:
    within the reference's per-element tolerance (a few ulp), batch after batch (the
    accumulators carry over, read back from the module).
    """
    why = FbgemmTbePeer.unavailable()
    if why is not None:
        pytest.skip(why)
    wl = _small_workload(pooling, dim, num_batches=4)
    peer = FbgemmTbePeer(threads)
    peer.setup(wl.tables, dim)
    try:
        # Starts from the dense peers' rows, accumulators at 0.
        w0, acc0 = peer.read_rows(0, wl.batches[0])
        np.testing.assert_array_equal(
            w0, wl.tables[0].initial_rows(dim, seed=0)[wl.batches[0].rows[0]]
        )
        assert acc0 is not None and not acc0.any()
        peer.prepare(wl.batches[:2], wl.grads)  # the last batches go unprepared
        for batch in wl.batches:
            res = verify_peer(peer, batch, wl.grads)
            assert res["forward_max_abs_err"] <= 1e-6
        _, acc = peer.read_rows(0, wl.batches[-1])
        assert acc is not None and acc.any()
    finally:
        peer.close()
