"""How long an engine's start took, by phase: one log line at its end (rank 0's).

`StartupTimes.phase(name)` times a phase; `line(total)` writes them as
"startup 12.3 s: front 0.5 s, load 8.1 s, kv-cache 0.4 s, graphs 3.2 s, other 0.1 s": "front" the
model's files, config and tokenizer (`EngineFront`), "workers" (tensor parallelism) the worker
processes' start until every rank has met, "other" the rest of `total` (CPU weight packing, the
scheduler).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StartupTimes:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}  # name -> seconds, in the order they ran

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - begin

    def line(self, total: float | None = None) -> str:
        """The phases' seconds; `total` (default: since construction) adds "other"."""
        if total is None:
            total = time.perf_counter() - self.start
        parts = [f"{name} {seconds:.1f} s" for name, seconds in self.phases.items()]
        other = total - sum(self.phases.values())
        if other >= 0.05:
            parts.append(f"other {other:.1f} s")
        return f"startup {total:.1f} s: " + ", ".join(parts)
