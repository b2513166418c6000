"""`atom serve` on several GPUs (issue 34 item 4), as a subprocess queried with the `openai` client:
- TP=4 with expert parallelism and an fp8 KV cache (4 GPUs) on a random Qwen3-MoE with the bundled
  SmolLM2 tokenizer: chat and completions, streamed and not, answer non-empty text, usage counts
  and finish reasons, greedy streams equal the non-streamed text; SIGTERM ends it cleanly (0, or
  uvicorn's re-raised SIGTERM) and leaves no process behind;
- DP=2 x TP=2 (4 GPUs): two replica processes answer concurrent requests with one GPU's float32
  greedy text, and /metrics sums their caches;
- a rank killed under load (2 GPUs): with TP=2 its tensor-parallel worker, with DP=2 a data-parallel
  replica's process; and a TP=2 worker that raises inside a step (ATOM_TEST_WORKER_FAILURE). Every
  open stream ends with an error within 10 s, /health answers 503 while the server still answers,
  the server exits with status 1 within 60 s naming the rank, and nothing it started is left.

The server runs as `python -m atom_engine.cli.main` (the GPU machine runs the workspace from source,
without the console script) in a session of its own, so whatever it started is found after it exits.
Each case has a CPU variant (gloo), marked slow: in CI for the TP=4 server and the TP workers
(the killed replica's is test_data_parallel.py), the other with ATOM_MULTI_GPU_ON_CPU=1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from transformers import Qwen3MoeConfig

from atom_engine import LLM, SamplingParams
from atom_engine.testing import http, start_server
from atom_engine.workers import FAILURE_ENV

ON_CPU = os.environ.get("ATOM_MULTI_GPU_ON_CPU") == "1"
START_S = 300  # NOTE: a bound against hanging (a start with workers took ~100 s on 2 CPU cores)
LONG = 3500  # tokens a killed stream asks for: seconds of decoding, still running at the kill


def devices(gpus: int, cpu_in_ci: bool = False) -> list:
    """The GPU case, and the CPU one (slow) in CI when `cpu_in_ci`, else with ON_CPU."""
    out = [pytest.param("cuda", marks=pytest.mark.multi_gpu(gpus))]
    return out + ([pytest.param("cpu", marks=pytest.mark.slow)] if ON_CPU or cpu_in_ci else [])


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    """A Qwen3-MoE shape that splits 2 and 4 ways (8 heads, 4 KV heads, 16 experts of 256
    features), the SmolLM2 tokenizer's 49,152-token vocabulary, tied embeddings."""
    config = Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    path, _ = tiny_checkpoint(config)
    return path


