"""`ATOM_STEP_LOG=<path>`: one JSON line per synchronous engine step, appended to that file.

What a served run's steps were (issue 21's c8 trace): the step's start (`time.monotonic`, the
clock `time.perf_counter` reads on Linux, so a client's timestamps line up), its run's wall and
engine-thread CPU seconds (the gap is time off the CPU: the GIL, other processes), the decode
rows (rows of one token) and the tokens of each other row (prefill chunks). Unset, the engine
does no extra work.
"""

from __future__ import annotations

import json
import time

from atom_engine import envs

ENV_VAR = "ATOM_STEP_LOG"


class StepLog:
    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = envs.ATOM_STEP_LOG
        return cls(path) if path else None

    def record(self, started: float, wall: float, cpu: float, num_tokens: list[int]) -> None:
        line = {
            "start": round(started, 6),
            "wall_ms": round(wall * 1e3, 2),
            "cpu_ms": round(cpu * 1e3, 2),
            "decode_rows": sum(1 for n in num_tokens if n == 1),
            "prefill_tokens": [n for n in num_tokens if n > 1],
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def clocks() -> tuple[float, float]:
    """(wall, this thread's CPU time) now."""
    return time.monotonic(), time.thread_time()
