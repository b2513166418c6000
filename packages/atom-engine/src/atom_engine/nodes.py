"""Tensor parallelism across nodes: the rendezvous at node 0's TCPStore and the step channel.

`atom serve --nnodes N --node-rank R --dist-init-addr HOST:PORT -tp T` (SGLang's flags) splits
the T ranks over N nodes, T / N each: node R runs ranks R*T/N .. (R+1)*T/N - 1. Node 0 is the
engine as on one node (rank 0 in its process, its other ranks in spawned workers) and the only
node that serves HTTP and schedules; the others run `node_agent.run_node`: their ranks' workers.

Start-up, every wait bounded by `dist_timeout` (`NodeError` naming what did not come):
  1. node 0 opens the TCPStore on PORT (the ranks' process group meets there, as on one node)
     and the step listener on PORT+1;
  2. node R joins the store, claims its rank (a second node with the same rank is refused) and
     posts its fingerprint: every config field the nodes must share, the model's config and its
     weight files' sizes, the atom-engine and torch versions;
  3. node 0 waits for every node's fingerprint and posts a verdict per node: the first field that
     differs from its own (the node and node 0 both stop, naming it), or the max_model_len every
     rank sizes by and the token its ranks present on PORT+1;
  4. node R spawns its ranks; each connects to PORT+1 and builds its shard over the process
     group (gloo on the CPU, NCCL on GPUs), meeting the others through the same store.

Steps: rank 0 sends each step's packed `StepInputs` over one TCP connection per remote rank
(`multiprocessing.connection` framing, raw bytes and JSON: nothing from the network is
unpickled); a remote rank sends back only status: hello, a heartbeat every HEARTBEAT_S, its error.

Failure: rank 0's monitor thread (`RemoteRanks`) reads every remote connection; an error, a
closed connection (the process or its node died) or no heartbeat for HEARTBEAT_TIMEOUT_S (a node
gone without closing its sockets) is that rank's death, handled as a local worker's
(`WorkerGroup`: the requests in flight fail, `atom serve` exits 1). A remote rank exits 1 when
node 0 closes its connection without a shutdown message; its node exits 1 when any rank does.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import multiprocessing.connection
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from atom_engine.config import EngineConfig, split_host_port
from atom_engine.parallel import make_store

logger = logging.getLogger("atom_engine")

HEARTBEAT_S = 1.0
# NOTE: a closed connection (a killed process, even a killed node's kernel) is seen at once; this
# only bounds a node that vanished silently (power, network). 8 s leaves a busy CPU's heartbeat
# thread room to be late while keeping "requests fail within 10 s".
HEARTBEAT_TIMEOUT_S = 8.0
STORE_PREFIX = "atom_nodes"
# Fields each node may set for itself; every other EngineConfig field must match node 0's. (The
# model is compared by its config and weight files, not by the path it was given.)
PER_NODE_FIELDS = frozenset(
    {
        "model", "revision", "download_dir", "gguf_file", "tokenizer", "skip_tokenizer_init",
        "show_progress", "num_threads", "device", "node_rank", "dist_init_addr", "dist_timeout",
    }
)  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


class NodeError(RuntimeError):
    """A node did not arrive, was refused at the rendezvous, or went away."""


def node_ranks(config: EngineConfig, node_rank: int | None = None) -> range:
    """The tensor-parallel ranks of node `node_rank` (default: this node)."""
    node = config.node_rank if node_rank is None else node_rank
    per_node = config.ranks_per_node()
    return range(node * per_node, (node + 1) * per_node)


def node_of(config: EngineConfig, rank: int) -> int:
    return rank // config.ranks_per_node()


# -- the rendezvous -------------------------------------------------------------------------


def fingerprint(config: EngineConfig, model_path: str, hf_config) -> dict[str, Any]:
    """What every node must share, as JSON values: {field: value}."""
    out: dict[str, Any] = {
        f.name: getattr(config, f.name)
        for f in fields(EngineConfig)
        if f.name not in PER_NODE_FIELDS
    }
    out["device"] = config.resolved_device().type
    for key, value in hf_config.to_dict().items():
        if key not in ("_name_or_path", "transformers_version"):
            out[f"model config {key}"] = value
    out["model weight files"] = _weight_files(model_path)
    out["atom-engine version"] = importlib.metadata.version("atom-engine")
    out["torch version"] = torch.__version__
    return json.loads(json.dumps(out, default=str, sort_keys=True))


def _weight_files(model_path: str) -> list[list]:
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(path.iterdir()) if path.is_dir() else []
    return [[f.name, f.stat().st_size] for f in files if f.name.endswith(WEIGHT_SUFFIXES)]


def difference(mine: dict, theirs: dict) -> tuple[str, Any, Any] | None:
    """The first field (sorted) whose values differ: (field, mine, theirs), or None."""
    for key in sorted(mine.keys() | theirs.keys()):
        if mine.get(key) != theirs.get(key):
            return key, mine.get(key), theirs.get(key)
    return None


def open_store(config: EngineConfig) -> dist.TCPStore:
    """Node 0 opens the rendezvous store at dist_init_addr; the other nodes join it."""
    host, port = split_host_port(config.dist_init_addr)
    timeout = config.resolved_dist_timeout()
    is_host = config.node_rank == 0
    try:
        return make_store(0 if is_host else 1, config.tensor_parallel_size, port, host, timeout)
    except (RuntimeError, OSError) as e:
        if is_host:
            raise NodeError(f"node 0 cannot open its rendezvous on port {port}: {e}") from None
        raise NodeError(
            f"node {config.node_rank}: node 0's rendezvous at {config.dist_init_addr} did not "
            f"answer within {timeout:g} s (--dist-timeout); is node 0 started with the same "
            f"--dist-init-addr, and reachable from here? ({_first_line(e)})"
        ) from None


def meet_nodes(store: dist.Store, config: EngineConfig, mine: dict, max_model_len: int) -> str:
    """Node 0: wait for every other node's fingerprint and post each one's verdict; the token
    the remote ranks present. Raises NodeError when a node is missing or refused."""
    ns = dist.PrefixStore(STORE_PREFIX, store)
    others = range(1, config.nnodes)
    timeout = config.resolved_dist_timeout()
    logger.info(
        "waiting up to %g s for node(s) %s at %s", timeout, list(others), config.dist_init_addr
    )
    try:
        ns.wait([f"node/{r}" for r in others], datetime.timedelta(seconds=timeout))
    except RuntimeError:
        missing = [r for r in others if not ns.check([f"node/{r}"])]
        raise NodeError(
            f"node(s) {', '.join(map(str, missing))} of {config.nnodes} did not join node 0's "
            f"rendezvous at {config.dist_init_addr} within {timeout:g} s (--dist-timeout): start "
            "`atom serve --node-rank R` with the same flags on each"
        ) from None
    token = secrets.token_hex(16)
    refused = []
    for r in others:
        diff = difference(mine, json.loads(ns.get(f"node/{r}")))
        if diff is None:
            verdict = {"max_model_len": max_model_len, "token": token}
        else:
            key, ours, theirs = diff
            verdict = {
                "error": f"node {r} refused at the rendezvous: {key} is {ours!r} on node 0 but "
                f"{theirs!r} on node {r} (every node needs the same model and engine flags)"
            }
            refused.append(verdict["error"])
        ns.set(f"verdict/{r}", json.dumps(verdict))
    if refused:
        try:  # the store ends with this process: let the refused nodes read why first
            ns.wait([f"read/{r}" for r in others], datetime.timedelta(seconds=10))
        except RuntimeError:
            pass
        raise NodeError("; ".join(refused))
    return token


def join_nodes(store: dist.Store, config: EngineConfig, mine: dict) -> dict:
    """Node R > 0: claim the rank, post the fingerprint, return node 0's verdict
    ({"max_model_len", "token"}); NodeError when refused or node 0 does not answer."""
    ns = dist.PrefixStore(STORE_PREFIX, store)
    r, timeout = config.node_rank, config.resolved_dist_timeout()
    if ns.add(f"claim/{r}", 1) > 1:
        raise NodeError(
            f"node rank {r} has joined node 0 already: give each node its own --node-rank"
        )
    ns.set(f"node/{r}", json.dumps(mine))
    start = time.monotonic()
    try:
        ns.wait([f"verdict/{r}"], datetime.timedelta(seconds=timeout))
        verdict = json.loads(ns.get(f"verdict/{r}"))
        ns.set(f"read/{r}", "1")
    except RuntimeError as e:
        if time.monotonic() - start < timeout:
            raise NodeError(
                f"node 0 stopped before it answered node {r} (its log says why): {_first_line(e)}"
            ) from None
        raise NodeError(
            f"node 0 did not answer node {r} within {timeout:g} s (--dist-timeout)"
        ) from None
    if "error" in verdict:
        raise NodeError(verdict["error"])
    return verdict


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- node 0's end of the step channel -------------------------------------------------------


class RemoteRanks:
    """Rank 0's connections to the ranks on the other nodes (PORT+1 of dist_init_addr)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        _, port = split_host_port(config.dist_init_addr)
        # Every interface, as the TCPStore on PORT: the nodes reach node 0 by dist_init_addr.
        try:
            if socket.has_dualstack_ipv6():
                self.listener = socket.create_server(
                    ("", port + 1), family=socket.AF_INET6, dualstack_ipv6=True
                )
            else:
                self.listener = socket.create_server(("", port + 1))
        except OSError as e:
            message = f"node 0 cannot listen for its remote ranks on port {port + 1}: {e}"
            raise NodeError(message) from None
        self.conns: dict[int, multiprocessing.connection.Connection] = {}
        self.peers: dict[int, str] = {}
        self.error: str | None = None
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    def where(self, rank: int) -> str:
        peer = f" at {self.peers[rank]}" if rank in self.peers else ""
        return f"node {node_of(self.config, rank)} (tensor-parallel rank {rank}{peer})"

    def accept(self, token: str) -> None:
        """Wait (up to dist_timeout) for every remote rank to connect and present `token`."""
        pending = {r for n in range(1, self.config.nnodes) for r in node_ranks(self.config, n)}
        timeout = self.config.resolved_dist_timeout()
        deadline = time.monotonic() + timeout
        while pending:
            self.listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, peer = self.listener.accept()
            except TimeoutError:
                raise NodeError(
                    f"tensor-parallel rank(s) {sorted(pending)} did not connect to node 0 within "
                    f"{timeout:g} s (--dist-timeout): see their nodes' logs"
                ) from None
            sock.setblocking(True)
            conn = multiprocessing.connection.Connection(sock.detach())
            hello = _read(conn, wait=10.0)
            rank = hello.get("rank") if hello else None
            if hello is None or hello.get("token") != token or rank not in pending:
                conn.close()  # a stray connection, or a rank of an earlier attempt
                continue
            # An IPv4 peer on the dual-stack listener reads ::ffff:a.b.c.d.
            self.conns[rank], self.peers[rank] = conn, peer[0].removeprefix("::ffff:")
            pending.discard(rank)
        self.listener.close()

    def watch(self, on_death: Callable[[str], None], closing: threading.Event) -> None:
        """Start the monitor thread: `on_death(message)` once, on the first remote rank to fail
        (never after `closing` is set)."""
        self._monitor = threading.Thread(
            target=self._watch, args=(on_death, closing), name="atom-node-monitor", daemon=True
        )
        self._monitor.start()

    def _watch(self, on_death: Callable[[str], None], closing: threading.Event) -> None:
        by_conn = {conn: rank for rank, conn in self.conns.items()}
        last_seen = dict.fromkeys(self.conns, time.monotonic())
        awake = time.monotonic()
        while by_conn and not closing.is_set():
            ready = multiprocessing.connection.wait(list(by_conn), timeout=HEARTBEAT_S)
            now = time.monotonic()
            if now - awake > HEARTBEAT_TIMEOUT_S / 2:  # this thread was starved, not the peers
                last_seen = dict.fromkeys(last_seen, now)
            awake = now
            dead = None
            for conn in ready:
                rank = by_conn[conn]
                message = _read(conn)
                if message is None:
                    dead = f"{self.where(rank)} went away: its connection closed"
                elif message.get("kind") == "error":
                    last = (message.get("text") or "").strip().splitlines() or ["no message"]
                    dead = f"{self.where(rank)} failed: {last[-1]}"
                    logger.error("%s:\n%s", dead, message.get("text"))
                last_seen[rank] = now
            for rank, seen in last_seen.items():
                if dead is None and now - seen > HEARTBEAT_TIMEOUT_S:
                    dead = f"{self.where(rank)} sent no heartbeat for {now - seen:.0f} s"
            if dead is not None:
                if not closing.is_set():
                    with self._lock:
                        self.error = self.error or dead
                    on_death(dead)
                return

    def send(self, message: bytes) -> None:
        for conn in self.conns.values():
            conn.send_bytes(message)

    def finish(self, message: bytes, timeout: float) -> None:
        """Send the shutdown `message` and wait up to `timeout` s for each remote rank to close
        its end (call with the monitor's `closing` set). Closing first could reset the
        connection, the message unread (unread heartbeats make Linux send RST, not FIN)."""
        for conn in self.conns.values():
            try:
                conn.send_bytes(message)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        if self._monitor is not None:  # one reader at a time: it ends within HEARTBEAT_S
            self._monitor.join(max(0.0, deadline - time.monotonic()))
        for conn in self.conns.values():
            while time.monotonic() < deadline:
                try:
                    if conn.poll(max(0.0, deadline - time.monotonic())):
                        conn.recv_bytes()
                except (EOFError, OSError):
                    break
        self.close()

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass


