"""Machine facts for the report header (commit, CPU, versions) and CPU-time accounting
of other processes, so that a noisy figure says it is noisy."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _git(here: Path, *args: str) -> str:
    """Output of ``git -C here args`` (stripped); raises if git fails."""
    return subprocess.run(
        ["git", "-C", str(here), *args], capture_output=True, text=True, timeout=5, check=True
    ).stdout.strip()


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = _git(here, "rev-parse", "--short", "HEAD")
        dirty = _git(here, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git checkout)"
    return rev + ("-dirty" if dirty else "") if rev else "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    if dist == "embstore":  # run from a source tree (PYTHONPATH=src): no dist metadata
        mod = sys.modules.get("embstore")
        version = getattr(mod, "__version__", None)
        if version is not None:
            return f"{version} (source tree)"
    return "not installed"


def _simd_level() -> str:
    """The instruction set of embstore's hot kernels (chosen at run time from the CPU)."""
    try:
        core = importlib.import_module("embstore._core")
    except ImportError:
        return "n/a"
    return str(core.simd_level())


def resident_bytes() -> int | None:
    """Resident set size of this process, from /proc (``None`` where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int | None:
    """Peak resident set size of this process so far (``VmHWM``; ``None`` where unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def settle_allocator() -> None:
    """Let glibc's malloc reach its steady state before anything is timed.

    glibc serves blocks above ``M_MMAP_THRESHOLD`` (128 KiB at start) with fresh ``mmap``
    pages, and raises that threshold only after such a block is freed. Until then every
    large temporary (a [B, D] output, a gathered [B * L, D] array) page-faults on first
    touch, which made whichever peer ran first up to 2x slower. Freeing one 24 MiB block
    raises the threshold (and the trim threshold) once for all peers, as a long-running
    trainer would have it.
    """
    block = np.ones(6 << 20, dtype=np.float32)  # 24 MiB: below glibc's 32 MiB cap
    del block


def cpu_clock() -> tuple[float, float, float] | None:
    """(wall s, busy CPU-s of the whole machine, CPU-s of this process and its children)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return time.perf_counter(), busy, t.user + t.system + t.children_user + t.children_system


def others_cores(start: tuple[float, float, float] | None) -> float | None:
    """Cores used by other processes since ``start``, on average (from /proc/stat)."""
    end = cpu_clock()
    if start is None or end is None or end[0] <= start[0]:
        return None
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0]))


def available_bytes() -> int | None:
    """Memory the kernel could give a new allocation (``MemAvailable``; ``None`` if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def environment() -> dict[str, Any]:
    """Commit, CPU, cores and package versions for the report header."""
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "commit": _git_commit(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "pandas": _version("pandas"),
        "fbgemm": _version("fbgemm-gpu-cpu"),
        "embstore": _version("embstore"),
        "kernels": _simd_level(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
