"""The fixed text of the results page (``--markdown``): workloads, how to run, method.

Figures never go here: every number on the page comes from the JSON it is generated from.
"""

from __future__ import annotations

TITLE = "# Benchmark results"

INTRO = """\
Every figure on this page is generated from the JSON files in `bench/results/` by the bench
runner itself (the command in the comment above); CI regenerates the page and fails if it
differs. The workloads (8 tables of 1M Zipf(1.05) hashed ids each, B=2048 examples a batch):

| workload | what is timed | command |
|---|---|---|
| W1 | pooled training step on warm tables: `lookup_sum` then Adagrad `apply_gradients`, L ids per example and table, against each peer | `python -m embstore bench --full` |
| W2 | eviction churn: W1 at L=8 on empty tables of a quarter of the ids (every miss inserts, CLOCK evicts), held to a W1 step of the same run | `python bench/churn_and_readonly.py` |
| W3 | concurrent callers: K Python threads share the tables, half looking up and half applying | `python bench/w3_callers.py` |
| W4 | read-only lookup (`insert=False`, L=1) with 10% never-inserted ids, against torch's `embedding_bag` forward over the same batches | `python bench/churn_and_readonly.py` |
"""

HOW_TO_RUN = """\
## How to run

```sh
pip install ".[test,bench]"                     # once: builds the core, test and bench tools
python -m embstore bench                        # W1, quick (U=100k, ~30 s)
python -m embstore bench --full                 # W1 at full size, 3 passes (~2 min, 3 GiB)
python -m embstore bench --full --dim 128       # ~4 min, 9 GiB
python -m embstore bench --full --json w1.json --plot w1.png
python -m embstore bench --help                 # every flag
python bench/churn_and_readonly.py --json w2_w4.json   # W2 and W4
python bench/w3_callers.py --json w3.json       # W3
python bench/checkpoint.py                      # save / load throughput
python bench/optimizers.py                      # W1 step per optimizer
python -m pytest bench                          # microbenchmarks (pytest-benchmark)
```

Peers need optional packages; a missing one is reported as skipped, with its install line:

```sh
pip install torch==2.13.0                       # the torch peer (CPU build)
pip install --no-deps fbgemm-gpu-cpu==1.8.0     # the FBGEMM peer, built for torch 2.13
```

FBGEMM's wheel must match the installed torch exactly and pins other versions of torch's
dependencies, hence `--no-deps`; neither torch nor FBGEMM is a dependency of embstore.

To regenerate this page after a run, add its JSON to `bench/results/` (a W1 report per
machine and D; the W2-W4 scripts' `--json` files) and run the command in the comment at the
top with the new file list. `workloads.json` holds the figures of runs made before those
scripts wrote JSON, copied from their printed output.
"""

METHOD = """\
## Method

- **Workload.** Ids of table `t` are `splitmix64(rank + (t << 32))`; each batch has exactly
  L ids per example and table, ranks drawn from Zipf(1.05) truncated to U ids. Keys, offsets
  and one fixed `[B, D]` gradient per table are generated before anything is timed.
- **Warm tables.** Every peer holds all U ids of every table before timing (embstore:
  tables of capacity U, no eviction). Adagrad, lr 0.01, eps 1e-8, element-wise.
- **Verified before timed.** On the first batch each peer's forward must equal the in-order
  float32 sum of its rows, and one backward must equal a numpy Adagrad step (within 8 ulp,
  wider only where a duplicate sum is ill-conditioned); a mismatch aborts the run. embstore
  is bit-exact.
- **Timed.** After warm-up steps, each timed batch runs forward then backward
  (`time.perf_counter`, garbage collector off). Reported: medians of forward, backward and
  step (= forward + backward of the same batch). `--full` runs 3 passes, each building every
  peer's tables afresh in a rotated order, and pools their batches: one build's speed depends
  on where its tables land in memory.
- **Ratios** are peer / embstore from the same run (> 1: embstore is faster). A target takes
  each peer at its best thread count (FBGEMM's CPU TBE is fastest single-threaded).
- **Traffic floor.** The bytes embstore's step must move (an index line and the row's
  weights per distinct id in the forward, the row read and written back in the backward,
  the id, output and gradient streams) at memory rates measured in the same run.
  `step / floor` near 1 means the step runs at memory speed.
- **Noise.** These are shared 2-core VMs: each machine line gives the cores other processes
  used during the run. Quote ratios from one run, never across runs.

| peer | forward | backward + update |
|---|---|---|
| `embstore` | `TableGroup.lookup_sum`, one call for all tables | `TableGroup.apply_gradients`, one call |
| `numpy` (dense floor, no hashing) | `np.take` on precomputed rows, reshape and sum | `np.unique` + `np.add.at`, Adagrad on the distinct rows |
| `torch` | `F.embedding_bag(mode="sum", sparse=True)` on precomputed rows | `backward` + `torch.optim.Adagrad` (sparse) |
| `fbgemm` (FBGEMM CPU TBE, dense) | one `SplitTableBatchedEmbeddingBagsCodegen` for all tables | `out.backward(grad)`: fused `EXACT_ADAGRAD` |
| `pandas` (hashed store) | `pd.Index(ids).get_indexer(keys)`, then as numpy | `get_indexer` again, then as numpy |

numpy and pandas are single-threaded: they are measured once per (D, L) and their step is
repeated on each thread count's row, so its ratio compares with embstore at that count.
"""