def _read(conn, wait: float = 0.0) -> dict | None:
    """One status message, or None for a closed connection (or nothing within `wait` s)."""
    try:
        if wait and not conn.poll(wait):
            return None
        return json.loads(conn.recv_bytes(1 << 20))
    except (EOFError, OSError, ValueError):
        return None


# -- a remote rank's end ----------------------------------------------------------------------


class StepChannel:
    """A remote rank's connection to rank 0: steps in (`recv_bytes`), status out (`send((kind,
    text))`, as a local worker's status pipe), a heartbeat every HEARTBEAT_S from a thread."""

    def __init__(self, rank: int, host: str, port: int, token: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise NodeError(
                        f"rank {rank} cannot reach node 0 at {host}:{port}: {e}"
                    ) from None
                time.sleep(0.2)
        sock.settimeout(None)
        self.conn = multiprocessing.connection.Connection(sock.detach())
        self._lock = threading.Lock()
        self._send({"kind": "connect", "rank": rank, "token": token})
        threading.Thread(target=self._beat, name="atom-heartbeat", daemon=True).start()

    def _send(self, message: dict) -> None:
        with self._lock:
            self.conn.send_bytes(json.dumps(message).encode())

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                self._send({"kind": "beat"})
            except OSError:  # node 0 is gone: nothing to wait for (a collective may hold the rank)
                os._exit(1)

    def send(self, message: tuple[str, str | None]) -> None:
        kind, text = message
        self._send({"kind": kind, "text": text})

    def recv_bytes(self) -> bytes:
        try:
            return self.conn.recv_bytes()
        except (EOFError, OSError):
            raise NodeError("node 0 closed the step connection without a shutdown") from None
