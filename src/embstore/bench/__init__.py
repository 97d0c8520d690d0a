"""Runner of the canonical workload W1 (``python -m embstore bench``).

W1 is the pooled training step on warm tables defined in ``bench/README.md``: ``T`` tables of
``U`` Zipf-distributed hashed ids each, batches of ``B`` examples with exactly ``L`` ids per
table, a pooled-sum forward and an Adagrad backward. The runner

1. generates the key stream and the fixed gradients before anything is timed
   (:func:`make_workload`);
2. for every peer (embstore and the baselines of :data:`PEERS`), builds and warms the
   tables, checks the peer's results against a plain numpy computation, runs a few
   untimed warm-up steps, then times ``forward`` and ``backward`` on every timed batch;
3. prints a header (commit, CPU, versions), one markdown table of medians and the memory
   figures of embstore's tables, and optionally writes the same as JSON.

Only numpy is imported at module import time; embstore's core, pandas and torch are
imported inside the peers that need them, so a missing optional package skips a peer
instead of failing the run.

Adding a peer is a matter of writing a :class:`Peer` subclass and decorating it with
:func:`register_peer`; it then appears in ``--peers`` and in the table.

Modules (one responsibility each):

- :mod:`~embstore.bench.workload`: ids, placement, Zipf batches, gradients;
- :mod:`~embstore.bench.reference`: the numpy reference (pooled sum, Adagrad step);
- :mod:`~embstore.bench.peers`: the :class:`Peer` interface and the registry;
- ``peer_embstore``, ``peer_dense`` (numpy, pandas), ``peer_torch``, ``peer_fbgemm``:
  the peers;
- :mod:`~embstore.bench.verify`: checks of each peer against the reference;
- :mod:`~embstore.bench.floor`: memory rates and the traffic floor of the step;
- :mod:`~embstore.bench.targets`: the performance targets, evaluated on a run;
- :mod:`~embstore.bench.plot`: the ``--plot`` PNG;
- :mod:`~embstore.bench.env`: machine facts and other processes' CPU time;
- :mod:`~embstore.bench.runner`: the run itself (:func:`run`, :class:`BenchConfig`);
- :mod:`~embstore.bench.report`: result rows and the markdown report;
- :mod:`~embstore.bench.results_io`: reading saved reports and workload figures;
- :mod:`~embstore.bench.page`, ``page_text``: the results page (``--markdown``) and the
  README's table (``--readme-table``), generated from saved results;
- :mod:`~embstore.bench.cli`: the command line (:func:`main`).
"""

from __future__ import annotations

from embstore.bench.cli import build_parser, config_from_args, main
from embstore.bench.env import environment, settle_allocator
from embstore.bench.peer_dense import NumpyDensePeer, PandasIndexPeer
from embstore.bench.peer_embstore import (
    EmbstorePeer,
    embstore_tables,
    memory_probe,
    probe_memory,
    warm_table,
)
from embstore.bench.peer_fbgemm import FBGEMM_INSTALL, FbgemmTbePeer
from embstore.bench.peer_torch import TorchEmbeddingBagPeer, apply_omp_wait_policy
from embstore.bench.peers import PEERS, Peer, register_peer
from embstore.bench.reference import VerificationError, reference_adagrad, reference_pool
from embstore.bench.report import ResultRow, format_report, format_table
from embstore.bench.runner import BenchConfig, Timing, run, time_peer
from embstore.bench.verify import verify_embstore, verify_peer
from embstore.bench.workload import (
    EPS,
    LR,
    ZIPF_ALPHA,
    Batch,
    TableData,
    Workload,
    make_tables,
    make_workload,
    placement,
    splitmix64,
    zipf_cdf,
)

__all__ = [
    "EPS",
    "FBGEMM_INSTALL",
    "LR",
    "PEERS",
    "ZIPF_ALPHA",
    "Batch",
    "BenchConfig",
    "EmbstorePeer",
    "FbgemmTbePeer",
    "NumpyDensePeer",
    "PandasIndexPeer",
    "Peer",
    "ResultRow",
    "TableData",
    "Timing",
    "TorchEmbeddingBagPeer",
    "VerificationError",
    "Workload",
    "apply_omp_wait_policy",
    "build_parser",
    "config_from_args",
    "embstore_tables",
    "environment",
    "format_report",
    "format_table",
    "main",
    "make_tables",
    "make_workload",
    "memory_probe",
    "placement",
    "probe_memory",
    "reference_adagrad",
    "reference_pool",
    "register_peer",
    "run",
    "settle_allocator",
    "splitmix64",
    "time_peer",
    "verify_embstore",
    "verify_peer",
    "warm_table",
    "zipf_cdf",
]