TARGETS_NOTE = """\
Targets, at 2 threads (a peer at its best thread count): step >= 2.5x faster than FBGEMM's
and >= 4x a pandas + numpy store, within 2x of the traffic floor, forward within 1.25x of
torch's at L=8 (1.5x at L=1), 2 threads >= 1.8x one thread at L=8."""

W1_INTRO = (
    "Each row: embstore's forward and step (ms), the traffic floor, the speedup over one "
    "thread, and each peer's step in ms with its ratio to embstore's (x)."
)

W5_INTRO = (
    "The W1 step on the shape of real CTR models: 26 tables with the Criteo Kaggle "
    "cardinalities DLRM uses (3 to 10,131,227 rows), D=16, one id per example and table "
    "(L=1), B=512 (the headline) and B=128, with W1's peers, verification and traffic floor "
    "([docs/w5.md](../docs/w5.md)). Per run: the summary of each batch size as W1's, then "
    "issue 32's targets per batch size and thread count (ratios within the run; - where a "
    "target does not apply, n/a where a peer it needs did not run)."
)

MEMORY_INTRO = (
    "W1's tables built in a fresh process (Adagrad): resident memory per row against the "
    "payload (8-byte id + weights + accumulators). Target: <= 1.15x."
)

W2_INTRO = (
    "Capacity U/4 per table, tables start empty, L=8, D=32, 2 threads, 1000 batches; the W1"
    " step it is held to is timed in the same process. Target: W2 / W1 <= 1.5x, RSS flat."
)

W3_INTRO = (
    "K Python threads on the same 8 warm tables (L=8, D=32, `num_threads=2` each), even "
    "callers forward, odd callers apply; 3 interleaved rounds of 2 s per K. Targets: K=8 "
    "throughput >= K=2's, P99 <= 3x P50."
)

W4_INTRO = (
    "`lookup_sum(..., insert=False)`, L=1, D=32, 10% of ids never inserted; torch's "
    "`embedding_bag` forward over the same batches, the two taking turns each round (the "
    "faster of its 1 and 2 threads). Target: >= torch's throughput."
)

CHECKPOINT_INTRO = (
    "W1's 8 tables (1M ids, D=32, Adagrad: 268 MB a file) saved one by one and loaded back "
    "(2 threads); GB/s = file bytes / wall time, medians of the repeats (best in brackets)."
    " Targets: >= 1 GB/s to the page cache, <= 5% extra RSS during a save."
)

OPTIMIZER_INTRO = (
    "W1, embstore alone, D=32, 2 threads, {machine}, commit {commit}. Each variant builds its "
    "own tables, so compare the backward + update column across optimizers rather than "
    "single steps."
)

STAMP = (
    "<!-- Generated by `{command}`. Do not edit: change the JSON or "
    "src/embstore/bench/page_text.py and regenerate. -->"
)

PLOT = """\
![W1 step throughput by peer and by thread count, Xeon VM, D=32](results/w1_xeon.png)

The plot is `--plot` of `results/w1_d32_xeon.json`: examples/s of every peer (log scale)
with the traffic floor as a black line, and embstore against the thread count."""

MICRO = """\
## Microbenchmarks

`python -m pytest bench` times single calls on 20k warm ids with pytest-benchmark
(`lookup`, `lookup_sum`, `apply`, `insert_evict`, over dim, batch, pooling and threads),
each checked once against numpy first; `--benchmark-disable` runs every body once (CI's
smoke test)."""
