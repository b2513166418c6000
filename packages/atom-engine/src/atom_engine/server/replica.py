"""A data-parallel replica: one engine core in a process of its own, on its own devices (as vLLM
runs its data-parallel engine cores).

`ReplicaProcess` is the server's handle on it, with the `AsyncEngine` interface the data-parallel
front uses. The process (`server.replica_main`) sees only its replica's GPUs (it starts with
CUDA_VISIBLE_DEVICES naming GPUs d * tp ... d * tp + tp - 1 of the server's), or on the CPU runs
on its share of the cores (its affinity mask), builds an `LLMEngine` there (with its
tensor-parallel worker processes) behind an `AsyncEngine`, and serves it over one pipe:

- server -> replica: ("add", id, prompt, params), ("abort", id), ("fail_all", message),
  ("call", call id, fn), ("shutdown",);
- replica -> server: ("ready", info), ("accepted", id), ("rejected", id, error), ("out", id,
  output), ("failed", id, message), ("aborted", id, message), ("stats", stats), ("result", call
  id, value or error), ("error", traceback) at start-up, ("fatal", message).

A replica that cannot go on (a worker of its died, or it was killed) is seen at once by the pipe's
reader thread here: the requests in flight end with RequestFailed naming the replica, the fatal
hooks run (`atom serve` exits non-zero) and the process is ended. The replica ends itself when the
server's process is gone. A grammar is compiled again inside the replica (compiled grammars stay
where they are made; each replica's compiler caches them).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import torch

from atom_engine.config import EngineConfig
from atom_engine.engine import EngineStats
from atom_engine.outputs import RequestOutput
from atom_engine.sampling_params import SamplingParams
from atom_engine.server.async_engine import (
    EngineDeadError,
    RequestAborted,
    RequestFailed,
    _resolve,
    _Stream,
    iterate_stream,
)
from atom_engine.server.replica_main import replica_main

logger = logging.getLogger("atom_engine.server")


class ReplicaError(RuntimeError):
    """A data-parallel replica failed: it cannot go on."""


def replica_devices(config: EngineConfig, dp_rank: int) -> str | None:
    """The CUDA_VISIBLE_DEVICES of replica `dp_rank` (its tensor-parallel GPUs, numbered as the
    server's process sees them), or None on the CPU."""
    device = config.resolved_device()
    if device.type != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [d.strip() for d in visible.split(",") if d.strip()]
        if visible is not None
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    tp = config.tensor_parallel_size
    first = (device.index or 0) + dp_rank * tp
    return ",".join(ids[first : first + tp])


def replica_cpus(config: EngineConfig, dp_rank: int) -> list[int] | None:
    """On the CPU, replica `dp_rank`'s share of the cores this process may use (an equal slice;
    None when there are fewer cores than replicas, or on a GPU)."""
    if config.resolved_device().type != "cpu" or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    dp = config.data_parallel_size
    if len(cores) < dp:
        return None
    share = len(cores) // dp
    return cores[dp_rank * share : (dp_rank + 1) * share]


class ReplicaProcess:
    """Replica `dp_rank` of `config`, started at once; `wait_ready()` waits for its engine."""

    def __init__(self, config: EngineConfig, dp_rank: int) -> None:
        self._init_state(dp_rank)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        level = logging.getLogger("atom_engine").getEffectiveLevel()
        # Not daemonic: a replica starts worker processes of its own. It ends when this process
        # is gone (its pipe closes), and the finalizer below ends it first at exit.
        devices = replica_devices(config, dp_rank)
        self.proc = ctx.Process(
            target=replica_main,
            args=(config, dp_rank, devices is not None, replica_cpus(config, dp_rank), level),
            kwargs=dict(conn=child),
            name=f"atom-dp{dp_rank}",
        )
        with _environ(CUDA_VISIBLE_DEVICES=devices):
            self.proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _reap, self.proc, self._conn, self._closing)
        # atexit runs last-registered first: this ends the replica before multiprocessing's own
        # exit handler joins its non-daemonic children (forever, were the replica still waiting).
        atexit.register(self._finalizer)
        self._start_reader()

    def _init_state(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.fatal_error: BaseException | None = None
        self.info: dict[str, Any] = {}
        self._fatal_hooks: list[Callable[[BaseException], None]] = []
        self._lock = threading.Lock()  # guards the dicts below, the pipe's writes and the state
        self._streams: dict[str, _Stream] = {}
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stats: EngineStats | None = None
        self._closing = threading.Event()  # set when this side stops it: its end is no failure
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    def _start_reader(self) -> None:
        self._reader = threading.Thread(
            target=self._read, name=f"atom-dp{self.dp_rank}-reader", daemon=True
        )
        self._reader.start()

    def where(self) -> str:
        return f"data-parallel replica {self.dp_rank} (pid {self.proc.pid})"

    # -- start-up -------------------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Block until the replica's engine is up; raise ReplicaError if it failed to start."""
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def num_kv_tokens(self) -> int:
        return self.info["num_kv_blocks"] * self.info["block_size"]

    # -- the AsyncEngine interface ----------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.fatal_error is None and not self._closing.is_set() and self.proc.is_alive()

    def _send(self, message: tuple) -> None:
        with self._lock:
            self._conn.send(message)

    async def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """As `AsyncEngine.add_request`, in the replica's process."""
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, loop)
        accepted = loop.create_future()
        with self._lock:
            if not self.is_running:
                raise EngineDeadError(f"data-parallel replica {self.dp_rank} is not running")
            self._streams[request_id] = stream
            self._pending[request_id] = (loop, accepted)
        # A compiled grammar stays in this process; the replica compiles the spec again.
        wire = params if params.compiled_grammar is None else replace(params, compiled_grammar=None)
        try:
            self._send(("add", request_id, prompt, wire))
        except OSError:
            self._drop(request_id)
            raise EngineDeadError(f"data-parallel replica {self.dp_rank} is gone") from None
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._drop(request_id)
            raise
        return iterate_stream(stream.queue, lambda: self.abort(request_id))

    def _drop(self, request_id: str) -> _Stream | None:
        with self._lock:
            self._pending.pop(request_id, None)
            return self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown ids are ignored). Safe from any thread."""
        if self._drop(request_id) is None:
            return
        try:
            self._send(("abort", request_id))
        except OSError:
            pass

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the replica's engine thread (`fn` must pickle: a module-level
        function or a partial of one)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = (loop, future)
        self._send(("call", call_id, fn))
        return await future

    def fail_all(self, message: str) -> None:
        try:
            self._send(("fail_all", message))
        except OSError:
            pass

    def stats(self) -> EngineStats:
        return self._stats

    def add_fatal_hook(self, hook: Callable[[BaseException], None]) -> None:
        self._fatal_hooks.append(hook)
        if self.fatal_error is not None:
            hook(self.fatal_error)

    def stop(self) -> None:
        """Ask the replica to stop (it drains nothing: requests in flight end aborted)."""
        self._closing.set()
        try:
            self._send(("shutdown",))
        except OSError:
            pass

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the replica and wait up to `timeout` s for its process; then it is killed."""
        self.stop()
        self.proc.join(timeout)
        self._finalizer()  # kills what is left, closes the pipe
        atexit.unregister(self._finalizer)
        self._end_all(RequestAborted("the engine is shutting down"))

    # -- the pipe's reader ---------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # a message that does not unpickle: the replica is unusable
                self._die(f"an undecodable message ({type(e).__name__}: {e})")
                return
            kind = message[0]
            if kind == "out":
                _, request_id, output = message
                with self._lock:
                    stream = self._streams.get(request_id)
                    if stream is not None and output.finished:
                        del self._streams[request_id]
                if stream is not None:
                    stream.put(output)
            elif kind in ("failed", "aborted"):
                _, request_id, text = message
                stream = self._drop(request_id)
                if stream is not None:
                    error = RequestFailed if kind == "failed" else RequestAborted
                    stream.put(error(text))
            elif kind in ("accepted", "rejected"):
                request_id = message[1]
                with self._lock:
                    loop, future = self._pending.pop(request_id, (None, None))
                    if kind == "rejected":
                        self._streams.pop(request_id, None)
                if future is not None:
                    _resolve(loop, future, message[2] if kind == "rejected" else None)
            elif kind == "stats":
                self._stats = message[1]
            elif kind == "result":
                _, call_id, value = message
                with self._lock:
                    loop, future = self._calls.pop(call_id, (None, None))
                if future is not None:
                    _resolve(loop, future, value)
            elif kind == "ready":
                self.info = message[1]
                self._stats = self.info["stats"]
                self._ready.set()
            elif kind == "error":  # it failed to start
                self._start_error = ReplicaError(
                    f"data-parallel replica {self.dp_rank} failed to start:\n{message[1]}"
                )
                self._ready.set()
            elif kind == "fatal":
                self._die(message[1])
                return
        if not self._closing.is_set():
            self._die()

    def _die(self, text: str = "") -> None:
        """The replica cannot go on: end its process, its requests and the waits on it."""
        self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)
        summary = f"{self.where()} " + (
            f"failed: {text}" if text else f"exited with code {self.proc.exitcode}"
        )
        error = ReplicaError(summary)
        if not self._ready.is_set():
            self._start_error = error
            self._ready.set()
            return
        logger.error("%s", summary)
        self.fatal_error = error
        self._end_all(RequestFailed(f"the engine failed: {summary}"))
        for hook in list(self._fatal_hooks):
            try:
                hook(error)
            except Exception:
                logger.exception("a fatal-error hook failed")

    def _end_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            pending, self._pending = self._pending, {}
            calls, self._calls = self._calls, {}
        dead = EngineDeadError(str(error))
        for loop, future in [*pending.values(), *calls.values()]:
            _resolve(loop, future, dead)
        for request_id, stream in streams.items():
            if request_id not in pending:
                stream.put(error)


def _reap(proc: mp.process.BaseProcess, conn, closing: threading.Event) -> None:
    """End a replica's process: a shutdown message and its pipe closed (it stops on its own),
    then SIGTERM / SIGKILL."""
    closing.set()
    try:
        conn.send(("shutdown",))
    except OSError:
        pass
    conn.close()
    proc.join(5.0)
    if proc.is_alive():
        proc.terminate()
        proc.join(2.0)
    if proc.is_alive():
        proc.kill()
        proc.join(1.0)


@contextlib.contextmanager
def _environ(**values: str | None):
    """This process's environment with `values` set (None: left as it is) while a child starts:
    a spawned child starts with it, so its CUDA sees only its replica's GPUs from the first
    import on (CUDA reads CUDA_VISIBLE_DEVICES once, when it starts)."""
    values = {k: v for k, v in values.items() if v is not None}
    with _ENVIRON_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


_ENVIRON_LOCK = threading.Lock()
