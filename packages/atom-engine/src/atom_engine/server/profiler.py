"""POST /start_profile and /stop_profile: torch.profiler around the engine thread's steps.

The profiler is started and stopped on the engine thread (between steps) so it records the ops
that thread runs; the trace goes to `ATOM_TORCH_PROFILER_DIR` / `--profiler-dir` when stopped.
"""

from __future__ import annotations

import functools
from pathlib import Path

from atom_engine import envs
from atom_engine.server.async_engine import AsyncEngine
from atom_engine.server.serving_common import APIError

PROFILER_DIR_ENV = "ATOM_TORCH_PROFILER_DIR"


def start_profile(engine, directory: str) -> None:
    """On the engine thread: start torch.profiler (kept on the engine until `stop_profile`)."""
    import torch

    Path(directory).mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profile = torch.profiler.profile(
        activities=activities,
        record_shapes=True,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(directory),
    )
    profile.start()
    engine.profile = profile


def stop_profile(engine) -> None:
    """On the engine thread: stop the profiler `start_profile` started (writes the trace)."""
    profile, engine.profile = engine.profile, None
    profile.stop()


class Profiler:
    """Module-level functions run on the engine thread (they pickle: a data-parallel replica's
    engine is in another process; every replica writes its own trace)."""

    def __init__(self, engine: AsyncEngine, directory: str | None = None) -> None:
        self.engine = engine
        directory = directory or envs.ATOM_TORCH_PROFILER_DIR
        self.directory = Path(directory).expanduser() if directory else None
        self._state: str | None = None  # None, "starting" or "running"

    def _check(self) -> Path:
        if self.directory is None:
            raise APIError(
                f"profiling is not enabled: start the server with --profiler-dir or "
                f"{PROFILER_DIR_ENV}"
            )
        return self.directory

    async def start(self) -> str:
        directory = self._check()
        if self._state is not None:
            raise APIError("the profiler is already running")
        self._state = "starting"  # refuses a concurrent start while this one runs
        try:
            await self.engine.call(functools.partial(start_profile, directory=str(directory)))
        except BaseException:
            self._state = None
            raise
        self._state = "running"
        return str(directory)

    async def stop(self) -> str:
        directory = self._check()
        if self._state != "running":
            raise APIError("the profiler is not running")
        self._state = None
        await self.engine.call(stop_profile)  # writes the trace
        return str(directory)
