"""A tensor-parallel worker process: ranks 1..N-1 of an engine (`workers.WorkerGroup` starts
them on node 0; `node_agent` on the other nodes). Each builds its shard of the model and its KV
cache, then follows rank 0's steps until a shutdown message; see `workers` for the lifecycle.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
import traceback

import torch

from atom_engine import envs
from atom_engine.config import EngineConfig
from atom_engine.parallel import EngineTPGroup, make_store, rank_device
from atom_engine.step_inputs import OP_SHUTDOWN, StepInputs


def _exit_with_parent(parent: int) -> None:
    """End this worker when rank 0's process is gone (it may be inside a collective that would
    otherwise wait for rank 0 forever)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


# Tests: "<rank>:<step>" makes that worker raise as its step `step` (counted from 0) starts, while
# rank 0 runs the same step: a worker failing inside a forward, as a device error would.
FAILURE_ENV = "ATOM_TEST_WORKER_FAILURE"


def injected_failure_step(rank: int) -> int | None:
    value = envs.ATOM_TEST_WORKER_FAILURE
    if not value:
        return None
    target, _, step = value.partition(":")
    return int(step) if int(target) == rank else None


def worker_main(
    rank: int,
    config: EngineConfig,
    model_path: str,
    max_model_len: int,
    port: int,
    dp_rank: int,
    *,
    steps,
    status,
    host: str = "127.0.0.1",
    remote: tuple[str, int, str, float] | None = None,
) -> None:
    """A worker process: build rank `rank`'s runner, then follow rank 0's steps. On a node other
    than node 0, `remote` = (host, port, token, timeout) of rank 0's step channel (`nodes`)."""
    from atom_engine.model_runner import ModelRunner
    from atom_models import load_config

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {rank}]: %(message)s",
    )
    try:
        if remote is not None:
            from atom_engine.node_steps import StepChannel

            steps = status = StepChannel(rank, *remote)
        hf_config = load_config(model_path, trust_remote_code=config.trust_remote_code)
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        status.send(("hello", None))
        timeout = config.resolved_dist_timeout() if remote is not None else None
        store = make_store(rank, config.tensor_parallel_size, port, host, timeout)
        tp = EngineTPGroup(
            store,
            rank,
            config.tensor_parallel_size,
            device,
            config.enable_expert_parallel,
            single_host=config.nnodes == 1,
        )
        torch.manual_seed(config.seed)
        runner = ModelRunner(config, model_path, hf_config, max_model_len, tp)
        fail_at = injected_failure_step(rank)
        for step in itertools.count():
            try:
                data = steps.recv_bytes()
            except (EOFError, OSError):  # rank 0 is gone
                break
            op, inputs = StepInputs.unpack(data)
            if op == OP_SHUTDOWN:
                break
            if step == fail_at:
                raise RuntimeError(f"{FAILURE_ENV}: rank {rank} fails its step {step}")
            runner.follow(op, inputs)
        # Nothing for a destructor to do at exit (and NCCL's could wait for rank 0).
        runner.release()
    except BaseException:
        text = traceback.format_exc()
        try:
            if remote is not None:  # its node's log shows it too
                logging.getLogger("atom_engine").error("%s", text)
            if status is not None:
                status.send(("error", text))
        finally:
            os._exit(1)
    # NOTE: a gloo rank sometimes aborted at interpreter exit (SIGABRT from a joinable C++ thread
    # destroyed by static destructors; tp_worker.py): leave without running them.
    os._exit(0)
