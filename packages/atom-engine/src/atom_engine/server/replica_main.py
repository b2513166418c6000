"""A data-parallel replica's own process (`replica_main`): its `LLMEngine` behind an `AsyncEngine`,
serving the server's commands over one pipe. The messages, and the server's handle on the process
(`ReplicaProcess`), are in `server.replica`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import replace

from atom_engine.config import EngineConfig
from atom_engine.sampling_params import SamplingParams
from atom_engine.server.async_engine import AsyncEngine, RequestAborted, RequestFailed

# How often a replica sends its statistics when they change (`/metrics` reads the latest).
STATS_INTERVAL_S = 0.2


def replica_main(
    config: EngineConfig,
    dp_rank: int,
    on_gpus: bool,
    cpus: list[int] | None,
    log_level: int,
    conn,
) -> None:
    """A replica's process (started with CUDA_VISIBLE_DEVICES naming its GPUs): its engine behind
    an AsyncEngine, served over `conn`."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    from atom_engine.engine import LLMEngine
    from atom_engine.worker_main import _exit_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server; it stops us
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s %(name)s [dp {dp_rank}]: %(message)s",
    )
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    try:
        # This process sees its own devices only: cuda:0 onwards, one replica.
        local = replace(
            config,
            data_parallel_size=1,
            device="cuda" if on_gpus else config.device,
            # One engine on this node (replicas across nodes meet node 0's front, not each other).
            nnodes=1,
            node_rank=0,
            dist_init_addr=None,
        )
        engine = AsyncEngine(LLMEngine(local, dp_rank=dp_rank))
    except BaseException:
        send(("error", traceback.format_exc()))
        os._exit(1)

    def on_fatal(error: BaseException) -> None:
        try:
            send(("fatal", str(error)))
        finally:
            engine.engine.shutdown(graceful=False)
            os._exit(1)

    engine.add_fatal_hook(on_fatal)
    block_manager = engine.engine.block_manager
    send(
        (
            "ready",
            dict(
                num_kv_blocks=block_manager.num_blocks,
                block_size=block_manager.block_size,
                stats=engine.stats(),
                pid=os.getpid(),
            ),
        )
    )
    asyncio.run(_serve(engine, conn, send))
    engine.shutdown()
    os._exit(0)


async def _serve(engine: AsyncEngine, conn, send: Callable[[tuple], None]) -> None:
    """Carry out the server's commands until it says shutdown or its pipe closes."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("shutdown",)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "shutdown":
                return

    threading.Thread(target=read, name="atom-replica-reader", daemon=True).start()
    tasks: set[asyncio.Task] = set()

    def spawn(coro) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    spawn(_send_stats(engine, send))
    while True:
        message = await inbox.get()
        kind = message[0]
        if kind == "add":
            spawn(_run_request(engine, send, *message[1:]))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "fail_all":
            engine.fail_all(message[1])
        elif kind == "call":
            spawn(_run_call(engine, send, *message[1:]))
        elif kind == "shutdown":
            break
    for task in tasks:
        task.cancel()


async def _run_request(
    engine: AsyncEngine, send, request_id: str, prompt, params: SamplingParams
) -> None:
    try:
        if params.structured_outputs is not None and params.compiled_grammar is None:
            # off the event loop: the compiler is thread-safe and caches by spec
            params.compiled_grammar = await asyncio.to_thread(
                engine.engine.grammars.compile, params.structured_outputs
            )
        stream = await engine.add_request(request_id, prompt, params)
    except Exception as e:
        send(("rejected", request_id, _portable(e)))
        return
    send(("accepted", request_id))
    try:
        async for output in stream:
            send(("out", request_id, output))
    except RequestAborted as e:
        send(("aborted", request_id, str(e)))
    except Exception as e:
        text = str(e) if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
        send(("failed", request_id, text))


async def _run_call(engine: AsyncEngine, send, call_id: int, fn) -> None:
    try:
        result = await engine.call(fn)
    except Exception as e:
        result = _portable(e)
    send(("result", call_id, result))


async def _send_stats(engine: AsyncEngine, send) -> None:
    last = None
    while True:
        stats = engine.stats()
        if stats is not last:
            send(("stats", stats))
            last = stats
        await asyncio.sleep(STATS_INTERVAL_S)


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a plain exception of its kind with its message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        kind = ValueError if isinstance(error, ValueError) else RuntimeError
        return kind(f"{type(error).__name__}: {error}")
