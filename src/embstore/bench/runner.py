"""The run: build, verify, warm up and time every peer on every ``(D, L, threads)`` case."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from embstore.bench.env import (
    available_bytes,
    cpu_clock,
    environment,
    loadavg,
    others_cores,
    peak_resident_bytes,
    resident_bytes,
    settle_allocator,
)
from embstore.bench.floor import (
    Rates,
    Traffic,
    best_rates,
    floor_cases,
    measure_bandwidth,
    row_sizes,
    step_traffic,
)
from embstore.bench.peer_embstore import EmbstorePeer, probe_memory
from embstore.bench.peer_torch import apply_omp_wait_policy
from embstore.bench.peers import PEERS, Peer
from embstore.bench.report import ResultRow, format_table, median_ms
from embstore.bench.verify import verify_embstore, verify_peer
from embstore.bench.w5 import CRITEO_CARDINALITIES, W5_BATCH_SIZES, W5_DIM, make_w5_tables
from embstore.bench.workload import TableData, Workload, make_tables, make_workload

#: Key of a workload in a run: (batch size, pooling).
Case = tuple[int, int]


@dataclass
class Timing:
    """Per-batch wall times (seconds) of one peer on one ``(D, L, threads)`` case."""

    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    #: Cores other processes used, on average, while the batches were timed.
    others_cores: float | None = None

    #: Median step (ms) of each pass's batches, in pass order.
    pass_step_ms: list[float] = field(default_factory=list)

    @property
    def step(self) -> list[float]:
        """Forward plus backward of the same batch."""
        return [f + b for f, b in zip(self.forward, self.backward, strict=True)]

    def add_pass(self, other: Timing) -> None:
        """Pool another pass's batches into this timing (others: the larger of the two)."""
        self.forward.extend(other.forward)
        self.backward.extend(other.backward)
        self.pass_step_ms.append(median_ms(other.step))
        seen = [x for x in (self.others_cores, other.others_cores) if x is not None]
        self.others_cores = max(seen) if seen else None


def time_peer(
    peer: Peer,
    wl: Workload,
    warmup: int,
    progress: Callable[[str], None] | None = None,
) -> Timing:
    """Run ``warmup`` untimed steps, then time every remaining batch of the workload.

    The garbage collector is off inside the timed region. Forward and backward of one
    batch are timed separately with ``time.perf_counter``; nothing else runs in between.
    """
    for i, batch in enumerate(wl.batches[:warmup]):
        if progress:
            progress(f"(warm-up {i + 1}/{warmup})")
        peer.forward(batch)
        peer.backward(batch, wl.grads)
    timed = wl.batches[warmup:]
    timing = Timing()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    clock = time.perf_counter
    cpu0 = cpu_clock()
    try:
        for i, batch in enumerate(timed):
            if progress:
                progress(f"{i + 1}/{len(timed)}")
            t0 = clock()
            peer.forward(batch)
            t1 = clock()
            peer.backward(batch, wl.grads)
            t2 = clock()
            timing.forward.append(t1 - t0)
            timing.backward.append(t2 - t1)
    finally:
        if was_enabled:
            gc.enable()
    timing.others_cores = others_cores(cpu0)
    return timing


