"""Checks of every peer against the numpy reference, run before the peer is timed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from embstore.bench.peer_embstore import EmbstorePeer
from embstore.bench.peers import Peer
from embstore.bench.reference import (
    FWD_ATOL,
    FWD_RTOL,
    UPD_ATOL,
    VerificationError,
    as_numpy,
    max_abs_err,
    reference_adagrad,
    reference_pool,
)
from embstore.bench.workload import Batch, F32Array, Workload


def verify_peer(
    peer: Peer, batch: Batch, grads: Sequence[F32Array], *, check_update: bool = True
) -> dict[str, float]:
    """Check a peer's forward (and one Adagrad step) against the numpy reference.

    The forward must equal the in-order sum of the rows the peer holds for the batch's
    ids; after ``backward`` the rows must equal :func:`reference_adagrad` applied to the
    rows (and accumulators, zero when unreadable) read before the step.

    Returns
    -------
    dict
        ``forward_max_abs_err`` and, with ``check_update``, ``update_max_abs_err``.

    Raises
    ------
    VerificationError
        On a mismatch beyond the tolerances.
    """
    outs = [as_numpy(o) for o in peer.forward(batch)]
    before = [peer.read_rows(t, batch) for t in range(len(batch.keys))]
    fwd_err = 0.0
    for t, (out, (rows, _)) in enumerate(zip(outs, before, strict=True)):
        ref = reference_pool(rows, batch.pooling)
        fwd_err = max(fwd_err, max_abs_err(out, ref))
        if out.shape != ref.shape or not np.allclose(out, ref, rtol=FWD_RTOL, atol=FWD_ATOL):
            msg = (
                f"{peer.name}: forward of table {t} differs from the numpy gather+sum "
                f"(max abs err {max_abs_err(out, ref):.3g})"
            )
            raise VerificationError(msg)
    result = {"forward_max_abs_err": fwd_err}
    if not check_update:
        return result
    peer.backward(batch, grads)
    upd_err = 0.0
    for t, (rows, acc) in enumerate(before):
        after, _ = peer.read_rows(t, batch)
        key = batch.keys[t] if peer.hashed else batch.rows[t]
        ref, tol = reference_adagrad(key, rows, acc, grads[t], batch.pooling)
        err = max_abs_err(after, ref)
        upd_err = max(upd_err, err)
        if not np.all(np.abs(after.astype(np.float64) - ref) <= tol + UPD_ATOL):
            msg = (
                f"{peer.name}: Adagrad step of table {t} differs from numpy (max abs err {err:.3g})"
            )
            raise VerificationError(msg)
    result["update_max_abs_err"] = upd_err
    return result


def verify_embstore(
    peer: EmbstorePeer, wl: Workload, batch: Batch, threads: int | None
) -> dict[str, float]:
    """Verify embstore: forward on the warm tables, and one Adagrad step on a copy.

    The warm tables' accumulators are not readable, so the update is checked on fresh
    tables of the same configuration (a copy holding only the batch's ids, inserted by
    the forward with their initializer rows, accumulators at 0), through the same
    :class:`embstore.TableGroup` path and thread count. The copy's inserted rows must
    also equal ``Table.initial_values``.
    """
    result = verify_peer(peer, batch, wl.grads, check_update=False)
    copy = EmbstorePeer(threads, capacity=batch.batch_size * batch.pooling, warm=False)
    copy.setup(wl.tables, wl.dim)
    try:
        # Insert the batch's ids first so that read_rows sees them.
        copy.forward(batch)
        init_err = 0.0
        for t, keys in enumerate(batch.keys):
            rows, _ = copy.read_rows(t, batch)
            init = copy.initial_values(t, keys)
            init_err = max(init_err, max_abs_err(rows, init))
            if not np.array_equal(rows, init):
                msg = f"embstore: inserted rows of table {t} differ from initial_values"
                raise VerificationError(msg)
        res2 = verify_peer(copy, batch, wl.grads, check_update=True)
    finally:
        copy.close()
    result["update_max_abs_err"] = res2["update_max_abs_err"]
    result["copy_forward_max_abs_err"] = res2["forward_max_abs_err"]
    return result