def _serve(path: Path, device: str, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`atom serve` in a session of its own (whatever it starts is found after it exits)."""
    engine = ("--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--num-kv-blocks", "2048")
    return start_server(
        path, log, "--device", device, *engine, *flags, new_session=True, timeout=START_S
    )


def _end(server: subprocess.Popen) -> list[int]:
    """Stop the server if it still runs; kill what its session left (after a grace period) and
    return those pids: the processes it failed to end."""
    if server.poll() is None:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 10  # a worker sees its parent gone within a second or two
    while (left := _session(server.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: state, ppid, pgrp, session, ..."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def _session(sid: int) -> list[int]:
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = _stat(int(proc.name))
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(proc.name))
    return out


def _spawned_children(pid: int) -> list[int]:
    """`pid`'s multiprocessing-spawned children (engine processes and workers), oldest first."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = _stat(int(proc.name))
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmdline:
            out.append((int(fields[18]), int(proc.name)))  # (start time, pid)
    return [p for _, p in sorted(out)]


def _spawned_leaves(pid: int) -> list[int]:
    """The spawned processes under `pid` that spawned none themselves: tensor-parallel workers,
    whether the server runs its engine in its own process or in a child of its own."""
    children = _spawned_children(pid)
    if not children:
        return []
    return [leaf for child in children for leaf in (_spawned_leaves(child) or [child])]


def usage(response) -> tuple[int, int, int]:
    u = response.usage
    return u.prompt_tokens, u.completion_tokens, u.total_tokens


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("device", devices(4, cpu_in_ci=True))
def test_serve_tp4_ep_fp8_answers_the_openai_client(checkpoint, device, tmp_path):
    model, log = str(checkpoint), tmp_path / "serve.log"
    server, url = _serve(
        checkpoint, device, log, "-tp", "4", "--enable-expert-parallel", "--kv-cache-dtype", "fp8"
    )
    left = []
    try:
        client = _client(url)
        greedy = dict(model=model, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True})
        include_usage = dict(stream=True, stream_options={"include_usage": True})
        messages = [{"role": "user", "content": "Name three colours."}]

        chat = client.chat.completions.create(messages=messages, **greedy)
        text, choice = chat.choices[0].message.content, chat.choices[0]
        assert text and choice.finish_reason == "length"
        assert chat.usage.completion_tokens == 16 and chat.usage.prompt_tokens > 0
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + 16
        chunks = list(client.chat.completions.create(messages=messages, **greedy, **include_usage))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert streamed == text
        assert reasons[-1] == "length" and not any(reasons[:-1])
        assert usage(chunks[-1]) == usage(chat)

        prompt = "The capital of France is"
        completion = client.completions.create(prompt=prompt, **greedy)
        text = completion.choices[0].text
        assert text and completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 16 and completion.usage.prompt_tokens > 0
        chunks = list(client.completions.create(prompt=prompt, **greedy, **include_usage))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert usage(chunks[-1]) == usage(completion)

        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        # uvicorn re-raises the SIGTERM it handled once it has shut down (as test_server_shutdown)
        assert server.returncode in (0, -signal.SIGTERM), log.read_text()[-4000:]
    finally:
        left = _end(server)
    assert left == [], f"processes left behind: {left}"