@dataclass
class BenchConfig:
    """Sizes of a run. The defaults are the quick run (about a minute on 2 cores)."""

    num_tables: int = 8
    universe: int = 100_000
    batch_size: int = 2048
    dims: tuple[int, ...] = (32,)
    poolings: tuple[int, ...] = (1, 8)
    threads: tuple[int, ...] = (1, 2)
    batches: int = 30
    warmup: int = 5
    #: Times every peer is built and timed afresh; each case's median pools all passes.
    passes: int = 1
    peers: tuple[str, ...] = ("embstore", "numpy", "torch", "fbgemm", "pandas")
    seed: int = 0
    json_path: str | None = None
    progress: bool = True
    omp_wait_policy: str = "torch-default"
    #: Measure memory rates and report the traffic floor (embstore.bench.floor).
    floor: bool = True
    #: Size of the array the floor's rates are measured on, MiB (>> last-level cache).
    floor_array_mib: int = 1024
    #: "w1", or "w5" (26 Criteo-sized tables, ``universe`` capping each table's rows).
    workload: str = "w1"
    #: Batch sizes timed on the same tables (empty: ``(batch_size,)``).
    batch_sizes: tuple[int, ...] = ()

    @property
    def cases_batch(self) -> tuple[int, ...]:
        """The batch sizes of the run."""
        return self.batch_sizes or (self.batch_size,)

    @classmethod
    def full(cls) -> BenchConfig:
        """W1 at full size: T=8, U=1e6, B=2048, D=32, L 1 and 8, three passes."""
        return cls(universe=1_000_000, batches=20, warmup=5, passes=3)

    @classmethod
    def w5(cls, full: bool = False) -> BenchConfig:
        """W5: the 26 Criteo tables, D=16, L=1, B=512 and 128. The quick run
        caps every table at 100,000 rows; ``full`` keeps the real cardinalities and times
        :data:`W5_FULL_BATCHES` batches a pass."""
        cfg = cls.full() if full else cls()
        if full:  # W5's steps are 5-20x shorter than W1's: 20 batches timed 4-20 ms a pass
            cfg.batches = W5_FULL_BATCHES
        cfg.workload = "w5"
        cfg.num_tables = len(CRITEO_CARDINALITIES)
        cfg.universe = max(CRITEO_CARDINALITIES) if full else 100_000
        cfg.batch_size, cfg.batch_sizes = W5_BATCH_SIZES[0], W5_BATCH_SIZES
        cfg.dims, cfg.poolings = (W5_DIM,), (1,)
        return cfg

    def make_tables(self) -> list[TableData]:
        """The run's tables (ids and placement), before anything is timed."""
        if self.workload == "w5":
            return make_w5_tables(self.universe, self.num_tables)
        return make_tables(self.num_tables, self.universe)


#: Timed batches per case and pass of ``--workload w5 --full``: at 20 (W1's) one pass timed
#: 4-20 ms, and single passes of 2-3 runs in a row ran 1.5-2.5x slower than the others.
W5_FULL_BATCHES = 100


class _Progress:
    """One self-overwriting status line on stderr (plain lines when not a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.prefix = ""
        self._width = 0

    def stage(self, prefix: str) -> None:
        self.prefix = prefix
        if self.enabled and not self.tty:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {prefix}", file=sys.stderr)
        self.update("")

    def update(self, msg: str) -> None:
        if not (self.enabled and self.tty):
            return
        line = f"[{time.perf_counter() - self.t0:6.1f}s] {self.prefix} {msg}".rstrip()
        pad = max(0, self._width - len(line))
        self._width = len(line)
        sys.stderr.write("\r" + line + " " * pad)
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.tty and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0


def _rotated(plan: Sequence[type[Peer]], pass_no: int) -> list[type[Peer]]:
    """The peers in the order pass ``pass_no`` runs them: each pass starts one peer later,
    so no peer is always the one timed first (or last) in a run."""
    k = pass_no % len(plan) if plan else 0
    return [*plan[k:], *plan[:k]]


def _peer_plan(names: Sequence[str]) -> tuple[list[type[Peer]], dict[str, str]]:
    plan, skipped = [], {}
    for name in names:
        cls = PEERS.get(name)
        if cls is None:
            skipped[name] = f"skipped: unknown peer (known: {', '.join(PEERS)})"
            continue
        why = cls.unavailable()
        if why is not None:
            skipped[name] = why
            continue
        plan.append(cls)
    return plan, skipped


@dataclass
class _Collected:
    """What the passes of a run gather: timings by ``(peer, D, L, threads)``, and each
    peer's setup facts and verification results (first pass only)."""

    #: Keys: (peer, D, L, threads, B).
    measured: dict[tuple[str, int, int, int | None, int], Timing] = field(default_factory=dict)
    setup: list[dict[str, Any]] = field(default_factory=list)
    verification: list[dict[str, Any]] = field(default_factory=list)


