"""The step channel between rank 0 (node 0) and the ranks on the other nodes, opened after the
rendezvous (`nodes`): one TCP connection per remote rank to node 0's PORT+1, with
`multiprocessing.connection` framing. Rank 0 sends packed `StepInputs` (raw bytes); a remote rank
sends JSON status (its connect message with its rank and token, hello, a heartbeat every
HEARTBEAT_S, its error). Nothing from the network is unpickled.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from atom_engine.config import EngineConfig, split_host_port
from atom_engine.nodes import STORE_PREFIX, NodeError, node_of, node_ranks

logger = logging.getLogger("atom_engine")

HEARTBEAT_S = 1.0
# NOTE: a closed connection (a killed process, even a killed node's kernel) is seen at once; this
# only bounds a node that vanished silently (power, network). 8 s leaves a busy CPU's heartbeat
# thread room to be late while keeping "requests fail within 10 s".
HEARTBEAT_TIMEOUT_S = 8.0


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

    def accept(self, token: str, store: dist.Store) -> None:
        """Wait (up to dist_timeout) for every remote rank to connect and present `token`; a
        node whose rank failed first says so in `store` (`report_failure`), ending the wait."""
        pending = {r for n in range(1, self.config.nnodes) for r in node_ranks(self.config, n)}
        ns = dist.PrefixStore(STORE_PREFIX, store)
        timeout = self.config.resolved_dist_timeout()
        deadline = time.monotonic() + timeout
        while pending:
            for node in sorted({node_of(self.config, r) for r in pending}):
                if ns.check([f"failed/{node}"]):
                    text = ns.get(f"failed/{node}").decode()
                    raise NodeError(f"node {node} failed to start its ranks: {text}")
            if time.monotonic() > deadline:
                raise NodeError(
                    f"tensor-parallel rank(s) {sorted(pending)} did not connect to node 0 within "
                    f"{timeout:g} s (--dist-timeout): see their nodes' logs"
                )
            self.listener.settimeout(min(1.0, max(0.1, deadline - time.monotonic())))
            try:
                sock, peer = self.listener.accept()
            except TimeoutError:
                continue
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
        self._stopped = threading.Event()
        self._send({"kind": "connect", "rank": rank, "token": token})
        threading.Thread(target=self._beat, name="atom-heartbeat", daemon=True).start()

    def _send(self, message: dict) -> None:
        with self._lock:
            self.conn.send_bytes(json.dumps(message).encode())

    def _beat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                self._send({"kind": "beat"})
            except OSError:  # node 0 is gone: nothing to wait for (a collective may hold the rank)
                if not self._stopped.is_set():
                    os._exit(1)

    def close(self) -> None:
        """No more heartbeats; the connection closed (idempotent)."""
        self._stopped.set()
        with self._lock:
            self.conn.close()

    def send(self, message: tuple[str, str | None]) -> None:
        kind, text = message
        self._send({"kind": kind, "text": text})

    def recv_bytes(self) -> bytes:
        try:
            return self.conn.recv_bytes()
        except (EOFError, OSError):
            raise NodeError("node 0 closed the step connection without a shutdown") from None