class _Stream(threading.Thread):
    """One streamed completion read to its end: how it ended (`outcome`) and when (`ended`)."""

    def __init__(self, client: openai.OpenAI, model: str, index: int) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.index = client, model, index
        self.started = threading.Event()
        self.outcome: str | None = None
        self.ended: float | None = None

    def run(self) -> None:
        finish = None
        try:
            stream = self.client.completions.create(
                model=self.model, prompt=f"Count to a thousand, {self.index}:", max_tokens=LONG,
                temperature=0.0, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                self.started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            self.outcome = f"finished: {finish}" if finish else "cut off without a finish reason"
        except Exception as e:  # the error event (openai.APIError), or a dropped connection
            self.outcome = f"error: {type(e).__name__}: {e}"
        finally:
            self.ended = time.monotonic()
            self.started.set()


def _fail_under_load(
    server: subprocess.Popen, url: str, log: Path, model: str, victim=None, survivors: int = 0
) -> tuple[int | None, str]:
    """Open 4 long streams; once each has its first token, SIGKILL `victim()`'s pid (or, without
    a victim, wait for the failure the server was started to inject), and check that every stream
    ends within 10 s of the kill (of the first stream's end), with an error but for at most
    `survivors` (a healthy replica's, which may finish while the server drains), /health and the
    exit; returns (the pid killed, the server's output)."""
    streams = [_Stream(_client(url), model, i) for i in range(4)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(120), "a stream got no first token"
    assert not any(s.ended for s in streams), [s.outcome for s in streams]
    pid = None
    if victim is not None:
        pid = victim()
        os.kill(pid, signal.SIGKILL)
        failed = time.monotonic()
    else:
        deadline = time.monotonic() + 120
        while not any(s.ended for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        failed = min((s.ended for s in streams if s.ended), default=time.monotonic())
    for stream in streams:
        stream.join(max(0.0, failed + 10 - time.monotonic()))
    outcomes = [s.outcome for s in streams]
    assert all(s.ended is not None and s.ended - failed < 10 for s in streams), outcomes
    assert sum(o.startswith("finished") for o in outcomes) <= survivors, outcomes
    assert all(o.startswith(("finished", "error")) for o in outcomes), outcomes
    try:
        health = http("GET", url + "/health").status_code
    except OSError:  # the server is already gone
        health = None
    assert health in (503, None), f"/health answered {health} after the failure"
    server.wait(timeout=max(1.0, failed + 60 - time.monotonic()))
    output = log.read_text()
    assert server.returncode == 1, output[-4000:]
    return pid, output


@pytest.mark.parametrize("device", devices(2, cpu_in_ci=True))
def test_killing_a_tp_worker_under_load_ends_the_server(checkpoint, device, tmp_path):
    log = tmp_path / "serve.log"
    server, url = _serve(checkpoint, device, log, "-tp", "2")
    try:

        def worker() -> int:
            (leaf,) = _spawned_leaves(server.pid)
            return leaf

        pid, output = _fail_under_load(server, url, log, str(checkpoint), worker)
        assert f"tensor-parallel worker rank 1 (pid {pid}) exited with code -9" in output, output
    finally:
        left = _end(server)
    assert left == [], f"processes left behind: {left}"


@pytest.mark.parametrize("device", devices(2))
def test_killing_a_data_parallel_replica_under_load_ends_the_server(checkpoint, device, tmp_path):
    log = tmp_path / "serve.log"
    server, url = _serve(checkpoint, device, log, "-dp", "2")
    try:

        def replica_1() -> int:
            replicas = _spawned_children(server.pid)  # one process per replica, oldest first
            assert len(replicas) == 2, replicas
            for pid in replicas:  # where a replica is pinned to its GPU by its environment
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if device == "cuda" and b"CUDA_VISIBLE_DEVICES=1" in env:
                    return pid
            return replicas[1]

        # The front spreads the 4 streams 2 and 2: replica 0's may finish while the server
        # drains (on a GPU they did: 3,500 tokens of this model in seconds).
        _, output = _fail_under_load(server, url, log, str(checkpoint), replica_1, survivors=2)
        assert "data-parallel replica 1" in output, output
    finally:
        left = _end(server)
    assert left == [], f"processes left behind: {left}"


@pytest.mark.parametrize("device", devices(2, cpu_in_ci=True))
def test_a_worker_failing_inside_a_step_ends_the_server(checkpoint, device, tmp_path, monkeypatch):
    monkeypatch.setenv(FAILURE_ENV, "1:200")  # the server's workers inherit it
    log = tmp_path / "serve.log"
    server, url = _serve(checkpoint, device, log, "-tp", "2")
    try:
        _, output = _fail_under_load(server, url, log, str(checkpoint))
        assert "tensor-parallel worker rank 1" in output, output
        assert f"{FAILURE_ENV}: rank 1 fails its step 200" in output, output
    finally:
        left = _end(server)
    assert left == [], f"processes left behind: {left}"


@pytest.mark.parametrize("device", devices(4))
def test_serve_dp2_tp2_answers_like_one_gpu(checkpoint, device, tmp_path):
    """`atom serve -dp 2 -tp 2`: two replica processes of two ranks each answer concurrent
    requests with one GPU's float32 greedy text, and /metrics sums both replicas' caches."""
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,", "def fibonacci(n):"]
    engine = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=2048)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(checkpoint), device=device, dtype="float32", **engine) as llm:
        expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    log = tmp_path / "serve.log"
    server, url = _serve(checkpoint, device, log, "-dp", "2", "-tp", "2", "--dtype", "float32")
    try:
        client = _client(url)

        def complete(prompt: str) -> str:
            reply = client.completions.create(
                model=str(checkpoint), prompt=prompt, max_tokens=16, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return reply.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts * 2))
        assert got == expected * 2
        metrics = http("GET", url + "/metrics").text
        assert "atom:num_kv_blocks 4096" in metrics.replace(".0\n", "\n"), metrics
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        assert server.returncode in (0, -signal.SIGTERM), log.read_text()[-4000:]
    finally:
        left = _end(server)
    assert left == [], f"processes left behind: {left}"