def _run_peer(
    peer: Peer,
    cfg: BenchConfig,
    tables: Sequence[TableData],
    dim: int,
    workloads: dict[Case, Workload],
    first: bool,
    where: str,
    prog: _Progress,
    got: _Collected,
) -> None:
    """One pass of one peer: build and warm its tables, then for each ``L`` verify it (on
    the first pass), warm it up and time it; its tables are freed before returning."""
    name, threads = type(peer).name, peer.threads
    prog.stage(f"{where}: building and warming {len(tables)} tables")
    try:
        t_setup = time.perf_counter()
        peer.setup(tables, dim)
        if first:
            info = peer.extra()
            rss = resident_bytes()
            info.update(
                peer=name,
                dim=dim,
                threads=threads,
                setup_s=time.perf_counter() - t_setup,
                rss_mib=None if rss is None else rss / 2**20,
            )
            got.setup.append(info)
        for (bs, lp), wl in workloads.items():
            peer.prepare(wl.batches, wl.grads)
            case = f"B={bs} L={lp}" if len(cfg.cases_batch) > 1 else f"L={lp}"
            if first:
                prog.stage(f"{where} {case}: verifying")
                if isinstance(peer, EmbstorePeer):
                    res = verify_embstore(peer, wl, wl.batches[0], threads)
                else:
                    res = verify_peer(peer, wl.batches[0], wl.grads)
                got.verification.append(
                    {
                        "peer": name,
                        "dim": dim,
                        "pooling": lp,
                        "threads": threads,
                        "batch_size": bs,
                        **res,
                    }
                )
            prog.stage(f"{where} {case}: timing")
            timing = time_peer(peer, wl, cfg.warmup, prog.update)
            got.measured.setdefault((name, dim, lp, threads, bs), Timing()).add_pass(timing)
    finally:
        peer.close()
        del peer
        gc.collect()


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Run the comparison described by ``cfg`` and return the report as a dict.

    Loop order: for each ``D``, ``cfg.passes`` passes; in each pass, for each peer (the
    order rotated by one peer per pass) and each thread count (once for peers that are not
    threaded), the peer's tables are built and warmed; then for each ``L`` the peer is
    verified on the first batch (first pass only), warmed up and timed. Only one peer holds
    its tables at a time. A case's medians pool the batches of every pass. The floor's
    memory rates are measured at the start of each pass of the first ``D`` and each kept at
    its best.

    Why passes: the same build's speed moves with where its tables land in memory. On the
    2-core VM, eight builds of embstore's W1 tables in one process ran the D=32 L=8 forward
    at 1.9-3.1 ms (2 threads, steady within each build), while torch's 1-thread forward
    held at 1.9-2.3 ms; one build per peer made every ratio a draw of that lottery.
    """
    prog = _Progress(cfg.progress)
    settle_allocator()
    omp_policy = apply_omp_wait_policy(cfg.omp_wait_policy)
    plan, skipped = _peer_plan(cfg.peers)
    prog.stage(f"generating workload {cfg.workload} (T={cfg.num_tables}, U={cfg.universe})")
    tables = cfg.make_tables()
    n_batches = cfg.warmup + cfg.batches
    got = _Collected()
    memory: list[dict[str, Any]] = []
    load_start = loadavg()
    cpu_start = cpu_clock()
    rates: list[Rates] = []
    traffic: list[Traffic] = []

    for dim in cfg.dims:
        if any(cls.name == "embstore" for cls in plan):
            prog.stage(f"embstore D={dim}: measuring memory in a fresh process")
            memory.append(
                probe_memory(
                    cfg.num_tables, cfg.universe, dim, max(cfg.threads), workload=cfg.workload
                )
            )
        workloads = {
            (bs, lp): make_workload(
                num_tables=cfg.num_tables,
                universe=cfg.universe,
                batch_size=bs,
                pooling=lp,
                dim=dim,
                num_batches=n_batches,
                seed=cfg.seed,
                tables=tables,
            )
            for bs in cfg.cases_batch
            for lp in cfg.poolings
        }
        if cfg.floor:
            traffic += [step_traffic(wl.batches[cfg.warmup :], dim) for wl in workloads.values()]
        for pass_no in range(cfg.passes):
            first = pass_no == 0
            tag = f"pass {pass_no + 1}/{cfg.passes}: " if cfg.passes > 1 else ""
            if cfg.floor and dim == cfg.dims[0]:  # the floor keeps each rate's best pass
                mib = cfg.floor_array_mib
                prog.stage(f"{tag}traffic floor: measuring memory rates ({mib} MiB array)")
                now = measure_bandwidth(
                    row_sizes(cfg.dims),
                    cfg.threads,
                    array_bytes=cfg.floor_array_mib << 20,
                    cpu_clock=cpu_clock,
                    others_cores=others_cores,
                )
                rates = best_rates(rates, now) if rates else now
            for cls in _rotated(plan, pass_no):
                for threads in cfg.threads if cls.threaded else (None,):
                    where = f"{tag}{cls.name} D={dim} threads={threads if threads else '-'}"
                    why = _no_room(cls, tables, dim)
                    if why is not None:
                        skipped[f"{cls.name} D={dim} threads={threads or '-'}"] = why
                        continue
                    _run_peer(cls(threads), cfg, tables, dim, workloads, first, where, prog, got)
        del workloads
    prog.done()
    floor = floor_cases(traffic, rates) if rates else []
    rows = _result_rows(cfg, plan, got.measured, floor)
    env = environment()
    peak = peak_resident_bytes()
    env["peak_rss_mib"] = None if peak is None else round(peak / 2**20)
    env["loadavg_start"], env["loadavg_end"] = load_start, loadavg()
    others = others_cores(cpu_start)
    env["other_processes_cores"] = None if others is None else round(others, 2)
    env["omp_wait_policy"] = omp_policy
    return {
        "environment": env,
        "config": asdict(cfg),
        "results": [asdict(r) for r in rows],
        "table": format_table(rows),
        "memory": memory,
        "setup": got.setup,
        "verification": got.verification,
        "skipped": skipped,
        "floor": {"rates": [asdict(r) for r in rates], "cases": floor} if rates else None,
    }


#: Memory left to the rest of the machine when a peer's tables are built.
MEMORY_RESERVE = 1 << 30


def _no_room(cls: type[Peer], tables: Sequence[TableData], dim: int) -> str | None:
    """Why the peer's tables cannot be built now (not enough memory), or ``None``."""
    need = cls.memory_bytes(tables, dim)
    avail = available_bytes()
    if avail is None or need + MEMORY_RESERVE <= avail:
        return None
    return (
        f"skipped: its tables need about {need / 2**30:.1f} GiB and only "
        f"{avail / 2**30:.1f} GiB is available (keeping {MEMORY_RESERVE >> 30} GiB spare)"
    )


