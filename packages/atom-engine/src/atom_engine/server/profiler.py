"""POST /start_profile and /stop_profile: torch.profiler around the engine thread's steps.

The profiler is started and stopped on the engine thread (between steps) so it records the ops
that thread runs; the trace goes to `ATOM_TORCH_PROFILER_DIR` / `--profiler-dir` when stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

from atom_engine.server.async_engine import AsyncEngine
from atom_engine.server.serving_common import APIError

PROFILER_DIR_ENV = "ATOM_TORCH_PROFILER_DIR"


class Profiler:
    def __init__(self, engine: AsyncEngine, directory: str | None = None) -> None:
        self.engine = engine
        directory = directory or os.environ.get(PROFILER_DIR_ENV)
        self.directory = Path(directory).expanduser() if directory else None
        self._profile = None

    def _check(self) -> Path:
        if self.directory is None:
            raise APIError(
                f"profiling is not enabled: start the server with --profiler-dir or "
                f"{PROFILER_DIR_ENV}"
            )
        return self.directory

    async def start(self) -> str:
        directory = self._check()
        if self._profile is not None:
            raise APIError("the profiler is already running")

        def start(engine) -> object:
            import torch

            directory.mkdir(parents=True, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profile = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(directory)),
            )
            profile.start()
            return profile

        self._profile = "starting"  # refuses a concurrent start while this one runs
        try:
            self._profile = await self.engine.call(start)
        except BaseException:
            self._profile = None
            raise
        return str(directory)

    async def stop(self) -> str:
        directory = self._check()
        profile, self._profile = self._profile, None
        if profile is None or profile == "starting":
            self._profile = profile
            raise APIError("the profiler is not running")
        await self.engine.call(lambda engine: profile.stop())  # writes the trace
        return str(directory)
