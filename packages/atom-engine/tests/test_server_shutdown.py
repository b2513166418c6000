"""`atom serve` on SIGTERM: requests in flight get `--drain-timeout` seconds, then end with an
error event, and the process exits (a 4,000-token stream once kept it alive ~172 s)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

from atom_engine.testing import http

ATOM = str(Path(sys.executable).parent / "atom")  # the [project.scripts] entry point
DRAIN_TIMEOUT = 2.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_drains_within_the_timeout():
    port = _free_port()
    server = subprocess.Popen(
        [ATOM, "serve", "--port", str(port), "--dtype", "float32", "--device", "cpu",
         "--max-model-len", "2048", "--drain-timeout", str(DRAIN_TIMEOUT),
         "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if http("GET", url + "/health").status_code == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        body = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True,
                "stream": True}  # fmt: skip
        connection = HTTPConnection(f"127.0.0.1:{port}", timeout=120)
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 200
        first = response.readline().decode()
        assert first.startswith("data: {"), first

        server.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        lines = response.read().decode().splitlines()
        events = [line[6:] for line in lines if line.startswith("data: ")]
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and error["code"] == 503
        assert "shutting down" in error["message"]
        # The stream ran for the drain timeout, then ended.
        assert time.monotonic() - sent >= DRAIN_TIMEOUT - 0.5
        server.wait(timeout=60)
        # NOTE: a bound against hanging (the issue saw ~172 s), with room for a busy 2-core CPU
        # finishing the engine step in flight; not a speed claim.
        assert time.monotonic() - sent < DRAIN_TIMEOUT + 20
        # uvicorn re-raises the signal it caught once it has shut down.
        assert server.returncode in (0, -signal.SIGTERM), server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
