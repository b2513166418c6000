"""How many threads torch computes with on the CPU: chosen once per process, at start-up, logged.

NOTE: on the 2-core CI machine, `atom serve` with torch's default of 2 intra-op threads served
16-18 output tok/s at concurrency 8 and 8-8.6 at concurrency 1 (`vllm bench serve`, SmolLM2-135M,
float32; issue 21), and 26 / 10 with 1 thread: the server's event loop, its tokenizer threads and
the client share those 2 cores, and an OpenMP parallel region waits for its slowest thread, so a
descheduled thread stalls every op. vLLM's CPU worker does the same arithmetic: it reserves one
core per rank for its scheduler and binds OMP_NUM_THREADS to the rest.

The choice, in order: `--num-threads N`; `OMP_NUM_THREADS` when it is set (the variable vLLM CPU
users set); else the cores this process may run on (its affinity mask and its cgroup's CPU quota)
less one for the server and scheduler, split over the tensor-parallel ranks, at least 1.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

logger = logging.getLogger("atom_engine")


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process' cgroup in cores (cgroup v2 `cpu.max`, v1 `cfs_quota_us`),
    or None without one."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_cpus() -> int:
    """Cores this process may use: its affinity mask, capped by its cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def choose_num_threads(requested: int | None, tp_size: int = 1) -> tuple[int, str]:
    """(threads for one rank, why) by the rules in this module's docstring."""
    if requested is not None:
        return requested, "--num-threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cpus = available_cpus()
    threads = max(1, (cpus - 1) // tp_size) if cpus > 1 else 1
    return threads, f"{cpus} cores available, one left to the server and scheduler"


def set_cpu_threads(requested: int | None, tp_size: int = 1, rank: int = 0) -> int:
    """Set torch's intra-op threads for this CPU rank and log the choice; returns it."""
    threads, why = choose_num_threads(requested, tp_size)
    torch.set_num_threads(threads)
    if rank == 0:
        logger.info("CPU: torch computes with %d thread(s) per rank (%s)", threads, why)
    return threads
