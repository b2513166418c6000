"""Tensor-parallel worker processes: ranks 1..N-1 of an engine, and rank 0's handle on them.

Workers are spawned (never forked: CUDA must not be initialised in a forked child). Each builds its
shard of the model and its KV cache (`ModelRunner` over the engine's `EngineTPGroup`), then follows
rank 0 step by step: rank 0 writes each step's `StepInputs`, packed as one int64 array, to a pipe
per worker (NOTE: 23 us a write, 44 us a round trip on this 2-core CPU, against 380 us for a gloo
broadcast of the same bytes; benchmarks/tp_handoff.py measures the whole hand-off).

Lifecycle: a worker that dies is seen at once by rank 0's monitor thread (its process sentinel),
which logs the rank and its error, ends the other workers and calls the engine's `on_death` hooks
(the server exits non-zero); the next step raises `WorkerError`. A worker ends itself when rank 0's
pipe closes or its parent process is gone, and ignores SIGINT (Ctrl-C reaches the whole process
group; rank 0 decides). `shutdown` sends each worker a shutdown message: it releases its runner
(CUDA graphs, KV cache, model, then an abort of its process group: `ModelRunner.release`) and exits;
what has not exited in time is terminated. The engine's own stop is never reported as a failure:
`shutdown`, `kill` and the finalizer mark the group closing before a worker is ended. The finalizer
(the engine dropped without shutdown, or the interpreter exiting: it runs before multiprocessing's
own exit handler terminates daemonic children) kills the workers with bounded waits; the monitor
holds the group weakly, so a dropped engine is collected.
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
import weakref
from collections.abc import Callable

from atom_engine.config import EngineConfig
from atom_engine.parallel import EngineTPGroup, make_store, rank_device
from atom_engine.step_inputs import shutdown_message
from atom_engine.worker_main import FAILURE_ENV, _exit_with_parent, worker_main  # noqa: F401

logger = logging.getLogger("atom_engine")


class WorkerError(RuntimeError):
    """A tensor-parallel rank failed: the engine cannot go on (every later step raises it)."""


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1 of one engine (replica `dp_rank`)."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        max_model_len: int,
        dp_rank: int = 0,
        hf_config=None,
    ) -> None:
        self.size = config.tensor_parallel_size
        self.dp_rank = dp_rank
        # Over several nodes: node 0's rendezvous, and rank 0's channel to the other nodes' ranks.
        self.remote = remote_token = None
        if config.nnodes > 1:
            self.store, self.remote, remote_token = _meet_nodes(
                config, model_path, hf_config, max_model_len
            )
        else:
            self.store = make_store(0, self.size)
        self.on_death: list[Callable[[WorkerError], None]] = []
        self._error: WorkerError | None = None
        # Set before any worker is ended on purpose (shared with the monitor and the finalizer).
        self._closing = threading.Event()
        self._lock = threading.Lock()
        # One reader of a dead worker's status pipe at a time: the monitor thread and check()
        # both record a death, and two readers of one pipe could leave the error message to the
        # one that records the death second (so "no error message" won).
        self._death_lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []
        self._steps: list[mp.connection.Connection] = []
        self._status: list[mp.connection.Connection] = []
        for rank in range(1, config.ranks_per_node()):
            steps_r, steps_w = ctx.Pipe(duplex=False)
            status_r, status_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main,
                args=(rank, config, model_path, max_model_len, self.store.port, dp_rank),
                kwargs=dict(steps=steps_r, status=status_w),
                name=f"atom-tp{rank}" + (f"-dp{dp_rank}" if dp_rank else ""),
                daemon=True,
            )
            proc.start()
            steps_r.close()
            status_w.close()
            self.procs.append(proc)
            self._steps.append(steps_w)
            self._status.append(status_r)
        self._finalizer = weakref.finalize(self, _stop, list(self.procs), self._closing)
        # atexit runs its handlers last registered first: this one (multiprocessing is imported by
        # now) marks the group closing before multiprocessing's terminates the daemonic workers.
        atexit.register(self._finalizer)
        try:
            self._wait_for_hello()
            if self.remote is not None:
                self.remote.accept(remote_token, self.store)
        except BaseException:
            self.shutdown()
            raise
        if self.remote is not None:
            self.remote.watch(functools.partial(_remote_died, weakref.ref(self)), self._closing)
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
        self._monitor = threading.Thread(
            target=_watch,
            args=(weakref.ref(self), sentinels, self._closing),
            name="atom-tp-monitor",
            daemon=True,
        )
        self._monitor.start()

    # -- start-up ------------------------------------------------------------------------------

    def _wait_for_hello(self) -> None:
        """Wait until every worker has started (imports done, about to connect), so a worker that
        fails to start is reported rather than waited for in the connection."""
        pending = dict(enumerate(self._status, start=1))
        while pending:
            sentinels = {self.procs[rank - 1].sentinel: rank for rank in pending}
            ready = mp.connection.wait([*pending.values(), *sentinels])
            for item in ready:
                rank, text = sentinels.get(item), ""
                if rank is None:
                    rank = next(r for r, conn in pending.items() if conn is item)
                    kind, text = _read_status(item)
                    if kind == "hello":
                        del pending[rank]
                        continue
                self._record_death(rank, text or "")
                self.shutdown()
                raise self._error

    # -- the monitor -----------------------------------------------------------------------------

    def _on_remote_death(self, message: str) -> None:
        logger.error("%s", message)
        with self._lock:
            if self._error is None:
                self._error = WorkerError(message)
        self._on_death(None)

    def _on_death(self, rank: int | None) -> None:
        if rank is not None:
            self._record_death(rank)
        self.kill()
        for hook in list(self.on_death):
            try:
                hook(self._error)
            except Exception:
                logger.exception("an on_death hook failed")

    def _record_death(self, rank: int, text: str = "") -> None:
        with self._death_lock:
            self._record_death_locked(rank, text)

    def _record_death_locked(self, rank: int, text: str) -> None:
        proc = self.procs[rank - 1]
        proc.join(1.0)
        conn = self._status[rank - 1]
        while True:  # the last message a worker sent is its error, if it had one
            kind, message = _read_status(conn)
            if kind is None:
                break
            if kind == "error":
                text = message
        where = f" of data-parallel replica {self.dp_rank}" if self.dp_rank else ""
        summary = (
            f"tensor-parallel worker rank {rank}{where} (pid {proc.pid}) exited with code "
            f"{proc.exitcode}"
        )
        logger.error("%s%s", summary, f":\n{text}" if text else "")
        last = text.strip().splitlines()[-1] if text.strip() else "no error message"
        with self._lock:
            if self._error is None:
                self._error = WorkerError(f"{summary} ({last})")

    # -- rank 0's side of a step -------------------------------------------------------------

    @property
    def error(self) -> WorkerError | None:
        return self._error

    def check(self, wait: float = 0.0) -> None:
        """Raise WorkerError if a worker has died (waiting up to `wait` s for one that is dying)."""
        deadline = time.monotonic() + wait
        while self._error is None:
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive() and not self._closing.is_set():
                    self._record_death(rank)
                    break
            if self.remote is not None and self.remote.error is not None:
                with self._lock:
                    self._error = self._error or WorkerError(self.remote.error)
            if self._error is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if self._error is not None:
            raise self._error

    def send(self, message: bytes) -> None:
        """Hand one step (`StepInputs.pack`) to every worker."""
        if self._error is not None:
            raise self._error
        try:
            for conn in self._steps:
                conn.send_bytes(message)
            if self.remote is not None:
                self.remote.send(message)
        except OSError as e:  # a closed pipe: the worker is gone
            self.check(wait=2.0)
            self.fail(e)
            raise self._error from e

    def fail(self, error: BaseException) -> None:
        """The ranks are out of step (rank 0 failed inside a step): end the workers."""
        if self._error is None and not self._closing.is_set():
            try:  # a worker's own death explains it better, if that is what happened
                self.check(wait=1.0)
            except WorkerError:
                pass
        with self._lock:
            if self._error is None:
                self._error = WorkerError(
                    f"rank 0 failed inside a tensor-parallel step ({type(error).__name__}: "
                    f"{error}); the ranks are out of step"
                )
                logger.error("%s", self._error)
        self.kill()

    # -- shutdown ------------------------------------------------------------------------------

    def kill(self) -> None:
        _stop(self.procs, self._closing)
        if self.remote is not None:  # their ranks exit 1: node 0 left without a shutdown
            self.remote.close()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker: a shutdown message (each releases its runner and exits), then
        SIGTERM / SIGKILL for what is left after `timeout` s (idempotent)."""
        self._closing.set()
        if self._error is None:
            for conn in self._steps:
                try:
                    conn.send_bytes(shutdown_message())
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        if self.remote is not None and self._error is None:
            self.remote.finish(shutdown_message(), timeout)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        _kill(self.procs)
        for conn in self._steps + self._status:
            conn.close()
        if self.remote is not None:
            self.remote.close()
        self._finalizer.detach()
        atexit.unregister(self._finalizer)


