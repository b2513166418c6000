"""A node other than node 0 (`atom serve --node-rank R`, R > 0; `LLM(node_rank=R)`): no API server
and no scheduler, only this node's tensor-parallel ranks, which follow node 0's rank 0.

`run_node` resolves the model, checks the split, meets node 0 at its rendezvous (`nodes`), spawns
its ranks (`worker_main`, given node 0's step channel) and waits for them. It returns 0 when they
all end on node 0's shutdown message, 1 when one fails (node 0 gone included: its ranks see the
channel close); SIGTERM / SIGINT end its ranks and return 1.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import signal
import threading

from atom_engine.config import EngineConfig, split_host_port
from atom_engine.nodes import (
    NodeError,
    fingerprint,
    join_nodes,
    node_ranks,
    open_store,
    report_failure,
)
from atom_engine.parallel import check_parallel
from atom_engine.worker_main import worker_main

logger = logging.getLogger("atom_engine")


def run_node(config: EngineConfig) -> int:
    """Run node `config.node_rank`'s ranks until node 0 ends them; the exit status (0 or 1)."""
    from atom_engine.hub import resolve_model
    from atom_models import load_config

    if config.node_rank == 0:
        raise ValueError("run_node is for nodes of rank > 0; node 0 runs the engine")
    model_path = resolve_model(
        config.model,
        revision=config.revision,
        download_dir=config.download_dir,
        gguf_file=config.gguf_file,
        weights=config.load_format != "dummy",
    )
    hf_config = load_config(model_path, trust_remote_code=config.trust_remote_code)
    check_parallel(config, hf_config)
    host, port = split_host_port(config.dist_init_addr)
    timeout = config.resolved_dist_timeout()
    store = open_store(config)
    verdict = join_nodes(store, config, fingerprint(config, model_path, hf_config))
    if config.data_parallel_size > 1:  # whole replicas, connecting to node 0's balancer
        from atom_engine.server.remote_replica import run_replicas

        local = dataclasses.replace(config, model=model_path, gguf_file=None)
        procs = run_replicas(local)
        logger.info(
            "node %d: started data-parallel replicas %s",
            config.node_rank,
            sorted(rank for rank, _ in procs.values()),
        )
        return _wait(config.node_rank, procs, store, "data-parallel replica")
    ranks = node_ranks(config)
    logger.info(
        "node %d of %d: joined node 0 at %s; starting tensor-parallel ranks %d..%d",
        config.node_rank,
        config.nnodes,
        config.dist_init_addr,
        ranks[0],
        ranks[-1],
    )
    ctx = mp.get_context("spawn")
    procs = {}
    for rank in ranks:
        proc = ctx.Process(
            target=worker_main,
            args=(rank, config, model_path, verdict["max_model_len"], port, 0),
            kwargs=dict(
                steps=None,
                status=None,
                host=host,
                remote=(host, port + 1, verdict["token"], timeout),
            ),
            name=f"atom-tp{rank}",
            daemon=True,
        )
        proc.start()
        procs[proc.sentinel] = (rank, proc)
    return _wait(config.node_rank, procs, store, "tensor-parallel rank")


def _wait(node: int, procs: dict, store, what: str) -> int:
    """Wait for every rank; the first to fail (or a signal) ends the others."""
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    pending = dict(procs)
    status = 0
    while pending and not stop.is_set():
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=0.5):
            rank, proc = pending.pop(sentinel)
            proc.join()
            if proc.exitcode != 0 and status == 0:
                logger.error(
                    "node %d: %s %d (pid %d) exited with code %s: ending the others",
                    node,
                    what,
                    rank,
                    proc.pid,
                    proc.exitcode,
                )
                status = 1
                stop.set()
                report_failure(store, node, f"{what} {rank} exited with code {proc.exitcode}")
    if stop.is_set() and status == 0:
        logger.error("node %d: stopped by a signal; ending its ranks", node)
        status = 1
    for _, proc in pending.values():
        proc.terminate()
    for _, proc in pending.values():
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    if status == 0:
        logger.info("node %d: node 0 shut its ranks down", node)
    return status


__all__ = ["NodeError", "run_node"]
