"""The memory-traffic floor of W1's step: bytes embstore must move / rates measured here.

Two halves, both plain numpy:

1. :func:`measure_bandwidth` measures, on this machine, the rate of random row accesses
   to an array much larger than the last-level cache (1 GiB by default): *gather*
   (``np.take`` of random rows into a buffer), *update* (gather then write the same rows
   back, chunk by chunk, as an optimizer does: a read-modify-write of each row) and
   *stream* (``np.copyto`` of large contiguous arrays), with 1, 2, ... Python threads
   (``np.take``, ``np.put`` and ``np.copyto`` release the GIL, so ``k`` threads give
   ``k`` concurrent gathers). Rates are payload bytes per second, best of a few
   repetitions.
2. :func:`step_traffic` counts the bytes one step of embstore moves with its layout (a
   hash index of 12-byte slots; rows of weights followed by Adagrad accumulators, stride
   ``2 * D`` floats), and :func:`floor_ms` divides each kind of traffic by its measured
   rate.

The model, per batch of all ``T`` tables with ``u`` distinct ids (counted on the batches
that are timed) and ``n`` ids:

- index: one 64-byte line per distinct id in the forward and again in the backward (the
  two are separate calls, with a model's work in between) -- gathers of 64-byte rows;
- forward: the weights of each distinct id, ``D * 4`` bytes -- gathers of rows that size;
- backward: read and write back the whole row (weights + accumulators, ``8 * D`` bytes)
  of each distinct id -- updates of rows that size;
- streams: the ids (8 bytes each, read by both calls), the pooled outputs (written) and
  the gradients (read), ``T * B * D * 4`` bytes each -- at the copy rate.

It is a floor for this layout and API, not for any store: rows that stay cached from one
batch to the next (the Zipf head) cost less than a random DRAM access, so a step can come
in under it; and numpy's gather spends ~10 ns per row on its own bookkeeping, so for
64-byte rows the measured rate is partly numpy's, which makes the floor a little high.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from embstore.bench.workload import Batch, I64Array

#: Bytes of a cache line, the unit of a random access.
LINE = 64
#: Bytes of an index slot probe (one line; the slot itself is 12 bytes).
INDEX_LINE = LINE
#: Default size of the array the rates are measured on (>> any last-level cache here).
ARRAY_BYTES = 1 << 30
#: Payload moved per repetition of a measurement, over all threads.
SAMPLE_BYTES = 64 << 20
#: Rows gathered then written back per chunk of an update (stays in the L2 cache).
UPDATE_CHUNK_BYTES = 128 << 10


def _lines(nbytes: int) -> int:
    """Bytes of the cache lines a row of ``nbytes`` at a line-aligned address spans."""
    return math.ceil(nbytes / LINE) * LINE


def embstore_row_bytes(dim: int) -> int:
    """Bytes of one embstore Adagrad row: weights + accumulators, stride rounded to 4."""
    return (2 * dim + 3) // 4 * 4 * 4


def row_sizes(dims: Sequence[int]) -> list[int]:
    """The row sizes (bytes) :func:`floor_ms` needs rates for, for these ``D``."""
    sizes = {INDEX_LINE}
    for d in dims:
        sizes.add(_lines(4 * d))
        sizes.add(_lines(embstore_row_bytes(d)))
    return sorted(sizes)


@dataclass
class Rates:
    """Measured rates (GB/s of payload) with one thread count."""

    threads: int
    #: Contiguous copy: (bytes read + bytes written) / s.
    stream_gb_s: float
    #: Random row gather, by row size in bytes.
    gather_gb_s: dict[int, float]
    #: Random row read-modify-write, by row size (bytes of the row per s, read and written).
    update_gb_s: dict[int, float]
    #: Cores other processes used during the measurement (None where unknown).
    others_cores: float | None = None
    #: Measurements (each a best of 5) these rates are the best of: see :func:`best_rates`.
    measurements: int = 1


def best_rates(a: Sequence[Rates], b: Sequence[Rates]) -> list[Rates]:
    """Each rate the higher of two measurements at the same thread count (others: the most
    busy of the two). A machine's rates are what it can do; a measurement taken while the
    VM's memory was slow (a fresh process's first gigabyte can run at half speed for
    seconds) would make the floor too easy."""
    by_threads = {r.threads: r for r in b}
    out = []
    for r in a:
        o = by_threads.get(r.threads)
        if o is None:
            out.append(r)
            continue
        busy = [x for x in (r.others_cores, o.others_cores) if x is not None]
        out.append(
            Rates(
                r.threads,
                max(r.stream_gb_s, o.stream_gb_s),
                {k: max(v, o.gather_gb_s.get(k, 0.0)) for k, v in r.gather_gb_s.items()},
                {k: max(v, o.update_gb_s.get(k, 0.0)) for k, v in r.update_gb_s.items()},
                max(busy) if busy else None,
                r.measurements + o.measurements,
            )
        )
    return out


def _run_threads(fns: Sequence[Callable[[], None]]) -> float:
    """Run each function in its own thread, all at once; wall seconds until all are done."""
    threads = [threading.Thread(target=f) for f in fns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _best_rate(nbytes: int, runs: Sequence[Sequence[Callable[[], None]]]) -> float:
    """Largest ``nbytes / wall`` over the runs, each a set of concurrent thread bodies."""
    best = 0.0
    for bodies in runs:
        dt = _run_threads(bodies)
        if dt > 0:
            best = max(best, nbytes / dt / 1e9)
    return best


def _gather(words: I64Array, idx: I64Array, buf: I64Array) -> None:
    np.take(words, idx, out=buf, mode="clip")


def _update(words: I64Array, idx: I64Array, buf: I64Array) -> None:
    """Gather then write back ``words[idx]``, a chunk (L2-sized) at a time: every line
    touched is read, then dirtied, then written back when evicted."""
    chunk = max(1, UPDATE_CHUNK_BYTES // LINE)
    for lo in range(0, idx.shape[0], chunk):
        c = idx[lo : lo + chunk]
        b = buf[: c.shape[0]]
        np.take(words, c, out=b, mode="clip")
        np.put(words, c, b, mode="clip")


def _bodies(
    fn: Callable[[I64Array, I64Array, I64Array], None],
    words: I64Array,
    idx: Sequence[I64Array],
    bufs: Sequence[I64Array],
) -> list[Callable[[], None]]:
    """One thread body per index array: ``fn(words, idx[i], bufs[i])``."""
    return [functools.partial(fn, words, i, b) for i, b in zip(idx, bufs, strict=True)]


def line_words(rows: I64Array, row_bytes: int) -> I64Array:
    """Index (in 8-byte words) of one word in each cache line of each row, row by row.

    Row ``r`` of ``row_bytes`` (a multiple of 64) starts at word ``r * row_bytes / 8``;
    gathering these words moves every line of every row, at numpy's low per-element cost
    for 8-byte items (a gather of ``row_bytes``-sized items costs numpy ~20 ns per row of
    its own, which would be measured instead of the memory).
    """
    w = row_bytes // 8
    return (rows[:, None] * w + np.arange(0, w, LINE // 8, dtype=np.int64)[None, :]).reshape(-1)


def measure_bandwidth(
    sizes: Sequence[int],
    threads: Sequence[int],
    *,
    array_bytes: int = ARRAY_BYTES,
    sample_bytes: int = SAMPLE_BYTES,
    reps: int = 5,
    seed: int = 0,
    cpu_clock: Callable[[], Any] | None = None,
    others_cores: Callable[[Any], float | None] | None = None,
) -> list[Rates]:
    """Measure stream, random gather and random update rates on this machine.

    Parameters
    ----------
    sizes : sequence of int
        Row sizes in bytes (multiples of 8), e.g. :func:`row_sizes`.
    threads : sequence of int
        Thread counts; each measurement splits the same work over that many threads.
    array_bytes : int
        Size of the array rows are drawn from: make it much larger than the last-level
        cache (the default, 1 GiB, is 32x this machine's L3). Allocated and written
        once, freed on return.
    sample_bytes : int
        Payload of one repetition; each repetition draws new random rows.
    cpu_clock, others_cores : callable, optional
        :func:`embstore.bench.env.cpu_clock` / ``others_cores``, to record how busy the
        machine was.
    """
    rng = np.random.default_rng([seed, 7])
    words = np.empty(array_bytes // 8, dtype=np.int64)
    words.fill(1)  # resident before anything is measured
    half = words.shape[0] // 2
    out: list[Rates] = []
    try:
        for k in threads:
            start = cpu_clock() if cpu_clock else None
            # Stream: each thread copies its share of one half of the array to the other.
            share = half // k
            copies = [
                functools.partial(
                    np.copyto,
                    words[half + i * share : half + (i + 1) * share],
                    words[i * share : (i + 1) * share],
                )
                for i in range(k)
            ]
            stream = _best_rate(2 * share * k * 8, [copies] * reps)
            gather: dict[int, float] = {}
            update: dict[int, float] = {}
            for size in sizes:
                if size % LINE:
                    msg = f"row size {size} is not a multiple of {LINE} bytes"
                    raise ValueError(msg)
                num_rows = words.shape[0] // (size // 8)
                per = max(1, sample_bytes // size // k)  # rows per thread
                idx = [
                    [
                        line_words(rng.integers(0, num_rows, per, dtype=np.int64), size)
                        for _ in range(k)
                    ]
                    for _ in range(reps)
                ]
                bufs = [np.zeros(per * size // LINE, dtype=np.int64) for _ in range(k)]
                nbytes = per * k * size
                gather[size] = _best_rate(nbytes, [_bodies(_gather, words, ix, bufs) for ix in idx])
                update[size] = _best_rate(nbytes, [_bodies(_update, words, ix, bufs) for ix in idx])
                del idx, bufs
            busy = others_cores(start) if others_cores and start is not None else None
            out.append(Rates(k, stream, gather, update, busy))
    finally:
        del words
    return out


@dataclass
class Traffic:
    """Bytes one W1 step of embstore moves, by kind (see the module docstring)."""

    dim: int
    pooling: int
    #: Distinct ids per batch over all tables (mean over the batches counted).
    unique_ids: float
    #: Ids per batch over all tables.
    ids: int
    index_bytes: float
    forward_bytes: float
    update_bytes: float
    stream_bytes: float
    #: Examples per batch.
    batch_size: int = 0

    @property
    def total_bytes(self) -> float:
        """All bytes of the step (update bytes counted once: the row is read and written)."""
        return self.index_bytes + self.forward_bytes + self.update_bytes + self.stream_bytes


def unique_ids(batches: Sequence[Batch]) -> float:
    """Mean over ``batches`` of the distinct ids of a batch, summed over its tables."""
    if not batches:
        return 0.0
    per = [sum(int(np.unique(k).shape[0]) for k in b.keys) for b in batches]
    return float(np.mean(per))


def step_traffic(batches: Sequence[Batch], dim: int) -> Traffic:
    """Bytes embstore moves per step on these batches (all of the same ``B`` and ``L``)."""
    first = batches[0]
    u = unique_ids(batches)
    n = first.num_ids
    num_tables = len(first.keys)
    pooled = num_tables * first.batch_size * dim * 4
    return Traffic(
        dim=dim,
        pooling=first.pooling,
        unique_ids=u,
        ids=n,
        index_bytes=2 * u * INDEX_LINE,
        forward_bytes=u * _lines(4 * dim),
        update_bytes=u * _lines(embstore_row_bytes(dim)),
        stream_bytes=2 * n * 8 + 2 * pooled,
        batch_size=first.batch_size,
    )


def floor_ms(traffic: Traffic, rates: Rates) -> float:
    """Milliseconds the step's traffic takes at the measured rates (its floor)."""
    d = traffic.dim
    needed = (
        rates.gather_gb_s.get(INDEX_LINE, 0.0),
        rates.gather_gb_s.get(_lines(4 * d), 0.0),
        rates.update_gb_s.get(_lines(embstore_row_bytes(d)), 0.0),
        rates.stream_gb_s,
    )
    if min(needed) <= 0:
        return float("nan")
    seconds = (
        traffic.index_bytes / rates.gather_gb_s[INDEX_LINE]
        + traffic.forward_bytes / rates.gather_gb_s[_lines(4 * d)]
        + traffic.update_bytes / rates.update_gb_s[_lines(embstore_row_bytes(d))]
        + traffic.stream_bytes / rates.stream_gb_s
    ) / 1e9
    return seconds * 1e3


def floor_cases(traffic: Sequence[Traffic], rates: Sequence[Rates]) -> list[dict[str, Any]]:
    """One record per (traffic case, thread count): the bytes and the floor in ms."""
    out = []
    for tr in traffic:
        for r in rates:
            out.append(
                {
                    "dim": tr.dim,
                    "pooling": tr.pooling,
                    "threads": r.threads,
                    "floor_ms": floor_ms(tr, r),
                    "total_mb": tr.total_bytes / 1e6,
                    **asdict(tr),
                }
            )
    return out