def _read_status(conn) -> tuple[str | None, str | None]:
    try:
        if conn.poll():
            return conn.recv()
    except (EOFError, OSError):
        pass
    return None, None


def _watch(ref: weakref.ref, sentinels: dict, closing: threading.Event) -> None:
    """The monitor thread: report the first worker to die, unless the group ended it. It holds
    the group weakly: a monitor that held it would keep a dropped engine's workers alive."""
    ready = mp.connection.wait(list(sentinels))
    group = ref()
    if group is not None and not closing.is_set():
        group._on_death(sentinels[ready[0]])


def _remote_died(ref: weakref.ref, message: str) -> None:
    group = ref()
    if group is not None:
        group._on_remote_death(message)


def _meet_nodes(config: EngineConfig, model_path: str, hf_config, max_model_len: int):
    """Node 0's side of the start-up over several nodes (`atom_engine.nodes`): the store at
    dist_init_addr, the listener for the other nodes' ranks, the rendezvous."""
    from atom_engine import nodes
    from atom_engine.node_steps import RemoteRanks

    store = nodes.open_store(config)
    remote = RemoteRanks(config)
    try:
        mine = nodes.fingerprint(config, model_path, hf_config)
        token = nodes.meet_nodes(store, config, mine, max_model_len)
    except BaseException:
        remote.close()
        raise
    return store, remote, token


