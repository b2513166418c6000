"""Helpers for tests: an app served by a real uvicorn on loopback (in a thread), `atom serve` as a
subprocess, plain HTTP requests that return error responses instead of raising, the decode graphs
on the CPU, and the engine's live worker processes."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn


@dataclass
class Response:
    status_code: int
    text: str

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None):
    """One request on a new connection; any status comes back as a Response."""
    headers = {"content-type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request) as r:
            return Response(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Response(e.code, e.read().decode())


@dataclass
class Server:
    url: str
    engine: object  # the AsyncEngine behind the app
    uvicorn: uvicorn.Server
    thread: threading.Thread

    @property
    def netloc(self) -> str:
        return self.url.removeprefix("http://")

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)


def serve(app, engine) -> Server:
    """Serve `app` on a free loopback port from a daemon thread; returns once it listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    return Server(f"http://127.0.0.1:{port}", engine, server, thread)


def wait_idle(engine, timeout: float = 60.0) -> None:
    """Wait until the AsyncEngine runs nothing and holds no KV block."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the engine is not idle: {engine.stats()}")


def eager_decode_graphs(runner, on_replay=None):
    """Give a CPU runner the real `DecodeGraphs` (their static buffers, host staging and input
    gathers) with each graph replaced by the eager forward over those buffers, and pageable
    memory for pinned: the decode-graph path of a GPU engine, testable here. `on_replay(seconds)`
    is told each replay's forward time."""
    from unittest import mock

    from atom_engine.graphs import StepGraphs
    from atom_engine.graphs.decode import DecodeGraphs
    from atom_models import set_forward_context

    class EagerReplay:
        def __init__(self, graphs, bs: int, out: torch.Tensor) -> None:
            self.graphs, self.bs, self.out = graphs, bs, out

        def replay(self) -> None:
            t0 = time.perf_counter()
            with set_forward_context(self.graphs._metadata(self.bs)):
                self.out.copy_(self.graphs._forward(self.bs))
            if on_replay is not None:
                on_replay(time.perf_counter() - t0)

        def reset(self) -> None:  # `DecodeGraphs.close`
            self.graphs = None

    def capture(self) -> None:
        for bs in self.sizes:
            out = torch.empty(bs, runner.hidden_size, dtype=runner.dtype)
            self.graphs[bs] = (EagerReplay(self, bs, out), out)
        self.pool = None

    with (
        mock.patch.object(DecodeGraphs, "_capture", capture),
        mock.patch.object(torch.Tensor, "pin_memory", lambda t: t),
    ):
        graphs = DecodeGraphs(runner, max(1, runner.config.max_num_seqs))
    runner.graphs = StepGraphs(graphs)
    runner.sampled = graphs.sampled
    return graphs


def workers_of(pid: int) -> list[int]:
    """Live child processes of `pid` started by multiprocessing's spawn (the engine's workers;
    not its resource tracker). Reads /proc."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(ppid) == pid and state != "Z" and b"spawn_main" in cmdline:
            out.append(int(proc.name))
    return out


def free_port(span: int = 1) -> int:
    """A loopback port free now; with `span`, one whose next span - 1 ports are free too (the
    multi-node rendezvous listens on PORT and PORT + 1): each checked by binding it on every
    interface, all held until the last is bound."""
    while True:
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port + span - 1 > 65535:
                continue
            try:
                for n in range(1, span):
                    held.enter_context(socket.socket()).bind(("", port + n))
            except OSError:
                continue
            return port


def health(url: str) -> int | None:
    """/health's status, or None when nothing listens (the server has stopped)."""
    try:
        return http("GET", url + "/health").status_code
    except OSError:
        return None


def start_server(
    model, log: Path, *flags: str, new_session: bool = False, timeout: float = 600.0
) -> tuple[subprocess.Popen, str]:
    """`atom serve --model MODEL FLAGS` on a free loopback port, as a subprocess (`python -m
    atom_engine.cli.main`: with or without the console script), its output in `log` (a pipe
    nobody reads would fill and stall it); returns (process, url) once /health answers 200.
    `new_session`: in a process session of its own (whatever it starts is found by its sid).
    Raises RuntimeError, with the log's tail, if it exits or does not start in `timeout` s."""
    port = free_port()
    command = [sys.executable, "-m", "atom_engine.cli.main", "serve", "--model", str(model)]
    server = subprocess.Popen(
        [*command, "--port", str(port), "--uvicorn-log-level", "warning", *flags],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=new_session,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while health(url) != 200:
        if server.poll() is not None or time.monotonic() > deadline:
            if server.poll() is None:
                server.kill()
                server.wait()
            raise RuntimeError(
                f"the server did not start (exit {server.returncode}):\n{log.read_text()[-4000:]}"
            )
        time.sleep(0.5)
    return server, url


def stop_server(server: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `timeout` s."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
