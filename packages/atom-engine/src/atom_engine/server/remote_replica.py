"""Data-parallel replicas across nodes (`atom serve -dp D --nnodes N`): each node runs D / N whole
replicas (each with its tensor-parallel ranks on that node); node 0 serves HTTP and balances over
all D, its own (`ReplicaProcess`, a pipe each) and the other nodes' (`RemoteReplica`, a TCP
connection each, to node 0's PORT+1).

The nodes meet at node 0's TCPStore as for tensor parallelism across nodes (`nodes`: fingerprints
compared, a mismatch refused naming the field). Then node R's replicas (`run_replicas`) connect
with `multiprocessing.connection.Client` and the shared secret `ATOM_DIST_AUTHKEY`: the replica
protocol (`server.replica`) pickles requests and callables, so node 0 hears only a peer that
proves it knows the secret (HMAC challenge), and a replica only a node 0 that does. A remote
replica whose connection closes is dead as a local one whose process exits: its requests fail
naming it and `atom serve` exits 1; a replica whose node 0 goes away exits 1, and so does its node.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import weakref

from atom_engine import envs
from atom_engine.config import EngineConfig, split_host_port
from atom_engine.nodes import NodeError, fingerprint, meet_nodes, open_store
from atom_engine.server.replica import ReplicaProcess, _environ, replica_cpus, replica_devices
from atom_engine.server.replica_main import replica_main

logger = logging.getLogger("atom_engine.server")


def authkey() -> bytes:
    key = envs.ATOM_DIST_AUTHKEY
    if not key:
        raise ValueError(
            "data parallelism across nodes needs ATOM_DIST_AUTHKEY: the same secret on every "
            "node (the replicas' connections carry pickled requests)"
        )
    return key.encode()


def node_config(config: EngineConfig) -> EngineConfig:
    """The config the replicas of one node are placed by (their share of its GPUs / cores)."""
    return dataclasses.replace(
        config,
        data_parallel_size=config.replicas_per_node(),
        nnodes=1,
        node_rank=0,
        dist_init_addr=None,
    )


class _Link:
    """A remote replica's connection, as `ReplicaProcess` uses its pipe and its process: `gone`
    once the connection has closed."""

    # What `ReplicaProcess` reports of a dead replica: its node's log has the exit status.
    exitcode = "unknown (its connection to node 0 closed)"

    def __init__(self, conn, peer: str) -> None:
        self.conn, self.pid = conn, peer
        self.gone = threading.Event()

    def recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.gone.set()
            raise

    def send(self, message) -> None:
        self.conn.send(message)

    def close(self) -> None:
        self.conn.close()
        self.gone.set()

    # the process interface
    def is_alive(self) -> bool:
        return not self.gone.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.gone.wait(timeout)

    def kill(self) -> None:
        self.close()

    terminate = kill


class RemoteReplica(ReplicaProcess):
    """Node 0's handle on a replica running on another node."""

    def __init__(self, dp_rank: int, node: int, conn, peer: str) -> None:
        self._init_state(dp_rank)
        self.node = node
        self._conn = self.proc = _Link(conn, peer)
        self._finalizer = weakref.finalize(self, _hang_up, self.proc, self._closing)
        self._start_reader()

    def where(self) -> str:
        return f"data-parallel replica {self.dp_rank} on node {self.node} (at {self.proc.pid})"


def _hang_up(link: _Link, closing: threading.Event) -> None:
    closing.set()
    try:
        link.send(("shutdown",))
    except OSError:
        pass
    link.close()


def meet_replica_nodes(config: EngineConfig, front) -> tuple[EngineConfig, Listener]:
    """Node 0: the rendezvous, then a listener for the other nodes' replicas; the config its
    own replicas are placed by."""
    key = authkey()
    store = open_store(config)
    mine = fingerprint(config, front.model_path, front.hf_config)
    meet_nodes(store, config, mine, front.max_model_len)
    return node_config(config), Listener(config, key, store)


class Listener:
    def __init__(self, config: EngineConfig, key: bytes, store) -> None:
        _, port = split_host_port(config.dist_init_addr)
        self.config, self.store = config, store  # the store lives as long as the listener
        self.listener = mp.connection.Listener(("", port + 1), authkey=key)

    def accept(self) -> list[RemoteReplica]:
        """Every other node's replicas, as they connect (up to dist_timeout)."""
        per_node = self.config.replicas_per_node()
        pending = set(range(per_node, self.config.data_parallel_size))
        found: list[RemoteReplica] = []
        timeout = self.config.resolved_dist_timeout()
        done = threading.Event()

        def run() -> None:
            while pending:
                try:
                    conn = self.listener.accept()
                    kind, dp_rank = conn.recv()
                except (OSError, EOFError, ValueError, mp.AuthenticationError) as e:
                    if done.is_set():
                        return
                    logger.warning("a connection to the replica port was refused: %s", e)
                    continue
                if kind != "replica" or dp_rank not in pending:
                    conn.close()
                    continue
                pending.discard(dp_rank)
                peer = self.listener.last_accepted[0].removeprefix("::ffff:")
                found.append(RemoteReplica(dp_rank, dp_rank // per_node, conn, peer))
            done.set()

        thread = threading.Thread(target=run, name="atom-replica-accept", daemon=True)
        thread.start()
        done.wait(timeout)
        if pending:
            done.set()
            self.listener.close()
            for replica in found:
                replica.shutdown(timeout=1.0)
            raise NodeError(
                f"data-parallel replica(s) {sorted(pending)} did not connect to node 0 within "
                f"{timeout:g} s (--dist-timeout): see their nodes' logs"
            )
        self.listener.close()
        return sorted(found, key=lambda r: r.dp_rank)


# -- the other nodes ---------------------------------------------------------------------------


def run_replicas(config: EngineConfig) -> dict:
    """Node R: spawn its replicas (global ranks R*L .. R*L+L-1), each connecting to node 0;
    {sentinel: (dp rank, process)}."""
    key = authkey()
    host, port = split_host_port(config.dist_init_addr)
    placement = node_config(config)
    level = logging.getLogger("atom_engine").getEffectiveLevel()
    ctx = mp.get_context("spawn")
    procs = {}
    first = config.node_rank * config.replicas_per_node()
    for local in range(config.replicas_per_node()):
        devices = replica_devices(placement, local)
        cpus = replica_cpus(placement, local)
        proc = ctx.Process(
            target=_replica_main,
            args=((host, port + 1), key, placement, first + local, devices is not None),
            kwargs=dict(cpus=cpus, level=level),
            name=f"atom-dp{first + local}",
        )
        with _environ(CUDA_VISIBLE_DEVICES=devices):
            proc.start()
        procs[proc.sentinel] = (first + local, proc)
    return procs


class _NodeZeroLink:
    """A replica's end on node R: node 0 closing without a shutdown ends it with status 1."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def recv(self):
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            logging.getLogger("atom_engine").error("node 0 closed the replica's connection")
            os._exit(1)
        return message

    def send(self, message) -> None:
        self.conn.send(message)


def _replica_main(address, key, config, dp_rank, on_gpus, *, cpus, level) -> None:
    try:
        conn = mp.connection.Client(address, authkey=key)
    except (OSError, mp.AuthenticationError) as e:
        logging.basicConfig(level=level)
        logger.error("replica %d cannot reach node 0 at %s: %s", dp_rank, address, e)
        os._exit(1)
    conn.send(("replica", dp_rank))
    replica_main(config, dp_rank, on_gpus, cpus, level, conn=_NodeZeroLink(conn))


__all__ = ["RemoteReplica", "meet_replica_nodes", "run_replicas"]