def _stop(procs, closing: threading.Event) -> None:
    """End the workers on purpose (bounded: a finalizer may run this)."""
    closing.set()
    _kill(procs)


def _kill(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def start_runner(
    config: EngineConfig, model_path: str, hf_config, max_model_len: int, dp_rank: int = 0
):
    """Rank 0's ModelRunner of an engine (replica `dp_rank`), with its worker processes when
    tensor_parallel_size > 1."""
    from atom_engine.model_runner import ModelRunner

    device = rank_device(config, 0)
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, model_path, hf_config, max_model_len, device=device)
    begin = time.perf_counter()  # the workers' start (imports included) to their meeting
    workers = WorkerGroup(config, model_path, max_model_len, dp_rank, hf_config)
    tp = None
    try:
        tp = EngineTPGroup(
            workers.store,
            0,
            workers.size,
            device,
            config.enable_expert_parallel,
            single_host=config.nnodes == 1,
        )
        meet_s = time.perf_counter() - begin
        runner = ModelRunner(config, model_path, hf_config, max_model_len, tp, workers)
        runner.startup.phases = {"workers": meet_s, **runner.startup.phases}
        return runner
    except BaseException as e:
        if tp is not None:
            tp.close()
        try:
            workers.check(wait=10.0)  # a worker's own failure says more than the collective's
        except WorkerError as worker_error:
            raise worker_error from e
        finally:
            workers.shutdown()
        raise
