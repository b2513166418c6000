"""`AsyncEngine`: the synchronous `LLMEngine` driven by one background thread, fed from asyncio.

The engine is not thread-safe, so only the engine thread touches it. The event loop hands it work
through a command list guarded by a condition variable; the thread drains the commands between
steps (adds, aborts, calls), runs `step()` while requests are unfinished and sleeps on the condition
otherwise. Each request's outputs go back to the loop that added it through its own asyncio.Queue,
filled with `loop.call_soon_threadsafe`. A request the engine fails (its step raised because of
it: `RequestOutput.error`) ends with RequestFailed, and only it; a step that fails beyond that
(a bug outside any one request) fails the requests in flight, which are aborted so their KV
blocks return, and the loop goes on. A tensor-parallel worker's death (or a step that leaves the
ranks out of step) is fatal: the engine stops, its requests end with the error and the `on_fatal`
hooks run (`atom serve` exits non-zero).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from atom_engine.config import EngineConfig
from atom_engine.engine import EngineStats, LLMEngine
from atom_engine.outputs import RequestOutput
from atom_engine.sampling_params import SamplingParams
from atom_engine.workers import WorkerError

logger = logging.getLogger("atom_engine.server")


class RequestAborted(Exception):
    """The request was aborted (by `abort`, a disconnecting client or shutdown)."""


class RequestFailed(Exception):
    """The engine failed this request (the message says why); other requests went on."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running."""


@dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


async def iterate_stream(
    queue: asyncio.Queue, abort: Callable[[], None]
) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue: cumulative, so when several are queued only the newest
    is yielded; ends after the finished one; raises an exception found in the queue. Leaving
    early (break, cancellation) calls `abort`."""
    finished = False
    try:
        while True:
            item = await queue.get()
            while not isinstance(item, BaseException) and not queue.empty():
                item = queue.get_nowait()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                finished = True
            yield item
            if finished:
                return
    finally:
        if not finished:
            abort()


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any) -> None:
    """Complete `future` (on its loop) with a result, or an exception if `result` is one."""

    def done() -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:
        pass


class AsyncEngine:
    """An `LLMEngine` behind a background thread; `add_request` yields outputs asynchronously."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # The event loop's own copy (chat templates, echo): the engine thread keeps the original,
        # so no tokenizer object is ever used from two threads at once.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_model_len = engine.max_model_len
        self.model_path = engine.model_path
        self._cond = threading.Condition()
        self._commands: list[tuple] = []  # guarded by _cond
        # Written by the engine thread; a fatal error fails them from the thread that saw it.
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._stopped = False
        self._stats = engine.stats()
        self.fatal_error: BaseException | None = None
        self._fatal_hooks: list[Callable[[BaseException], None]] = []
        workers = getattr(engine.runner, "workers", None)
        if workers is not None:  # a worker's death is seen by its monitor thread
            workers.on_death.append(self._fatal)
        self._thread = threading.Thread(target=self._run, name="atom-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    # -- the event loop's side ----------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def _submit(self, command: tuple) -> None:
        with self._cond:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            self._commands.append(command)
            self._cond.notify()

    async def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request; once the engine has accepted it, an iterator of its outputs.

        Raises what `LLMEngine.add_request` raises (ValueError for a request that can never run).
        The iterator yields cumulative outputs, skipping stale ones when the reader falls behind,
        ends after the finished one, and raises RequestAborted if the request is aborted. Leaving
        it early (break, cancellation) aborts the request.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, loop)
        accepted = loop.create_future()
        self._submit(("add", stream, prompt, params, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it runs after it
            raise
        return self._iterate(stream)

    def _iterate(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        return iterate_stream(stream.queue, lambda: self.abort(stream.request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown ids are ignored). Safe from any thread."""
        try:
            self._submit(("abort", request_id))
        except EngineDeadError:
            pass

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(("call", fn, loop, future))
        return await future

    def fail_all(self, message: str) -> None:
        """End every request in flight with RequestAborted(message) (the drain timeout)."""
        try:
            self._submit(("fail_all", message))
        except EngineDeadError:
            pass

    def stats(self) -> EngineStats:
        """The engine's statistics as of its last step (a snapshot; never blocks)."""
        return self._stats

    def add_fatal_hook(self, hook: Callable[[BaseException], None]) -> None:
        """Call `hook(error)` (from any thread) when the engine cannot go on."""
        self._fatal_hooks.append(hook)
        if self.fatal_error is not None:
            hook(self.fatal_error)

    def _fatal(self, error: BaseException) -> None:
        """The engine cannot go on: its requests end now with the error, from this thread (the
        engine thread may be stuck in a collective with a dead rank), and the hooks run."""
        with self._cond:
            if self.fatal_error is not None:
                return
            self.fatal_error = error
            self._stopped = True
            self._cond.notify()
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(RequestFailed(f"the engine failed: {error}"))
        for hook in list(self._fatal_hooks):
            try:
                hook(error)
            except Exception:
                logger.exception("a fatal-error hook failed")

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        # The tensor-parallel workers: stopped in order when the engine thread is done, killed
        # when it is still inside a step.
        self.engine.shutdown(graceful=not self._thread.is_alive())

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        device = self.engine.runner.device
        if device.type == "cuda":  # the current device is per thread (replicas on other GPUs)
            import torch

            torch.cuda.set_device(device)
        while True:
            idle = not self.engine.has_unfinished_requests()
            with self._cond:
                while idle and not self._commands and not self._stopped:
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopped = self._stopped
            for command in commands:
                self._apply(command)
            if stopped:
                reason = "the engine is shutting down"
                if self.fatal_error is not None:
                    reason = f"the engine failed: {self.fatal_error}"
                self._fail_all(RequestAborted(reason))
                return
            if self.engine.has_unfinished_requests():
                self._step()
            try:
                self._stats = self.engine.stats()
            except Exception:  # statistics must never stop the loop
                logger.exception("engine stats failed")

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, stream, prompt, params, accepted = command
            try:
                self.engine.add_request(stream.request_id, prompt, params)
            except Exception as e:
                _resolve(stream.loop, accepted, e)
                return
            with self._streams_lock:
                self._streams[stream.request_id] = stream
            _resolve(stream.loop, accepted, None)
        elif kind == "abort":
            request_id = command[1]
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
            with self._streams_lock:
                stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(RequestAborted(f"request {request_id} was aborted"))
        elif kind == "fail_all":
            self._fail_all(RequestAborted(command[1]))
        elif kind == "call":
            _, fn, loop, future = command
            try:
                result = fn(self.engine)
            except Exception as e:
                result = e
            _resolve(loop, future, result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerError as e:
            logger.error("the engine cannot go on: %s", e)
            self._fatal(e)
            return
        except Exception as e:
            # The step's requests cannot be told apart from here: fail every request in flight
            # (aborting frees their blocks) and keep serving new ones.
            logger.exception("engine step failed; failing %d requests", len(self._streams))
            self._fail_all(RuntimeError(f"the engine failed: {type(e).__name__}: {e}"))
            return
        for output in outputs:
            with self._streams_lock:
                stream = self._streams.get(output.request_id)
                if stream is not None and output.finished:
                    del self._streams[output.request_id]
            if stream is None:
                continue
            stream.put(output if output.error is None else RequestFailed(output.error))

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)