def _result_rows(
    cfg: BenchConfig,
    plan: Sequence[type[Peer]],
    measured: dict[tuple[str, int, int, int | None, int], Timing],
    floor: Sequence[dict[str, Any]] = (),
) -> list[ResultRow]:
    floor_of = {
        (c["dim"], c["pooling"], c["threads"], c.get("batch_size", cfg.batch_size)): c["floor_ms"]
        for c in floor
    }
    rows = []
    for bs in cfg.cases_batch:
        for dim in cfg.dims:
            for lp in cfg.poolings:
                for threads in cfg.threads:
                    base = measured.get(("embstore", dim, lp, threads, bs))
                    fl = floor_of.get((dim, lp, threads, bs))
                    for cls in plan:
                        key_thr = threads if cls.threaded else None
                        tm = measured.get((cls.name, dim, lp, key_thr, bs))
                        if tm is not None:
                            rows.append(_result_row(cls, cfg, (bs, dim, lp, threads), tm, base, fl))
    return rows


def _result_row(
    cls: type[Peer],
    cfg: BenchConfig,
    case: tuple[int, int, int, int],
    tm: Timing,
    base: Timing | None,
    fl: float | None,
) -> ResultRow:
    """One peer's row at ``case`` = (B, D, L, threads); ``base``: embstore's timing."""
    bs, dim, lp, threads = case
    base_f = median_ms(base.forward) if base else None
    base_s = median_ms(base.step) if base else None
    f, b, s = median_ms(tm.forward), median_ms(tm.backward), median_ms(tm.step)
    n_ids = cfg.num_tables * bs * lp
    return ResultRow(
        peer=cls.name,
        label=cls.label,
        dim=dim,
        pooling=lp,
        threads=threads,
        measured_threads=threads if cls.threaded else None,
        forward_ms=f,
        backward_ms=b,
        step_ms=s,
        ids_per_s=n_ids / (s * 1e-3),
        examples_per_s=bs / (s * 1e-3),
        forward_gb_per_s=n_ids * dim * 4 / (f * 1e-3) / 1e9,
        timed_batches=len(tm.forward),
        forward_ratio=f / base_f if base_f else None,
        step_ratio=s / base_s if base_s else None,
        others_cores=tm.others_cores,
        forward_ms_all=[x * 1e3 for x in tm.forward],
        backward_ms_all=[x * 1e3 for x in tm.backward],
        floor_ms=fl,
        floor_ratio=s / fl if fl and cls.name == "embstore" else None,
        pass_step_ms=list(tm.pass_step_ms),
        batch_size=bs,
    )
